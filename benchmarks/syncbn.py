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

Command::

    python benchmarks/syncbn.py                      # 2 processes, batch 32 per rank, 32x32 images
    python benchmarks/syncbn.py --image-size 64 --steps 30
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="images per rank")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = parser.parse_args()

    with WorkerPool(args.world_size, timeout=1800, threads_per_process=args.threads) as pool:
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
