"""The losses ``gpu_check.py`` compares, behind one signature, with their precisions and a float64 reference.

Every method gets the same inputs: features, a learnable log temperature (``logit_scale`` is its
``exp()``, as in CLIP and open_clip) and a learnable SigLIP bias, all leaves with gradients, so the
scale and bias gradient paths are checked and timed too. A step runs the forward under the
precision's context and ``backward()`` outside ``torch.autocast``, as PyTorch recommends.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_check_report import Row
from torch import Tensor

from contrastive_dist import info_nce, nt_xent, siglip, supcon
from contrastive_dist.losses import product_route

LOSSES = ("info_nce", "siglip")
PROFILED = (*LOSSES, "nt_xent", "supcon")
"""What ``gpu_profile.py`` times: the compared losses, and NT-Xent and SupCon (images and texts as two views,
SupCon's labels one per 16 samples)."""
SUPCON_SAMPLES_PER_LABEL = 16


@dataclass(frozen=True)
class Precision:
    """How a row's features are stored and how each method multiplies them (its ``compute`` label)."""

    name: str
    dtype: torch.dtype
    autocast: bool  # forward under torch.autocast(dtype=bfloat16), as mixed-precision training runs it
    tf32: bool  # float32 products may use TF32 (torch.set_float32_matmul_precision("high"))
    open_clip: str

    def ours(self, device: torch.device) -> str:
        """Our core's route, as it resolves it here (``CONTRASTIVE_DIST_PRODUCTS``, device, torch version)."""
        route = product_route(self.dtype, device)
        if self.dtype == torch.float32:
            route += " (TF32)" if self.tf32 else " (IEEE, TF32 off)"
        return f"{route}; fp32 logits and state"


PRECISIONS = {
    "bf16": Precision("bf16", torch.bfloat16, True, False, "bf16 products, bf16 logits (autocast)"),
    "fp32": Precision("fp32", torch.float32, False, False, "IEEE fp32 products (TF32 off)"),
    "tf32": Precision("tf32", torch.float32, False, True, "TF32 products"),
}


@dataclass
class Inputs:
    """One rank's leaves: features ``(n, D)``, ``log_scale`` and ``bias`` ``()``; and the samples' ``ids`` ``(n,)``."""

    images: Tensor
    texts: Tensor
    log_scale: Tensor
    bias: Tensor
    ids: Tensor | None = None

    def leaves(self) -> tuple[Tensor, ...]:
        return self.images, self.texts, self.log_scale, self.bias


def make_inputs(batch: int, dim: int, dtype: torch.dtype, device: torch.device, *, seed: int = 0) -> Inputs:
    """Unit-norm random features (drawn in float32 on ``device``, then cast), scale 1/0.07, bias −10; ids
    with one sample in 50 sharing its neighbour's (repeated captions)."""
    generator = torch.Generator(device).manual_seed(seed)
    images, texts = (F.normalize(torch.randn(batch, dim, generator=generator, device=device), dim=-1).to(dtype)
                     for _ in range(2))
    log_scale = torch.tensor(math.log(1 / 0.07), device=device)
    bias = torch.tensor(-10.0, device=device)
    ids = torch.arange(batch, device=device)
    ids[1::50] = ids[0::50][: len(ids[1::50])]
    return Inputs(*(leaf.requires_grad_() for leaf in (images, texts, log_scale, bias)), ids=ids)


def shard(x: Inputs, sizes: tuple[int, ...], rank: int) -> Inputs:
    """Rank ``rank``'s rows of a global batch, as fresh leaves (scale and bias copied)."""
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    return Inputs(*(leaf.detach()[rows].clone().requires_grad_() for leaf in (x.images, x.texts)),
                  *(leaf.detach().clone().requires_grad_() for leaf in (x.log_scale, x.bias)),
                  ids=None if x.ids is None else x.ids[rows])


LossFn = Callable[[Inputs], Tensor]


class Method(NamedTuple):
    """One loss as the check runs it: its row label, chunk cell, function and ``compute`` label.

    ``fn`` is ``None`` when it cannot run here, and ``missing`` says why; ``note`` goes into each of its
    rows; ``batches``: its own global batches for the speed rows (``None``: the check's).
    """

    label: str
    chunk_size: int | None
    fn: LossFn | None
    compute: str
    missing: str = ""
    note: str = ""
    batches: tuple[int, ...] | None = None


def ours(loss: str, *, chunk_size: int | None, communication: Literal["gather", "ring"] = "gather",
         group: dist.ProcessGroup | None = None, ids: bool = False) -> LossFn:
    """This package's loss (one of :data:`PROFILED`), through its public functions; ``ids``: with the samples'
    ids (``same_id="mask"``; InfoNCE and SigLIP)."""
    if loss == "nt_xent":
        return lambda x: nt_xent(x.images, x.texts, x.log_scale.exp(), chunk_size=chunk_size,
                                 communication=communication, group=group)
    if loss == "supcon":
        return lambda x: supcon(torch.stack((x.images, x.texts), 1), _labels(x), x.log_scale.exp(),
                                chunk_size=chunk_size, communication=communication, group=group)
    if loss == "info_nce":
        return lambda x: info_nce(x.images, x.texts, x.log_scale.exp(), chunk_size=chunk_size,
                                  communication=communication, group=group, ids=x.ids if ids else None)
    return lambda x: siglip(x.images, x.texts, x.log_scale.exp(), x.bias, chunk_size=chunk_size,
                            communication=communication, group=group, ids=x.ids if ids else None)


def _labels(x: Inputs) -> Tensor:
    """SupCon's labels: :data:`SUPCON_SAMPLES_PER_LABEL` consecutive samples share one."""
    return torch.arange(x.images.shape[0], device=x.images.device) // SUPCON_SAMPLES_PER_LABEL


def open_clip_loss(loss: str, *, rank: int = 0, world_size: int = 1) -> LossFn | None:
    """open_clip's ``ClipLoss`` / ``SigLipLoss`` (``local_loss`` and ``gather_with_grad`` on several ranks,
    its documented distributed setting), or ``None`` when open_clip is not installed (the ``dev`` extra)."""
    try:
        from open_clip.loss import ClipLoss, SigLipLoss
    except ImportError:
        return None
    if loss == "info_nce":
        clip = ClipLoss(local_loss=world_size > 1, gather_with_grad=world_size > 1, rank=rank, world_size=world_size)
        return lambda x: clip(x.images, x.texts, x.log_scale.exp())
    sigmoid = SigLipLoss(rank=rank, world_size=world_size)
    return lambda x: sigmoid(x.images, x.texts, x.log_scale.exp(), x.bias)


@contextlib.contextmanager
def matmul_precision(tf32: bool) -> Iterator[None]:
    """float32 products in TF32 (``True``) or IEEE float32 (``False``); the caller's setting comes back after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def train_step(fn: LossFn, x: Inputs, precision: Precision, device: torch.device) -> Callable[[], Tensor]:
    """Forward under the precision's context, backward outside autocast; returns the loss."""

    def step() -> Tensor:
        with matmul_precision(precision.tf32):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision.autocast):
                value = fn(x)
            value.backward()
        return value.detach()

    return step


