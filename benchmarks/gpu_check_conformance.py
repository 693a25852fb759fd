"""The conformance section of ``gpu_check.py``: the specialists' distributed entry points on a 1-rank group.

One GPU can run them. For this section the one process makes a process group of one rank (NCCL on
CUDA, gloo on CPU), and tears it down afterwards. It is the default group, because Inf-CL's rings
always use that one. Each entry point then runs on float32 features with TF32 off, against the float64
reference: the value and every gradient. Torch's products are IEEE; Inf-CL's kernels keep their TF32
dots. Ours runs in ring mode on the same group:

* InfoNCE: Inf-CL's ``cal_flash_loss`` (which uses no group), ``cal_ring_loss`` (its ring in torch)
  and ``cal_inf_loss`` (its ring of flash kernels). Each one's gradient of the log scale is then
  divided by ours (``ratio``). When a backward raises, the row names the error first and then gives the
  value's error alone (no ``max_error``).
* SigLIP: siglip-kernel's ``DistributedSigLIPLoss`` (ring and gather), and
  ``DistributedSigLIPPlusLoss`` with the samples' ids as group ids (its parameters replaced by our
  leaves through ``torch.func.functional_call``), against a float64 SigLIP+ reference written
  here. Both take rank and world size from the group, as a training script does, and so take their
  W<=1 branch.

The last row lists what one rank cannot show, for the run on several GPUs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_check_anchors import (
    INF_CL,
    INF_CL_COMPUTE,
    INF_CL_CUDA,
    INF_CL_ENTRIES,
    INF_CL_MISSING,
    ONE_RANK_BRANCH,
    SIGLIP_KERNEL,
    SIGLIP_KERNEL_CUDA,
    SIGLIP_KERNEL_MISSING,
    inf_cl_loss,
    siglip_kernel_distributed,
)
from gpu_check_losses import (
    PRECISIONS,
    Inputs,
    LossFn,
    gradients,
    make_inputs,
    matmul_precision,
    ours,
    reference,
    relative_errors,
)
from gpu_check_report import Row, Sizes, failure, release
from torch import Tensor

PRECISION = PRECISIONS["fp32"]  # float32 features, IEEE products: what differs is each library's own arithmetic
SIGLIP_KERNEL_FP32 = "siglip-kernel: cuBLAS products in the features' dtype (IEEE fp32 here), Triton BCE"
INF_CL_NOTES = {
    "cal_flash_loss": "uses no process group, and no all-reduce of the scale's gradient",
    "cal_ring_loss": "its ring in torch on 1 rank: one block, no max subtraction in its forward (inf past "
                     "logit 88.7); its backward still passes dk on to the next rank, here itself",
    "cal_inf_loss": "its ring of flash kernels on 1 rank: one block; its backward still passes dk on to the "
                    "next rank, here itself",
}
SCALE_NOTE = ("1 rank: its all-reduce (SUM) of the scale's gradient is the identity, so this must be 1; on W "
              "ranks each rank gets the sum, W x the mean loss's gradient, and DDP's average keeps it W x: "
              "not checkable on one GPU")
PLUS_NOTE = ("its W<=1 branch: one local block / (N*M); it normalises the features and clamps the scale to "
             "[0.01, 100] itself; ids: 1 sample in 50 shares its neighbour's (positives weighted 1/k)")
NOT_ON_ONE_GPU = (
    "not checked on one GPU (gpu_check.py under torchrun on 2 GPUs or more): the exchanges of Inf-CL's rings and "
    "siglip-kernel's ring and gather (their code runs at W>=2 only), per-rank feature gradients (W x the "
    "global ones in both), Inf-CL's W x scale gradient after DDP, siglip-kernel's local scale and bias "
    "gradients (exact once DDP averages them), SigLIP+ counts over ranks, uneven or empty shards (both "
    "libraries need equal per-rank sizes)")


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[dist.ProcessGroup | None]:
    """This process as the default group of one rank, made for the section and destroyed after.

    An existing group of one rank is used as it is. ``None``: a group of several ranks exists (the
    section is for one process).
    """
    if dist.is_initialized():
        yield dist.group.WORLD if dist.get_world_size() == 1 else None
        return
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", index))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def siglip_plus_reference(x: Inputs) -> dict[str, Tensor]:
    """SigLIP+ in float64, value and gradients, with ``x.ids`` as both sides' group ids (symmetric, soft weights).

    Unit vectors; a pair is positive when its ids are equal; a positive pair weighs the mean of 1/k over
    its image's and its text's positive counts, a negative 1; the sum of their binary cross-entropies
    over N·M.
    """
    leaves = Inputs(*(leaf.detach().double().requires_grad_() for leaf in x.leaves()))
    scale = leaves.log_scale.clamp(math.log(0.01), math.log(100.0)).exp()
    logits = scale * F.normalize(leaves.images, dim=-1) @ F.normalize(leaves.texts, dim=-1).T + leaves.bias
    ids = torch.arange(len(logits), device=logits.device) if x.ids is None else x.ids
    positive = (ids[:, None] == ids[None, :]).to(logits.dtype)
    per_image, per_text = positive.sum(1, keepdim=True).clamp(min=1), positive.sum(0, keepdim=True).clamp(min=1)
    weight = torch.where(positive.bool(), 0.5 / per_image + 0.5 / per_text, torch.ones_like(logits))
    value = (weight * (F.softplus(logits) - logits * positive)).sum() / logits.numel()
    value.backward()
    return gradients("siglip", value, leaves)


def siglip_plus_loss(group: dist.ProcessGroup) -> LossFn | None:
    """siglip-kernel's ``DistributedSigLIPPlusLoss`` on ``group``, its scale and bias replaced by the inputs'
    leaves; ``None`` when it does not import."""
    try:
        from siglip_kernel import DistributedSigLIPPlusLoss
    except Exception:  # noqa: BLE001 - a library that fails to import is missing for the comparison
        return None
    module = DistributedSigLIPPlusLoss(rank=dist.get_rank(group), world_size=dist.get_world_size(group),
                                       process_group=group)

    def loss(x: Inputs) -> Tensor:
        leaves = {"logit_scale": x.log_scale, "logit_bias": x.bias}
        return torch.func.functional_call(module, leaves, ((x.images, x.texts), x.ids, x.ids))["total_loss"]

    return loss


def _attempt(fn: LossFn, x: Inputs, loss: str) -> tuple[dict[str, Tensor], str]:
    """Value and gradients of one step; when the backward raises, the value alone and the error."""
    for leaf in x.leaves():
        leaf.grad = None
    with matmul_precision(PRECISION.tf32):
        value = fn(x)
        try:
            value.backward()
        except Exception as error:  # noqa: BLE001 - the forward's value still says something
            return {"value": value.detach().double()}, f"{failure(error)} (in its backward)"
    return gradients(loss, value.detach(), x), ""


def _entries(loss: str, device: torch.device, group: dist.ProcessGroup) -> list[tuple[str, LossFn | None, str, str]]:
    """(label, function or ``None``, why it is missing, what its row notes) for ``loss``, ours first."""
    cuda = device.type == "cuda"
    mine = ("ours ring, 1-rank group", ours(loss, chunk_size=None, communication="ring", group=group), "", "")
    if loss == "info_nce":
        return [mine, *((f"{INF_CL} {entry}" + ("" if entry == "cal_flash_loss" else ", 1-rank group"),
                         inf_cl_loss(entry) if cuda or entry == "cal_ring_loss" else None,
                         INF_CL_MISSING if cuda or entry == "cal_ring_loss" else INF_CL_CUDA, INF_CL_NOTES[entry])
                        for entry in INF_CL_ENTRIES)]
    why = SIGLIP_KERNEL_MISSING if cuda else SIGLIP_KERNEL_CUDA
    found = [(f"{SIGLIP_KERNEL} DistributedSigLIPLoss {strategy}, 1-rank group",
              siglip_kernel_distributed(strategy, group=group) if cuda else None, why,
              f"rank and world_size read from the group; {ONE_RANK_BRANCH}") for strategy in ("ring", "gather")]
    plus = (f"{SIGLIP_KERNEL} DistributedSigLIPPlusLoss, 1-rank group, ids", siglip_plus_loss(group) if cuda else None,
            why, PLUS_NOTE)
    return [mine, *found, plus]


def _compute(label: str, device: torch.device) -> str:
    if label.startswith(INF_CL):
        return INF_CL_COMPUTE
    return SIGLIP_KERNEL_FP32 if label.startswith(SIGLIP_KERNEL) else PRECISION.ours(device)


def conformance(device: torch.device, sizes: Sizes) -> Iterator[Row]:
    """The section's rows: each entry point against float64 on a 1-rank group, Inf-CL's scale gradient over
    ours, and what one rank cannot check. At B = ``sizes.exact_batch``, seconds: like the exactness
    sections, it runs whatever the time budget."""
    with one_rank_group(device) as group:
        if group is None:
            yield {"check": "conformance", "note": "skipped: a process group of several ranks exists"}
            return
        x = make_inputs(sizes.exact_batch, sizes.dim, PRECISION.dtype, device)
        for loss in ("info_nce", "siglip"):
            want, ours_scale = reference(loss, x), None
            for label, fn, missing, note in _entries(loss, device, group):
                plus = "SigLIPPlus" in label
                row: Row = {"check": f"{'siglip+' if plus else loss}: {label}", "dtype": "float32",
                            "batch": sizes.exact_batch, "ranks": 1, "compute": _compute(label, device)}
                if fn is None:
                    yield {**row, "note": missing}
                    continue
                try:
                    got, broke = _attempt(fn, x, loss)
                    expected = siglip_plus_reference(x) if plus else want
                    errors = relative_errors(got, {key: value for key, value in expected.items() if key in got})
                except Exception as error:  # noqa: BLE001 - one entry's failure costs its own row only
                    yield {**row, "note": f"{failure(error)}; {note}".rstrip("; ")}
                    release(device)
                    continue
                if broke:  # a failure, named first (the summary lists it); the value's error after it, no max_error
                    yield {**row, "note": f"{broke}; value only, {errors['note']}; {note}"}
                else:
                    yield {**row, **errors, "note": f"{errors['note']}; {note}".rstrip("; ")}
                if label.startswith("ours"):
                    ours_scale = got.get("scale")
                elif label.startswith(INF_CL):
                    yield _scale_row(label, got.get("scale"), ours_scale, row, broke)
                release(device)
    yield {"check": "not checkable on one GPU", "note": NOT_ON_ONE_GPU}


def _scale_row(label: str, theirs: Tensor | None, mine: Tensor | None, row: Row, broke: str) -> Row:
    """Inf-CL's gradient of the log scale over ours (``ratio``), ``max_error`` their relative difference."""
    row = {**row, "check": f"info_nce: {label}: scale gradient / ours"}
    if theirs is None or mine is None:
        why = broke or f"{'ours' if mine is None else INF_CL} gave no scale gradient"
        return {**row, "note": f"no ratio: {why}"}
    difference = float((theirs - mine).abs() / mine.abs().clamp(min=1e-30))
    return {**row, "ratio": float(theirs / mine), "max_error": difference,
            "note": f"theirs {float(theirs):.6g}, ours {float(mine):.6g}; {SCALE_NOTE}"}
