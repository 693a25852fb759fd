"""Per-step cost of DistributedStreamingBatches' end-of-epoch agreement, and the time to resume a stream mid-shard.

Each rank iterates an in-memory loader of ready batches (so only the wrapper's own work is timed):

* ``plain loader``                 : the loader alone (no agreement: ranks with fewer batches would hang DDP)
* ``lookahead=1``                  : one all-gather of a (1, 7) int64 row per step
* ``lookahead=8``                  : one all-gather of a (1, 42) row per 8 steps (8 batches held ahead)
* ``all_gather(x)``                : for scale: a loss's gather of a 4x8 batch, with its own size exchange
* ``all_gather(x, sizes=)``        : the same gather given the wrapper's ``sizes(step)``: the difference
                                     is the exchange that ``lookahead=1``'s agreement replaces

Ranks hold different numbers of batches (the last rank 10 % fewer), as with uneven shards.

Then, in one process, the time to the first batch of a webdataset stream over one shard of 10,000
samples (32×32 PNG + caption, decoded with PIL) read through ``DistributedShardList.pipeline``:

* ``fresh``                        : the stream started at the shard's beginning
* ``resumed at sample 5000``       : from a state saved there: the 5000 consumed samples are read past
                                     in the tar file, not decoded
* ``replayed to sample 5000``      : what a loader without shard state does to resume (torchdata's
                                     ``StatefulDataLoader`` fast-forward, an ``islice``): decode the
                                     5000 samples and drop them

Run::

    python benchmarks/streaming.py          # 2 ranks, 2000 steps; then the resume
    python benchmarks/streaming.py --world 3 --steps 500 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from contrastive_dist import DistributedShardList, DistributedStreamingBatches, EmptySafeCollate, all_gather
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


def write_shard(directory: Path, samples: int) -> str:
    import webdataset as wds

    generator = torch.Generator().manual_seed(0)
    images = (torch.rand(samples, 32, 32, 3, generator=generator) * 255).to(torch.uint8).numpy()
    path = str(directory / "shard-000000.tar")
    with wds.TarWriter(path) as sink:
        for index in range(samples):
            sink.write({"__key__": f"{index:09d}", "png": images[index], "txt": f"caption {index}"})
    return path


def to_pair(sample: tuple) -> tuple[torch.Tensor, str]:
    image, text = sample
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1), text


def first_batch_ms(path: str, batch_size: int, resume_at: int, mode: str) -> float:
    """Milliseconds from building the stream to holding its first batch (the shard's ``resume_at``-th sample)."""
    import webdataset as wds

    started = time.perf_counter()
    shards = DistributedShardList([path], shuffle=False)
    dataset = shards.pipeline(wds.tarfile_to_samples(), wds.decode("pil"), wds.to_tuple("png", "txt"), wds.map(to_pair))
    example = (torch.zeros(3, 32, 32, dtype=torch.uint8), "")
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=EmptySafeCollate([example]))
    batches = DistributedStreamingBatches(loader)
    if mode == "resumed at sample":
        state = batches.state_dict()
        batches.load_state_dict({**state, "step": resume_at // batch_size,
                                 "shards": {**state["shards"], "progress": [resume_at]}})
    iterator = iter(batches)
    if mode == "replayed to sample":
        for _ in range(resume_at // batch_size):
            next(iterator)
    _, texts = next(iterator)
    elapsed = (time.perf_counter() - started) * 1e3
    expected = 0 if mode == "fresh" else resume_at
    if texts[0] != f"caption {expected}":
        raise RuntimeError(f"{mode}: the first batch starts with {texts[0]!r}, expected 'caption {expected}'")
    return elapsed


def resume_table(samples: int, batch_size: int, repeats: int) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        path = write_shard(Path(directory), samples)
        middle = samples // 2
        times: dict[str, list[float]] = {}
        for _ in range(repeats):  # interleaved, so that load changes hit every method alike
            for mode in ("fresh", "resumed at sample", "replayed to sample"):
                times.setdefault(mode, []).append(first_batch_ms(path, batch_size, middle, mode))
    fresh = statistics.median(times["fresh"])
    print(f"one process x 1 thread, one shard of {samples} samples (32x32 PNG + caption, PIL decode), "
          f"batches of {batch_size}, median of {repeats}")
    print()
    print("| the stream's first batch | ms | × fresh |")
    print("|---|---:|---:|")
    for mode, values in times.items():
        name = mode if mode == "fresh" else f"{mode} {middle}"
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) / fresh:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shard-samples", type=int, default=10_000, help="samples of the shard resumed mid-way")
    parser.add_argument("--only", choices=("steps", "resume"), default=None, help="run one of the two tables")
    args = parser.parse_args()
    print(f"torch {torch.__version__}")
    if args.only != "resume":
        result = run_distributed(per_step_us, args.world, args.steps, args.repeats, timeout=600)[0]
        print(f"{args.world} gloo processes x 1 thread, {args.steps} steps, median of {args.repeats}")
        print()
        print("| method | per step (µs) |")
        print("|---|---:|")
        for name, value in result.items():
            print(f"| {name} | {value:.1f} |")
        print()
    if args.only != "steps":
        resume_table(args.shard_samples, 100, args.repeats)


if __name__ == "__main__":
    main()
