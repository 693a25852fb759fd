"""Cost of exact global BatchNorm: a ResNet-18 training step, per-rank nn.BatchNorm vs SyncBatchNorm.

Each of ``--world-size`` gloo processes (CPU, one intra-op thread each by default) runs the
forward and backward of torchvision's ``resnet18(weights=None)`` on its own batch, with

* ``nn.BatchNorm``: the layers as shipped (per-rank statistics: not exact, fails on 1 sample);
* ``SyncBatchNorm``: the same model after ``contrastive_dist.convert_sync_batchnorm`` (one
  all-gather forward and one all-reduce backward per BatchNorm layer, 20 layers).

Both are timed bare and wrapped in ``DistributedDataParallel`` (whose gradient all-reduce is part
of a real training step), the synchronized one also with a process group of its own. The methods
are interleaved step by step, in alternating order, after a barrier, so that load from other
processes on the machine hits all of them alike; a step's time is the slowest rank's; the table
shows medians and the ratio to per-rank BatchNorm (with DDP: to per-rank BatchNorm with DDP).

``--latency`` times one exchange of a 64-channel layer's statistics row (130 float64) by each route
that could carry it: ``all_gather_single`` (what the forward uses), ``all_reduce`` (the backward's,
on ``2C`` values), and point-to-point messages to every peer in one round (``batch_isend_irecv``),
alone and with a ResNet-18 layer's worth of computation between two exchanges.

Command::

    python benchmarks/syncbn.py                      # 2 processes, batch 32 per rank, 32x32 images
    python benchmarks/syncbn.py --image-size 64 --steps 30
    python benchmarks/syncbn.py --latency --world-size 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn

from contrastive_dist import convert_sync_batchnorm
from contrastive_dist.engine._wire import all_gather_single
from contrastive_dist.testing import WorkerPool

METHODS = (
    "nn.BatchNorm",
    "SyncBatchNorm",
    "nn.BatchNorm + DDP",
    "SyncBatchNorm + DDP",
    "SyncBatchNorm(group=new_group()) + DDP",
)


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    plain = torchvision.models.resnet18(weights=None)
    synced = convert_sync_batchnorm(copy.deepcopy(plain))
    # On the default group, BatchNorm's backward all-reduce queues behind the gradient buckets
    # DDP has already launched on that group; a group of its own lets it run beside them.
    own_group = convert_sync_batchnorm(copy.deepcopy(plain), group=dist.new_group())
    return {
        METHODS[0]: plain,
        METHODS[1]: synced,
        METHODS[2]: nn.parallel.DistributedDataParallel(copy.deepcopy(plain)),
        METHODS[3]: nn.parallel.DistributedDataParallel(copy.deepcopy(synced)),
        METHODS[4]: nn.parallel.DistributedDataParallel(own_group),
    }


def _measure(
    rank: int, world_size: int, batch: int, image_size: int, steps: int, warmup: int
) -> dict[str, list[float]]:
    models = _models()
    generator = torch.Generator().manual_seed(rank)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    labels = torch.randint(1000, (batch,), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(warmup + steps):
        order = list(models) if step % 2 == 0 else list(reversed(models))
        for name in order:
            model = models[name]
            dist.barrier()
            start = time.perf_counter()
            F.cross_entropy(model(images), labels).backward()
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if step >= warmup:
                times[name].append(elapsed)
    return times


LATENCY_ROW = 2 + 2 * 64  # count, problem, mean and M2 of a 64-channel layer


def _point_to_point(row: torch.Tensor, table: torch.Tensor) -> None:
    """Every rank's row to every rank in one round of messages (the alternative to the all-gather)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    table[rank] = row
    ops = []
    for peer in range(world_size):
        if peer != rank:
            ops += [dist.P2POp(dist.isend, row, peer), dist.P2POp(dist.irecv, table[peer], peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _latency(rank: int, world_size: int, repeats: int) -> dict[str, float]:
    """Median seconds of one exchange by each route, bare and after a conv layer's forward (interleaved)."""
    row = torch.randn(LATENCY_ROW, dtype=torch.float64)
    table = row.new_empty((world_size, LATENCY_ROW))
    sums = torch.randn(2 * 64)
    routes = {
        "all_gather_single": lambda: all_gather_single(table, row.unsqueeze(0)),
        "all_reduce": lambda: dist.all_reduce(sums),
        "point-to-point": lambda: _point_to_point(row, table),
    }
    conv = nn.Conv2d(64, 64, 3, padding=1)
    activations = torch.randn(32, 64, 8, 8)
    times: dict[str, list[float]] = {f"{name}{where}": [] for name in routes for where in ("", " after compute")}
    with torch.no_grad():
        for _ in range(repeats):
            for name, route in routes.items():
                dist.barrier()
                start = time.perf_counter()
                route()
                times[name].append(time.perf_counter() - start)
                conv(activations)  # the ranks reach the next exchange as in a training step
                start = time.perf_counter()
                route()
                times[f"{name} after compute"].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _print_latency(per_rank: list[dict[str, float]], world_size: int) -> None:
    print(f"One exchange of a {LATENCY_ROW}-value statistics row, {world_size} gloo processes, median of 300\n")
    print("| route | median (µs), slowest rank |")
    print("|---|---:|")
    for name in per_rank[0]:
        print(f"| {name} | {max(r[name] for r in per_rank) * 1e6:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="images per rank")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    parser.add_argument("--latency", action="store_true", help="time the exchanges alone instead")
    args = parser.parse_args()

    with WorkerPool(args.world_size, timeout=1800, threads_per_process=args.threads) as pool:
        if args.latency:
            print(f"`python {' '.join(sys.argv)}`\n")
            _print_latency(pool.run(_latency, 300), args.world_size)
            return
        per_rank = pool.run(_measure, args.batch, args.image_size, args.steps, args.warmup)
    # A step is done when its slowest rank is done.
    slowest = {name: [max(times) for times in zip(*(r[name] for r in per_rank), strict=True)] for name in METHODS}
    medians = {name: statistics.median(values) for name, values in slowest.items()}

    print(f"`python {' '.join(sys.argv)}`\n")
    print(
        f"ResNet-18 forward+backward, {args.world_size} gloo processes x {args.threads} thread(s), "
        f"batch {args.batch}/rank, {args.image_size}x{args.image_size}, median of {args.steps} interleaved steps "
        f"(torch {torch.__version__})\n"
    )
    print("| method | median step (ms) | ratio |")
    print("|---|---:|---:|")
    for name in METHODS:
        baseline = medians["nn.BatchNorm + DDP" if "DDP" in name else "nn.BatchNorm"]
        print(f"| {name} | {medians[name] * 1e3:.1f} | {medians[name] / baseline:.3f}x |")


if __name__ == "__main__":
    main()
