"""The specialists ``gpu_check.py`` measures beside ours on one GPU: siglip-kernel and Inf-CL.

Each is a :data:`gpu_check_losses.LossFn` over the same inputs as ours, or ``None`` when it cannot
run here; its rows then say ``skipped:`` and why (not installed, or CUDA only): a library that is
missing costs its own rows, never the day.

* siglip-kernel 0.1.2 (Triton, CUDA only; even its import asks the driver for the GPU): its default
  entry point ``fused_siglip_loss``; its chunked bf16 kernel at ``chunk_size=1024`` (the router takes
  no chunk size); and its ``DistributedSigLIPLoss`` with ``strategy="ring"`` and ``"gather"``. That
  module takes ``rank`` and ``world_size`` from its constructor, and with ``world_size <= 1`` it
  computes one local block whatever the strategy (:data:`ONE_RANK_BRANCH`).
* Inf-CL 1.2.1 (``inf_cl``, Triton): each call is the cross-entropy of one direction, so the
  symmetric InfoNCE is the mean of two calls with the roles swapped. Its ``scale`` is the
  exponentiated scale and multiplies the first argument only; it upcasts the features to float32,
  and its kernels' dots run in TF32. ``cal_flash_loss`` is the one-GPU loss (CUDA only);
  ``cal_ring_loss`` and ``cal_inf_loss`` run their rings on the default process group when one
  exists, and all-reduce the scale's gradient. ``cal_ring_loss``'s ring is plain torch, the one path
  that runs on CPU (under gloo, whose single rank refuses its backward's send to itself).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from gpu_check_losses import Inputs, LossFn, Method, Precision
from torch import Tensor

SIGLIP_KERNEL = "siglip-kernel"
SIGLIP_KERNEL_MISSING = "skipped: siglip-kernel is not installed (pip install siglip-kernel, or its wheel: gpu_day.sh)"
SIGLIP_KERNEL_CUDA = "skipped: siglip-kernel runs on CUDA only (Triton)"
SIGLIP_KERNEL_COMPUTE = "siglip-kernel's own route for the dtype (bf16: cuBLAS products, Triton BCE)"
ONE_RANK_BRANCH = ("world_size=1: its W<=1 branch, one local block (the chunked bf16 kernel, positives on the "
                   "diagonal), the same work as its one-GPU call whatever the strategy; its exchange runs only at W>=2")
INF_CL = "Inf-CL"
INF_CL_MISSING = "skipped: inf-cl is not installed (pip install inf-cl==1.2.1, or its wheel: gpu_day.sh)"
INF_CL_CUDA = "skipped: Inf-CL's flash kernels run on CUDA only (Triton; they assert CUDA tensors)"
INF_CL_COMPUTE = "Inf-CL's Triton kernels: features upcast to fp32, TF32 dots"
INF_CL_NOTE = ("mean of two one-direction calls; its scale (exp of the log scale) multiplies q only, "
               "in q's dtype (bf16 here) before its upcast")
INF_CL_ENTRIES = ("cal_flash_loss", "cal_ring_loss", "cal_inf_loss")
HEAD_DIMS = (256, 128, 64, 32, 16)  # Inf-CL splits D into heads of a power of two, 16 to 256


def siglip_kernel_loss(*, chunk_size: int | None = None) -> LossFn | None:
    """siglip-kernel's SigLIP (Triton, CUDA only), or ``None`` when it does not import.

    ``chunk_size=None``: its default entry point (``fused_siglip_loss``, which picks the kernel and
    the chunk for the dtype and GPU); a number: its chunked bf16 kernel at that chunk. It takes the
    log of the scale, as our inputs hold it, and normalises as ours does (the sum over pairs / B).
    """
    try:
        import siglip_kernel
    except Exception:  # noqa: BLE001 - a library that fails to import is missing for the comparison
        return None
    if chunk_size is None:
        return lambda x: siglip_kernel.fused_siglip_loss(x.images, x.texts, x.log_scale, x.bias)
    return lambda x: siglip_kernel.fused_chunked_bf16_siglip_loss(x.images, x.texts, x.log_scale, x.bias,
                                                                  chunk_size=chunk_size)


def siglip_kernel_distributed(strategy: str, *, group: dist.ProcessGroup | None = None) -> LossFn | None:
    """siglip-kernel's ``DistributedSigLIPLoss`` (the exponentiated scale, as open_clip passes it), or ``None``.

    Without ``group``: ``world_size=1``; with one: its rank and size, as a training script reads them.
    """
    try:
        from siglip_kernel import DistributedSigLIPLoss
    except Exception:  # noqa: BLE001 - a library that fails to import is missing for the comparison
        return None
    rank, world_size = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
    module = DistributedSigLIPLoss(strategy=strategy, rank=rank, world_size=world_size, process_group=group)
    return lambda x: module(x.images, x.texts, x.log_scale.exp(), x.bias)


def head_dim(dim: int) -> int:
    """The largest head Inf-CL accepts that divides ``dim`` (its ``head_dim`` argument)."""
    for size in HEAD_DIMS:
        if dim % size == 0:
            return size
    raise ValueError(f"Inf-CL needs D divisible by 16 (heads of {HEAD_DIMS}), got D = {dim}")


def inf_cl_loss(entry: str = "cal_flash_loss") -> LossFn | None:
    """Inf-CL's symmetric InfoNCE through ``entry`` (one of :data:`INF_CL_ENTRIES`), or ``None`` when it does not
    import: images→texts and texts→images, each the mean over its rows, averaged."""
    if entry not in INF_CL_ENTRIES:
        raise ValueError(f"entry must be one of {INF_CL_ENTRIES}, got {entry!r}")
    try:
        import inf_cl
    except Exception:  # noqa: BLE001 - a library that fails to import is missing for the comparison
        return None
    one_direction = getattr(inf_cl, entry)

    def symmetric(x: Inputs) -> Tensor:
        images, texts, scale = x.images, x.texts, x.log_scale.exp()
        heads = head_dim(images.shape[1])
        forward = one_direction(images, texts, scale=scale, head_dim=heads).mean()  # flash: per row; others: mean
        backward = one_direction(texts, images, scale=scale, head_dim=heads).mean()
        return (forward + backward) / 2

    return symmetric


def specialists(loss: str, precision: Precision, device: torch.device, batches: Sequence[int]) -> list[Method]:
    """The specialists' methods for bf16 rows (none in other precisions): for SigLIP siglip-kernel's default
    entry, its chunk 1024 and its distributed module on one rank; for InfoNCE Inf-CL's flash loss. The new
    entries time at ``batches``; the default entry and chunk 1024, the anchor, at every batch of the check."""
    if precision.dtype != torch.bfloat16:
        return []
    cuda = device.type == "cuda"
    if loss == "siglip":
        why = SIGLIP_KERNEL_MISSING if cuda else SIGLIP_KERNEL_CUDA
        found = [Method(label, chunk, siglip_kernel_loss(chunk_size=chunk) if cuda else None, SIGLIP_KERNEL_COMPUTE,
                        why) for label, chunk in ((SIGLIP_KERNEL, None), (f"{SIGLIP_KERNEL} chunk_size=1024", 1024))]
        found += [Method(f"{SIGLIP_KERNEL} DistributedSigLIPLoss {strategy}, W=1", None,
                         siglip_kernel_distributed(strategy) if cuda else None, SIGLIP_KERNEL_COMPUTE, why,
                         ONE_RANK_BRANCH, tuple(batches)) for strategy in ("ring", "gather")]
        return found
    if loss == "info_nce":
        return [Method(f"{INF_CL} cal_flash_loss, both directions", None, inf_cl_loss() if cuda else None,
                       INF_CL_COMPUTE, INF_CL_MISSING if cuda else INF_CL_CUDA, INF_CL_NOTE, tuple(batches))]
    return []