def gradients(loss: str, value: Tensor, x: Inputs) -> dict[str, Tensor]:
    """The value and the gradient of every leaf that the loss uses, in float64."""
    found = {"value": value, "images": x.images.grad, "texts": x.texts.grad, "scale": x.log_scale.grad}
    if loss == "siglip":
        found["bias"] = x.bias.grad
    return {key: tensor.detach().double() for key, tensor in found.items() if tensor is not None}


def reference(loss: str, x: Inputs, ids: bool = False) -> dict[str, Tensor]:
    """The single-process loss over ``x`` in float64, written out in plain PyTorch; value and gradients.

    ``ids``: a pair of two samples that share an id is no negative (``same_id="mask"``): left out.
    """
    leaves = Inputs(*(leaf.detach().double().requires_grad_() for leaf in x.leaves()))
    logits = leaves.log_scale.exp() * leaves.images @ leaves.texts.T
    own = torch.eye(len(logits), dtype=torch.bool, device=logits.device)
    left_out = torch.zeros_like(own) if not ids or x.ids is None else (x.ids[:, None] == x.ids[None, :]) & ~own
    if loss == "info_nce":  # CLIP: the mean of image→text and text→image cross-entropy
        labels = torch.arange(len(logits), device=logits.device)
        logits = logits.masked_fill(left_out, float("-inf"))
        value = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
    else:  # SigLIP: −log σ(±logit) over every pair, summed per image, averaged over images
        signs = 2 * own.to(logits.dtype) - 1
        value = -F.logsigmoid(signs * (logits + leaves.bias)).masked_fill(left_out, 0.0).sum() / len(logits)
    value.backward()
    return gradients(loss, value, leaves)


def relative_errors(got: dict[str, Tensor], want: dict[str, Tensor]) -> Row:
    """``max_error`` (the worst) and a note with each one: max |got − want| / max |want| per tensor."""
    errors = {}
    for key, expected in want.items():
        difference = (got[key] - expected).abs().max() if expected.numel() else expected.new_zeros(())
        errors[key] = float(difference / expected.abs().max().clamp(min=1e-30)) if expected.numel() else 0.0
    note = ", ".join(f"{key} {error:.1e}" for key, error in errors.items())
    return {"max_error": max(errors.values()), "note": f"relative: {note}"}

