"""Forward+backward time of differentiable all-gathers, side by side, on gloo (CPU).

Methods (all interleaved in one run, each iteration timed as the slowest rank's time):

* ``contrastive_dist``            : ``all_gather(x)`` (the agreement exchange + one collective each way)
* ``contrastive_dist sizes=``     : ``all_gather(x, sizes=...)`` (no exchange; statuses ride on the data)
* ``raw collectives``             : the transport alone, no autograd: the collectives ``all_gather`` runs
                                    (``_wire.gather_rows`` forward, ``_wire.reduce_scatter_rows`` of a
                                    fresh all-ones gradient backward, as ``.sum().backward()`` makes)
* ``torch.distributed.nn``        : ``torch.distributed.nn.functional.all_gather`` + ``torch.cat``
* ``functional collectives``      : ``_functional_collectives.all_gather_single_autograd`` (equal sizes only)
* ``pad-to-max``                  : exchange sizes, pad to the largest, equal all-gather, drop the padding;
                                    backward: all-reduce of the padded gradient, keep the own rows

Run::

    python benchmarks/gather.py            # the README table
    python benchmarks/gather.py --quick    # small sizes, a few seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from contrastive_dist import all_gather
from contrastive_dist.engine._wire import gather_rows, reduce_scatter_rows
from contrastive_dist.testing import run_distributed

Method = Callable[[Tensor, tuple[int, ...]], Tensor]


def ours(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    return all_gather(x).tensor


def ours_with_sizes(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    return all_gather(x, sizes=sizes).tensor


class _Raw(torch.autograd.Function):
    """The transport's collectives and nothing else, timed like the others (``.sum().backward()``)."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: tuple[int, ...]) -> Tensor:  # type: ignore[override]
        ctx.sizes = sizes
        return gather_rows(x.detach(), sizes, dist.get_rank(), None)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return reduce_scatter_rows(torch.ones(grad.shape, dtype=grad.dtype), ctx.sizes, dist.get_rank(), None), None


def raw_collectives(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    return _Raw.apply(x, sizes)


def torch_nn(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    import torch.distributed.nn.functional as dist_nn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch.cat(dist_nn.all_gather(x), dim=0)


def functional_collectives(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(x, 0, dist.group.WORLD)


class _PadToMax(torch.autograd.Function):
    """The common hand-written route: pad to the largest rank, gather equal blocks, unpad."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        world_size, rank = dist.get_world_size(), dist.get_rank()
        local = torch.tensor([x.shape[0]])
        counts = [torch.zeros_like(local) for _ in range(world_size)]
        dist.all_gather(counts, local)
        sizes = [int(c) for c in counts]
        largest = max(sizes)
        padded = x.new_zeros((largest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((world_size * largest, *x.shape[1:]))
        dist.all_gather_into_tensor(out, padded) if not hasattr(dist, "all_gather_single") else dist.all_gather_single(
            out, padded
        )
        keep = torch.cat([torch.arange(r * largest, r * largest + s) for r, s in enumerate(sizes)])
        ctx.keep, ctx.largest, ctx.rank, ctx.rows = keep, largest, rank, x.shape[0]
        return out[keep]

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        padded = grad.new_zeros((dist.get_world_size() * ctx.largest, *grad.shape[1:]))
        padded[ctx.keep] = grad
        dist.all_reduce(padded)
        start = ctx.rank * ctx.largest
        return padded[start : start + ctx.rows]


def pad_to_max(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    return _PadToMax.apply(x)


METHODS: dict[str, Method] = {
    "contrastive_dist": ours,
    "contrastive_dist sizes=": ours_with_sizes,
    "raw collectives": raw_collectives,
    "torch.distributed.nn": torch_nn,
    "functional collectives": functional_collectives,
    "pad-to-max": pad_to_max,
}


def _measure(rank: int, world_size: int, sizes: tuple[int, ...], dim: int, iters: int) -> dict[str, float]:
    equal = len(set(sizes)) == 1
    equal_only = ("torch.distributed.nn", "functional collectives")
    methods = {name: fn for name, fn in METHODS.items() if equal or name not in equal_only}
    x = torch.randn(sizes[rank], dim, requires_grad=True)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for iteration in range(iters + 2):  # two warm-up rounds
        for name, method in methods.items():
            dist.barrier()
            start = time.perf_counter()
            method(x, sizes).sum().backward()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if iteration >= 2:
                times[name].append(elapsed.item())
            x.grad = None
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def padding_bytes(sizes: tuple[int, ...], dim: int) -> int:
    """Bytes of padding a pad-to-max gather puts on the wire (forward), summed over receivers."""
    largest = max(sizes)
    return sum(largest - size for size in sizes) * (len(sizes) - 1) * dim * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few iterations")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    dim = 64 if args.quick else 512
    configs: list[tuple[int, ...]] = (
        [(64, 64), (96, 64, 32, 0)]
        if args.quick
        else [(1024, 1024), (2048, 2048), (2048, 1024), (1024,) * 4, (2048,) * 4, (2048, 1536, 1024, 512)]
    )
    print(f"| sizes (rows × {dim} fp32) | method | fwd+bwd ms (median) | ours ÷ this | this ÷ raw | padding bytes |")
    print("|---|---|---:|---:|---:|---:|")
    for sizes in configs:
        results = run_distributed(_measure, len(sizes), sizes, dim, 5 if args.quick else args.iters, timeout=600)
        medians = results[0]
        base, raw = medians["contrastive_dist"], medians["raw collectives"]
        for name, value in medians.items():
            pad = padding_bytes(sizes, dim) if name == "pad-to-max" else 0
            print(f"| {list(sizes)} | {name} | {value:.2f} | {base / value:.2f} | {value / raw:.2f} | {pad} |")


if __name__ == "__main__":
    main()
