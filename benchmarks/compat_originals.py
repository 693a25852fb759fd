"""What the originals that ``contrastive_dist.compat`` mimics do on uneven shards, against the drop-ins.

The same float64 problem as the drop-ins' tests: a global batch of 8 split [5, 0, 3] (and [5, 1, 2])
over 3 gloo processes, the per-rank loss back-propagated and the parameter gradients averaged as
DDP does. Reference: the single-process loss on the whole batch (the drop-in's, equal to the
original's on one process). Reported per loss: the relative error of the averaged gradient and of
the mean value, or the error the original raised (first line), or a hang (no answer in the timeout).

Run::

    PYTHONPATH=. python benchmarks/compat_originals.py
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist.testing import WorkerPool

WORLD_SIZE, DIM, WIDTH = 3, 6, 5
LAYOUTS = ((5, 0, 3), (5, 1, 2))
LOSSES = ("open_clip ClipLoss(local_loss, gather_with_grad)", "open_clip ClipLoss()", "open_clip SigLipLoss(bidir)",
          "lightly NTXentLoss(gather_distributed=True)", "lightly NTXentLoss(gather_distributed=False)",
          "lightly DCLLoss(gather_distributed=True)", "lightly DCLWLoss(gather_distributed=True)",
          "sentence-transformers MNRL(gather_across_devices=True)",
          "sentence-transformers MNRL(gather_across_devices=False)")


class _Encoder(nn.Module):
    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"sentence_embedding": features["x"] @ self.weight}


def _problem() -> dict[str, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(*shape, generator=generator, dtype=torch.float64)
            for name, shape in (("x0", (8, DIM)), ("x1", (8, DIM)), ("w0", (DIM, WIDTH)), ("w1", (DIM, WIDTH)))}


def _loss(name: str, which: str, rank: int, world_size: int, data: dict[str, Tensor]) -> tuple[Any, list[Tensor]]:
    if name.startswith("open_clip"):
        if which == "original":
            from open_clip import loss as module
        else:
            from contrastive_dist.compat import open_clip as module  # type: ignore[no-redef]
        if "SigLip" in name:
            return module.SigLipLoss(rank=rank, world_size=world_size, dist_impl="bidir"), []
        flags = {"local_loss": True, "gather_with_grad": True} if "local_loss" in name else {}
        return module.ClipLoss(rank=rank, world_size=world_size, **flags), []
    gather = "True" in name
    if name.startswith("lightly"):
        if which == "original":
            from lightly import loss as lightly_module
        else:
            from contrastive_dist.compat import lightly as lightly_module  # type: ignore[no-redef]
        kind = name.split()[1].split("(")[0]
        options = {"sigma": 0.5} if kind == "DCLWLoss" else {}
        return getattr(lightly_module, kind)(temperature=0.2, gather_distributed=gather, **options), []
    if which == "original":
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    else:
        from contrastive_dist.compat.sentence_transformers import (  # type: ignore[assignment]
            MultipleNegativesRankingLoss,
        )
    encoder = _Encoder(data["w0"])
    return MultipleNegativesRankingLoss(encoder, gather_across_devices=gather), [encoder.weight]


def value_and_grads(name: str, which: str, start: int, stop: int, rank: int = 0,
                    world_size: int = 1) -> tuple[Tensor, list[Tensor]]:
    """The loss on rows ``start:stop`` and the gradients of its parameters."""
    data = _problem()
    loss, params = _loss(name, which, rank, world_size, data)
    x0, x1 = data["x0"][start:stop], data["x1"][start:stop]
    if params:
        value = loss([{"x": x0}, {"x": x1}], torch.zeros(len(x0)))
    else:
        params = [data["w0"].requires_grad_(), data["w1"].requires_grad_(),
                  torch.tensor(9.0, dtype=torch.float64, requires_grad=True)]
        a, b = x0 @ params[0], x1 @ params[1]
        if name.startswith("open_clip"):
            a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
            extra = (torch.tensor(-4.0, dtype=torch.float64),) if "SigLip" in name else ()
            value = loss(a, b, params[2], *extra)
        else:
            value = loss(a, b)
            params = params[:2]
    grads = torch.autograd.grad(value, params, allow_unused=True)
    return value.detach(), [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


def _on_ranks(rank: int, world_size: int, name: str, which: str, layout: tuple[int, ...]) -> tuple[float, list]:
    start = sum(layout[:rank])
    value, grads = value_and_grads(name, which, start, start + layout[rank], rank, world_size)
    total = value.reshape(1).clone()
    dist.all_reduce(total)
    for grad in grads:
        dist.all_reduce(grad)
        grad /= world_size
    return float(total) / world_size, grads


def measure(pool_timeout: float = 30.0) -> Iterator[dict[str, Any]]:
    """One row per (loss, layout, original or drop-in): the relative errors, or what went wrong."""
    pool = WorkerPool(WORLD_SIZE, timeout=pool_timeout)
    try:
        for name in LOSSES:
            reference, reference_grads = value_and_grads(name, "compat", 0, 8)
            for layout in LAYOUTS:
                for which in ("original", "compat"):
                    if not pool.alive:
                        pool.close()
                        pool = WorkerPool(WORLD_SIZE, timeout=pool_timeout)
                    row: dict[str, Any] = {"loss": name, "layout": layout, "which": which}
                    try:
                        outcome = pool.run(_on_ranks, name, which, layout, timeout=pool_timeout,
                                           return_exceptions=True)
                    except Exception as error:  # a hang or a dead worker: the pool's own error
                        row["outcome"] = f"{type(error).__name__}: {str(error).splitlines()[0][:140]}"
                        yield row
                        continue
                    errors = [result for result in outcome if isinstance(result, BaseException)]
                    if errors:
                        row["outcome"] = f"{type(errors[0]).__name__}: {str(errors[0]).splitlines()[0][:140]}"
                    else:
                        value, grads = outcome[0]
                        row["value_error"] = abs(value - float(reference)) / abs(float(reference))
                        row["grad_error"] = max(float((g - r).abs().max() / r.abs().max())
                                                for g, r in zip(grads, reference_grads))
                    yield row
    finally:
        pool.close()


def main() -> None:
    for row in measure():
        result = row.get("outcome") or f"value {row['value_error']:.2e}  grad {row['grad_error']:.2e}"
        print(f"{row['loss']:58s} {str(row['layout']):10s} {row['which']:8s} {result}", flush=True)


if __name__ == "__main__":
    main()
