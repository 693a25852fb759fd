"""Per-step cost of DistributedStreamingBatches' end-of-epoch agreement, on gloo (CPU).

Each rank iterates an in-memory loader of ready batches (so only the wrapper's own work is timed):

* ``plain loader``                 : the loader alone (no agreement: ranks with fewer batches would hang DDP)
* ``lookahead=1``                  : one all-gather of a (1, 2) int64 row per step
* ``lookahead=8``                  : one all-gather of a (1, 9) row per 8 steps (8 batches held ahead)
* ``all_gather(x)``                : for scale: a loss's gather of a 4x8 batch, with its own size exchange
* ``all_gather(x, sizes=)``        : the same gather given the wrapper's ``sizes(step)``: the difference
                                     is the exchange that ``lookahead=1``'s agreement replaces

Ranks hold different numbers of batches (the last rank 10 % fewer), as with uneven shards.

Run::

    python benchmarks/streaming.py          # 2 ranks, 2000 steps
    python benchmarks/streaming.py --world 3 --steps 500
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from contrastive_dist import DistributedStreamingBatches, all_gather
from contrastive_dist.testing import run_distributed


def per_step_us(rank: int, world_size: int, steps: int, repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    count = steps - (steps // 10 if rank == world_size - 1 else 0)
    local = [torch.zeros(4, 8) for _ in range(count)]
    results: dict[str, list[float]] = {}

    def run(name: str, iterate) -> None:
        dist.barrier()
        started = time.perf_counter()
        done = iterate()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        results.setdefault(name, []).append(elapsed.item() / done * 1e6)

    def plain() -> int:
        return sum(1 for _ in local)

    def wrapped(lookahead: int):
        def iterate() -> int:
            batches = DistributedStreamingBatches(local, lookahead=lookahead, empty_batch=lambda: torch.zeros(0, 8))
            return sum(1 for _ in batches)

        return iterate

    common = steps - steps // 10  # steps on which every rank holds a batch
    sizes = (4,) * world_size

    def gather() -> int:
        for batch in local[:common]:
            all_gather(batch)
        return common

    def gather_with_sizes() -> int:
        for batch in local[:common]:
            all_gather(batch, sizes=sizes)
        return common

    for _ in range(repeats):  # interleaved, so that load changes hit every method alike
        run("plain loader", plain)
        run("lookahead=1", wrapped(1))
        run("lookahead=8", wrapped(8))
        run("all_gather(x)", gather)
        run("all_gather(x, sizes=)", gather_with_sizes)
    return {name: statistics.median(values) for name, values in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result = run_distributed(per_step_us, args.world, args.steps, args.repeats, timeout=600)[0]
    print(f"{args.world} gloo processes x 1 thread, {args.steps} steps, median of {args.repeats}")
    print(f"torch {torch.__version__}")
    print()
    print("| method | per step (µs) |")
    print("|---|---:|")
    for name, value in result.items():
        print(f"| {name} | {value:.1f} |")


if __name__ == "__main__":
    main()
