"""How far two common hand-written shortcuts move a distributed CLIP loss from the single-process one.

Every measurement uses one global batch, a float64 single-process reference written out below in
plain PyTorch, and the same batch split unevenly over 3 gloo processes. The distributed gradient is
what DDP would apply: the mean over ranks of each rank's parameter gradient.

* (a) :func:`gradient_error`: a gather whose backward returns only the local slice of the
  incoming gradient (many hand-written ``GatherLayer`` / ``AllGather``), against this package's
  reduce-scatter SUM, both with the contract's ``(W / N) · Σ ℓ_i`` scaling.
* (b) :func:`gradient_error` again: "mean of local means" (each rank averages its own rows, DDP
  averages the ranks), against the package's per-rank ``W / N`` scaling, both with an exact gather.
* (c) :func:`training_drift`: parameters after k SGD steps, distributed against single process,
  for the two shortcuts together ("naive") and for the package.

Run::

    python benchmarks/exactness.py           # prints the three tables

From a notebook (the functions run on spawned workers, so they live here, not in the notebook)::

    from benchmarks.exactness import gradient_error, training_drift
    rows = gradient_error()      # [{'layout': (8, 8, 8), 'variant': 'package', 'grad_error': 1e-16, ...}, ...]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist import all_gather, all_gather_many, info_nce
from contrastive_dist.testing import WorkerPool, run_distributed

WORLD_SIZE = 3
GLOBAL_BATCH = 24
LAYOUTS: tuple[tuple[int, ...], ...] = ((8, 8, 8), (12, 8, 4), (15, 3, 6), (20, 3, 1), (18, 0, 6))
VARIANTS = ("package", "local_slice", "mean_of_means", "naive")
"""package: this package's ``info_nce``; local_slice: local-slice backward, W/N scaling;
mean_of_means: exact gather, each rank averages its rows; naive: both shortcuts together."""
IN_DIM, EMBED_DIM = 16, 8


# ----------------------------------------------------------------------------- model and data


class TinyCLIP(nn.Module):
    """Two linear towers and a learnable log temperature: small enough for float64 everywhere."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.image = nn.Linear(IN_DIM, EMBED_DIM, dtype=torch.float64)
        self.text = nn.Linear(IN_DIM, EMBED_DIM, dtype=torch.float64)
        with torch.no_grad():
            for parameter in (*self.image.parameters(), *self.text.parameters()):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 0.3)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), dtype=torch.float64))

    def forward(self, images: Tensor, texts: Tensor) -> tuple[Tensor, Tensor]:
        return F.normalize(self.image(images), dim=-1), F.normalize(self.text(texts), dim=-1)

    def flat(self, grad: bool = False) -> Tensor:
        """All parameters (or their gradients) as one vector."""
        if grad:
            tensors = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.parameters()]
        else:
            tensors = list(self.parameters())
        return torch.cat([tensor.detach().reshape(-1) for tensor in tensors])


def global_batch(seed: int, n: int = GLOBAL_BATCH) -> tuple[Tensor, Tensor]:
    """Paired raw inputs: texts are a fixed linear view of the images plus noise, so there is signal."""
    generator = torch.Generator().manual_seed(1000 + seed)
    mixing = torch.randn(IN_DIM, IN_DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    images = torch.randn(n, IN_DIM, generator=generator, dtype=torch.float64)
    texts = images @ mixing / math.sqrt(IN_DIM) + 0.3 * torch.randn(n, IN_DIM, generator=generator,
                                                                    dtype=torch.float64)
    return images, texts


def reference_loss(image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    """Single-process symmetric CLIP loss over the whole batch: the quantity every variant should match."""
    logits = scale * image @ text.T
    labels = torch.arange(image.shape[0])
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))


# ----------------------------------------------------------------------------- the shortcuts


class _LocalSliceBackward(torch.autograd.Function):
    """Gathered rows forward; backward keeps only this rank's slice, with no sum over ranks."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, gathered: Tensor, offset: int) -> Tensor:  # type: ignore[override]
        ctx.offset, ctx.count = offset, local.shape[0]
        return gathered.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return grad[ctx.offset : ctx.offset + ctx.count], None, None


def local_slice_gather(x: Tensor) -> tuple[Tensor, tuple[int, ...], int]:
    """The hand-written gather: ``(gathered, sizes, offset)``, gradient only for the local rows' slice."""
    gathered = all_gather(x.detach())
    return _LocalSliceBackward.apply(x, gathered.tensor, gathered.offset), gathered.sizes, gathered.offset


