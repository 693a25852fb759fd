"""The multi-rank exactness sections of ``gpu_check.py``: every rank runs them, rank 0 writes the rows.

Shards are uneven with rank 1 empty. The reference is the single-process result over the whole
batch; a rank's gradient under DDP is its own gradient averaged over the ranks, so the checks compare
``x.grad / W`` with the reference's shard, and the mean over ranks of a replicated parameter's
gradient (scale, bias, BatchNorm affine) with the reference's. Errors are the largest over ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal, cast

import torch
import torch.distributed as dist
from gpu_check_losses import LOSSES, PRECISIONS, Inputs, make_inputs, ours, reference, shard, train_step
from gpu_check_report import Row, Sizes, agreed_max
from torch import Tensor, nn

from contrastive_dist import SyncBatchNorm, all_gather, info_nce, nt_xent, siglip, supcon

Communication = Literal["gather", "ring"]
COMMUNICATIONS: tuple[Communication, ...] = ("gather", "ring")
PER_ROW = ("images", "texts", "input", "output")  # tensors with one row per sample: each rank holds its shard


def uneven(rows: int, world_size: int) -> tuple[int, ...]:
    """About ``rows`` rows per rank, a different number on each, rank 1 empty."""
    return tuple(0 if rank == 1 else rows + rows * rank // world_size for rank in range(world_size))


def errors(got: dict[str, Tensor], want: dict[str, Tensor], sizes: tuple[int, ...], rank: int,
           device: torch.device) -> Row:
    """Relative errors over all ranks: ``got`` holds this rank's rows of each per-row tensor, ``want`` all rows."""
    found = {}
    for key, full in want.items():
        expected = full[sum(sizes[:rank]) : sum(sizes[: rank + 1])] if key in PER_ROW else full
        local = float((got[key].detach().double() - expected).abs().max()) if expected.numel() else 0.0
        found[key] = agreed_max(local, device) / max(float(full.abs().max()), 1e-30)
    note = ", ".join(f"{key} {error:.1e}" for key, error in found.items())
    return {"max_error": max(found.values()), "note": f"shards {list(sizes)}; relative: {note}"}


def _sum_over_ranks(tensor: Tensor) -> Tensor:
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total


def _mean_over_ranks(tensor: Tensor, world_size: int) -> Tensor:
    """What DDP applies for a replicated parameter: the mean over ranks of its gradient."""
    return _sum_over_ranks(tensor) / world_size


def _grad(leaf: Tensor) -> Tensor:
    """``leaf.grad``, or zeros where this rank's loss did not reach the leaf (an empty rank's scale)."""
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad


def exactness(rank: int, world_size: int, device: torch.device, sizes: Sizes) -> Iterator[Row]:
    """The gather, every loss in both communication modes, and SyncBatchNorm, in float64 on tiny shapes."""
    shards = uneven(sizes.exact_rows, world_size)
    generator = torch.Generator().manual_seed(1)
    full = torch.randn(sum(shards), 6, generator=generator, dtype=torch.float64).to(device)
    labels = torch.randint(0, 3, (sum(shards),), generator=generator).to(device)
    base = {"dtype": "float64", "ranks": world_size, "batch": sum(shards)}
    for given in (None, shards):
        local = full[sum(shards[:rank]) : sum(shards[: rank + 1])].clone().requires_grad_()
        gathered = all_gather(local, sizes=given).tensor
        (gathered * full).sum().backward()  # every rank's loss reaches every row: the grad of the sum is W · full
        got = {"value": gathered, "input": _grad(local) / world_size}
        yield {**base, "check": f"all_gather, sizes {'given' if given else 'exchanged'}",
               **errors(got, {"value": full, "input": full}, shards, rank, device)}
    # The reference: the same call over the whole batch in a group of this rank alone (the plain
    # single-process loss, itself checked against loops in the test suite). Every rank creates every group.
    alone = cast(dist.ProcessGroup, [dist.new_group([other]) for other in range(world_size)][rank])
    x = Inputs(full[:, :3], full[:, 3:], torch.tensor(0.5, dtype=torch.float64, device=device),
               torch.tensor(-1.0, dtype=torch.float64, device=device))
    for name in ("info_nce", "nt_xent", "siglip", "supcon"):
        whole = shard(x, (len(full),), 0)
        want = _run(name, "gather", whole, labels, alone)
        for communication in COMMUNICATIONS:
            local_x = shard(x, shards, rank)
            got = _run(name, communication, local_x, labels[sum(shards[:rank]) : sum(shards[: rank + 1])], None)
            got["value"] = _mean_over_ranks(got["value"], world_size)
            got["images"], got["texts"] = got["images"] / world_size, got["texts"] / world_size
            for key in ("scale", "bias"):
                if key in got:  # the same keys on every rank: they depend on the loss only
                    got[key] = _mean_over_ranks(got[key], world_size)
            yield {**base, "check": f"{name} {communication}: value and gradients (features, scale, bias)",
                   **errors(got, want, shards, rank, device)}
    yield from _syncbn(rank, world_size, device, shards, full)


