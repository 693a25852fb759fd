"""The first row of ``gpu_check.py``: what the numbers were measured on, and under which settings.

GPU, driver, clocks, torch, CUDA, NCCL, Triton, the TF32 state, the variables that change how
products run (``CONTRASTIVE_DIST_PRODUCTS``, ``NVIDIA_TF32_OVERRIDE``,
``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``), the product route the loss core resolves for bf16 features
on this device, and the versions of the libraries compared against.
"""

from __future__ import annotations

import datetime
import importlib
import os
import platform
import subprocess

import torch
from gpu_check_report import Row

from contrastive_dist.losses import product_route

VARIABLES = ("CONTRASTIVE_DIST_PRODUCTS", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE")
# import name → distribution name
COMPARED = {"open_clip": "open_clip", "siglip_kernel": "siglip-kernel", "inf_cl": "inf-cl"}


def machine_row(device: torch.device, world_size: int) -> Row:
    """What the numbers were measured on, as one row of ``section`` ``machine``."""
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.processor() or platform.machine()})"
    facts = [f"driver {_smi('driver_version')}, clocks {_smi('clocks.sm,clocks.max.sm,clocks.mem')} (SM, max SM, "
             "memory MHz)" if cuda else "no GPU", f"torch {torch.__version__}", f"CUDA {torch.version.cuda or 'none'}"]
    if cuda:
        facts.append(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    facts += [f"Triton {_version('triton', 'triton')}", _tf32_state()]
    facts += [f"{variable}={os.environ.get(variable, '(unset)')}" for variable in VARIABLES]
    facts.append(f"bf16 route: {product_route(torch.bfloat16, device)}")
    facts += [f"{label} {_version(module, label)}" for module, label in COMPARED.items()]
    facts.append(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    return {"section": "machine", "check": f"{world_size} x {name}", "ranks": world_size, "note": "; ".join(facts)}


def _smi(query: str) -> str:
    try:
        result = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20, check=True)
        return result.stdout.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown (no nvidia-smi)"


def _tf32_state() -> str:
    try:  # the legacy flags raise once the new fp32_precision API has been used: report that one then
        matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        return f"TF32 matmul {'on' if matmul else 'off'}, cuDNN {'on' if cudnn else 'off'}"
    except RuntimeError:
        return (f"fp32_precision matmul {torch.backends.cuda.matmul.fp32_precision}, "
                f"cuDNN {torch.backends.cudnn.fp32_precision}")


def _version(module: str, label: str) -> str:
    """What the comparisons will import, not what pip's metadata says: ``not installed`` if it fails to import."""
    try:
        imported = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a library that fails to import is missing for the comparisons
        return "not installed"
    version = getattr(imported, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as distribution_version

            version = distribution_version(label)
        except Exception:  # noqa: BLE001
            version = "(version unknown)"
    return str(version)