def shortcut_loss(image: Tensor, text: Tensor, scale: Tensor, *, local_slice: bool, mean_of_means: bool) -> Tensor:
    """Local rows × gathered columns, with either or both shortcuts switched on."""
    world_size = dist.get_world_size()
    if local_slice:
        all_images, sizes, offset = local_slice_gather(image)
        all_texts, _, _ = local_slice_gather(text)
    else:
        gathered = all_gather_many((image, text))
        (all_images, all_texts), sizes, offset = gathered.tensors, gathered.sizes, gathered.offset
    labels = torch.arange(image.shape[0]) + offset
    per_row = 0.5 * (F.cross_entropy(scale * image @ all_texts.T, labels, reduction="none")
                     + F.cross_entropy(scale * text @ all_images.T, labels, reduction="none"))
    # An empty rank's loss must stay connected to the gathered tensors, or the others' backward waits.
    connection = 0 * (all_images.sum() + all_texts.sum())
    if mean_of_means:
        # The common recipe: average your own rows (an empty rank contributes 0), DDP averages ranks.
        return (per_row.mean() if per_row.numel() else per_row.sum()) + connection
    return per_row.sum() * world_size / sum(sizes) + connection


def _rank_loss(variant: str, image: Tensor, text: Tensor, scale: Tensor) -> Tensor:
    if variant == "package":
        return info_nce(image, text, scale)
    local_slice = variant in ("local_slice", "naive")
    mean_of_means = variant in ("mean_of_means", "naive")
    return shortcut_loss(image, text, scale, local_slice=local_slice, mean_of_means=mean_of_means)


def _ddp_average(model: nn.Module, world_size: int) -> None:
    """What DDP does to gradients: sum over ranks, divide by the number of ranks."""
    for parameter in model.parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad)
        parameter.grad /= world_size


def _slice(layout: Sequence[int], rank: int) -> slice:
    start = sum(layout[:rank])
    return slice(start, start + layout[rank])


# ----------------------------------------------------------------------------- (a) and (b): one step


def _one_step_worker(rank: int, world_size: int, layouts: Sequence[Sequence[int]], variants: Sequence[str],
                     seed: int) -> list[dict[str, Any]]:
    images, texts = global_batch(seed)
    results = []
    for layout in layouts:
        rows = _slice(layout, rank)
        for variant in variants:
            model = TinyCLIP(seed)
            image, text = model(images[rows], texts[rows])
            loss = _rank_loss(variant, image, text, model.logit_scale.exp())
            loss.backward()
            loss_value = loss.detach().clone()
            dist.all_reduce(loss_value)
            _ddp_average(model, world_size)
            results.append({"layout": tuple(layout), "variant": variant, "loss": loss_value.item() / world_size,
                            "grad": model.flat(grad=True)})
    return results


def _reference_step(seed: int) -> tuple[float, Tensor]:
    model = TinyCLIP(seed)
    image, text = model(*global_batch(seed))
    loss = reference_loss(image, text, model.logit_scale.exp())
    loss.backward()
    return loss.item(), model.flat(grad=True)


def _relative(value: Tensor, reference: Tensor) -> float:
    return ((value - reference).norm() / reference.norm()).item()


def _run(pool: WorkerPool | None, fn: Any, *args: Any) -> list[Any]:
    if pool is None:
        return run_distributed(fn, WORLD_SIZE, *args, timeout=300)
    if pool.world_size != WORLD_SIZE:
        raise ValueError(f"expected a WorkerPool of {WORLD_SIZE} ranks, got {pool.world_size}")
    return pool.run(fn, *args)


def gradient_error(layouts: Sequence[Sequence[int]] = LAYOUTS, variants: Sequence[str] = VARIANTS, *,
                   seed: int = 0, pool: WorkerPool | None = None) -> list[dict[str, Any]]:
    """Loss and DDP-averaged gradient of each variant against the float64 single-process reference.

    Returns one row per (layout, variant): ``layout``, ``variant``, ``loss`` (mean over ranks of
    the per-rank losses, what a logger averaging ranks shows), ``reference_loss``, ``loss_error``
    and ``grad_error`` (relative: ``|x - ref| / |ref|``, gradient over all parameters).
    """
    for layout in layouts:
        if len(layout) != WORLD_SIZE or sum(layout) != GLOBAL_BATCH:
            raise ValueError(f"each layout needs {WORLD_SIZE} sizes summing to {GLOBAL_BATCH}, got {layout}")
    reference, reference_grad = _reference_step(seed)
    per_rank = _run(pool, _one_step_worker, [list(x) for x in layouts], list(variants), seed)
    rows = []
    for row in per_rank[0]:
        rows.append({"layout": row["layout"], "variant": row["variant"], "loss": row["loss"],
                     "reference_loss": reference, "loss_error": abs(row["loss"] - reference) / reference,
                     "grad_error": _relative(row["grad"], reference_grad)})
    return rows


# ----------------------------------------------------------------------------- (c): k SGD steps