def _run(name: str, communication: Communication, x: Inputs, labels: Tensor,
         group: dist.ProcessGroup | None) -> dict[str, Tensor]:
    """One loss forward and backward (``chunk_size=2``); its value and the gradient of every leaf it uses."""
    scale, mode = x.log_scale.exp(), communication
    calls: dict[str, Callable[[], Tensor]] = {
        "info_nce": lambda: info_nce(x.images, x.texts, scale, chunk_size=2, group=group, communication=mode),
        "nt_xent": lambda: nt_xent(x.images, x.texts, scale, chunk_size=2, group=group, communication=mode),
        "siglip": lambda: siglip(x.images, x.texts, scale, x.bias, chunk_size=2, group=group, communication=mode),
        "supcon": lambda: supcon(torch.stack([x.images, x.texts], 1), labels, scale, chunk_size=2, group=group,
                                 communication=mode),
    }
    value = calls[name]()
    value.backward()
    found = {"value": value.detach(), "images": _grad(x.images), "texts": _grad(x.texts), "scale": _grad(x.log_scale)}
    if name == "siglip":
        found["bias"] = _grad(x.bias)
    return found


def _syncbn(rank: int, world_size: int, device: torch.device, shards: tuple[int, ...], full: Tensor) -> Iterator[Row]:
    """Ours, and ``torch.nn.SyncBatchNorm`` on CUDA, on the same shards (empty rank included) vs one BatchNorm."""
    images = full.reshape(-1, 3, 2, 1)  # (N, C=3, H=2, W=1): one image per row of ``full``, so shards match
    weights = torch.randn(images.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    candidates: list[tuple[str, Callable[[], nn.Module]]] = [("SyncBatchNorm", lambda: SyncBatchNorm(3))]
    if device.type == "cuda":  # torch's own runs on CUDA only
        candidates.append(("torch.nn.SyncBatchNorm", lambda: nn.SyncBatchNorm(3)))
    reference_layer = nn.BatchNorm2d(3).to(device, torch.float64)
    whole = images.clone().requires_grad_()
    expected = reference_layer(whole)
    (expected * weights).sum().backward()  # = the sum over ranks of their (out · weights)
    want = {"output": expected.detach(), "input": _grad(whole), "weight": _grad(reference_layer.weight),
            "bias": _grad(reference_layer.bias), "running_var": reference_layer.running_var}
    rows = slice(sum(shards[:rank]), sum(shards[: rank + 1]))
    for name, build in candidates:
        layer = build().to(device, torch.float64)
        local = images[rows].clone().requires_grad_()
        try:  # a failure of torch's kernel (e.g. a dtype it lacks) is the same on every rank: report it, go on
            output = layer(local)
            (output * weights[rows]).sum().backward()
        except RuntimeError as error:
            yield {"check": name, "ranks": world_size, "note": f"failed: {error}".splitlines()[0]}
            continue
        # Each rank's loss covers its own rows, so the reference's loss is the sum of the ranks' losses:
        # the input's gradient is the rank's own (the layer's backward adds the other ranks' part),
        # a parameter's is the sum over ranks.
        weight, bias = cast(Tensor, layer.weight), cast(Tensor, layer.bias)
        got = {"output": output.detach(), "input": _grad(local), "weight": _sum_over_ranks(_grad(weight)),
               "bias": _sum_over_ranks(_grad(bias)), "running_var": cast(Tensor, layer.running_var)}
        yield {"check": f"{name}: output, gradients (input, weight, bias), running var", "dtype": "float64",
               "ranks": world_size, "batch": sum(shards), **errors(got, want, shards, rank, device)}


def precision_at_scale(rank: int, world_size: int, device: torch.device, sizes: Sizes) -> Iterator[Row]:
    """bf16 features, ``sizes.scale_rows`` rows a rank (rank 1 empty), both modes, against the float64 reference."""
    precision = PRECISIONS["bf16"]
    shards = uneven(sizes.scale_rows, world_size)
    for loss in LOSSES:
        whole = make_inputs(sum(shards), sizes.dim, precision.dtype, device, seed=3)
        want = reference(loss, whole)
        for communication in COMMUNICATIONS:
            x = shard(whole, shards, rank)
            value = train_step(ours(loss, chunk_size=sizes.chunk_sizes[0], communication=communication),
                               x, precision, device)()
            got = {"value": _mean_over_ranks(value, world_size), "images": _grad(x.images) / world_size,
                   "texts": _grad(x.texts) / world_size, "scale": _mean_over_ranks(_grad(x.log_scale), world_size)}
            if loss == "siglip":
                got["bias"] = _mean_over_ranks(_grad(x.bias), world_size)
            yield {"check": f"{loss} {communication}: value and gradients vs float64", "dtype": "bfloat16",
                   "compute": precision.ours(device), "ranks": world_size, "batch": sum(shards),
                   "chunk_size": sizes.chunk_sizes[0], **errors(got, want, shards, rank, device)}
        del whole, want