def _training_worker(rank: int, world_size: int, variant: str, schedule: Sequence[Sequence[int]], steps: int,
                     lr: float, seed: int) -> list[Tensor]:
    model = TinyCLIP(seed)
    trajectory = []
    for step in range(steps):
        images, texts = global_batch(seed + 1 + step)
        rows = _slice(schedule[step % len(schedule)], rank)
        model.zero_grad()
        image, text = model(images[rows], texts[rows])
        _rank_loss(variant, image, text, model.logit_scale.exp()).backward()
        _ddp_average(model, world_size)
        _sgd_step(model, lr)
        trajectory.append(model.flat())
    return trajectory


def _sgd_step(model: nn.Module, lr: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.grad is not None:
                parameter.sub_(lr * parameter.grad)


def _reference_training(steps: int, lr: float, seed: int) -> tuple[list[Tensor], list[float]]:
    model = TinyCLIP(seed)
    trajectory, losses = [], []
    for step in range(steps):
        model.zero_grad()
        image, text = model(*global_batch(seed + 1 + step))
        loss = reference_loss(image, text, model.logit_scale.exp())
        loss.backward()
        _sgd_step(model, lr)
        trajectory.append(model.flat())
        losses.append(loss.item())
    return trajectory, losses


def training_drift(variants: Sequence[str] = ("package", "naive"), *, steps: int = 40, lr: float = 0.1,
                   schedule: Sequence[Sequence[int]] = ((12, 8, 4), (8, 8, 8), (18, 0, 6), (5, 10, 9)),
                   seed: int = 0, pool: WorkerPool | None = None) -> dict[str, Any]:
    """Parameters after each of ``steps`` SGD steps, distributed (DDP-averaged) against single process.

    Step ``t`` uses a fresh global batch split as ``schedule[t % len(schedule)]``. The drift is
    relative to how far the reference has moved: ``|θ_t - θ_ref,t| / |θ_ref,t - θ_0|``.

    Returns:
        ``{"steps": [1..steps], "reference_loss": [...], "drift": {variant: [drift after each step]},
        "rank_disagreement": {variant: max |θ_rank - θ_rank0|}}``.
    """
    reference, losses = _reference_training(steps, lr, seed)
    start = TinyCLIP(seed).flat()
    drift: dict[str, list[float]] = {}
    disagreement: dict[str, float] = {}
    for variant in variants:
        per_rank = _run(pool, _training_worker, variant, [list(x) for x in schedule], steps, lr, seed)
        drift[variant] = [((theta - theta_ref).norm() / (theta_ref - start).norm()).item()
                          for theta, theta_ref in zip(per_rank[0], reference)]
        disagreement[variant] = max((a - b).abs().max().item() for trajectory in per_rank[1:]
                                    for a, b in zip(trajectory, per_rank[0]))
    return {"steps": list(range(1, steps + 1)), "reference_loss": losses, "drift": drift,
            "rank_disagreement": disagreement}


# ----------------------------------------------------------------------------- script


def _markdown(rows: list[dict[str, Any]], variants: Sequence[str], key: str) -> str:
    lines = ["| layout | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    by_layout: dict[tuple[int, ...], dict[str, float]] = {}
    for row in rows:
        by_layout.setdefault(row["layout"], {})[row["variant"]] = row[key]
    for layout, values in by_layout.items():
        lines.append(f"| {list(layout)} | " + " | ".join(f"{values[v]:.2e}" for v in variants) + " |")
    return "\n".join(lines)


def main() -> None:
    with WorkerPool(WORLD_SIZE, timeout=300) as pool:
        rows = gradient_error(pool=pool)
        drift = training_drift(pool=pool)
    print(f"W={WORLD_SIZE}, global batch N={GLOBAL_BATCH}, float64; relative error against one process\n")
    print("### (a) gradient error: local-slice backward vs reduce-scatter (both W/N scaled)\n")
    print(_markdown(rows, ("package", "local_slice"), "grad_error"))
    print("\n### (b) mean of local means vs W/N scaling (both exact gather)\n")
    print("loss error:\n")
    print(_markdown(rows, ("package", "mean_of_means"), "loss_error"))
    print("\ngradient error:\n")
    print(_markdown(rows, ("package", "mean_of_means"), "grad_error"))
    print("\n### (c) parameter drift after SGD steps (lr=0.1, uneven layouts each step; |θ - θ_ref| / |θ_ref - θ_0|)\n")
    print("| step | " + " | ".join(drift["drift"]) + " |\n|---:|" + "---:|" * len(drift["drift"]))
    for index in (0, 4, 9, 19, len(drift["steps"]) - 1):
        print(f"| {drift['steps'][index]} | " + " | ".join(f"{d[index]:.2e}" for d in drift["drift"].values()) + " |")


if __name__ == "__main__":
    main()
