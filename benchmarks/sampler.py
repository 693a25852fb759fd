"""First-batch time and extra memory of DistributedBatchSampler at 10⁶ .. 2·10⁹ samples, beside randperm.

Methods (each measurement in a fresh process, so that peak RSS belongs to it alone):

* ``feistel``  : ``DistributedBatchSampler`` as shipped (order computed per position, constant memory)
* ``randperm`` : the order it used before: ``torch.randperm(length)`` drawn on every rank each epoch,
                 then sliced; kept here for comparison only

Rank 3 of 8, 256 samples per rank per step. "first batch" is ``set_epoch`` + ``next(iter(sampler))``,
what every rank pays at the start of every epoch; "next batches" the mean over the following 100;
"extra memory" the growth of the process's peak RSS over its value after imports, construction and a
warm-up on a small dataset.

Run::

    python benchmarks/sampler.py            # the README table (randperm at 2·10⁹ is skipped: ~16 GB)
    python benchmarks/sampler.py --quick    # 10⁶ and 10⁷ only
    python benchmarks/sampler.py --plot docs/assets/benchmarks/sampler.svg   # + the figure of the same rows
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from contrastive_dist import DistributedBatchSampler

BATCH_SIZE, WORLD, RANK = 256, 8, 3


class RandpermBatches:
    """The previous order: one materialised permutation per epoch, the same slice arithmetic."""

    def __init__(self, length: int, seed: int = 0) -> None:
        self.reference = DistributedBatchSampler(length, BATCH_SIZE, num_replicas=WORLD, rank=RANK, seed=seed)
        self.length, self.seed = length, seed

    def __iter__(self):
        order = torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed))
        global_batch = self.reference.global_batch_size
        for step in range(len(self.reference)):
            sizes = self.reference.sizes(step)
            first = step * global_batch + sum(sizes[:RANK])
            yield order[first : first + sizes[RANK]].tolist()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make(method: str, length: int):
    if method == "feistel":
        return DistributedBatchSampler(length, BATCH_SIZE, num_replicas=WORLD, rank=RANK, seed=0)
    return RandpermBatches(length)


def measure(method: str, length: int) -> dict[str, float]:
    torch.set_num_threads(1)
    # Warm-up on a small dataset: a training process has run torch ops before, so the one-off costs of
    # the first call (kernels, allocator pools) are not what a new epoch pays.
    next(iter(make(method, 10 * WORLD * BATCH_SIZE)))
    sampler = make(method, length)
    before = peak_rss_mib()
    started = time.perf_counter()
    if method == "feistel":
        sampler.set_epoch(0)
    batches = iter(sampler)
    first = next(batches)
    first_ms = (time.perf_counter() - started) * 1e3
    extra = peak_rss_mib() - before
    started = time.perf_counter()
    for _ in range(100):
        next(batches)
    next_ms = (time.perf_counter() - started) * 1e3 / 100
    assert len(first) == BATCH_SIZE
    return {"first_ms": first_ms, "next_ms": next_ms, "extra_mib": extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plot", metavar="PATH", help="also draw the rows against the dataset size (.svg, .png)")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]))))
        return
    lengths = [10**6, 10**7] if args.quick else [10**6, 10**7, 10**8, 2 * 10**9]
    print(f"torch {torch.__version__}, rank {RANK} of {WORLD}, batch {BATCH_SIZE} per rank, 1 thread\n")
    print("| samples | method | first batch (ms) | next batches (ms each) | extra memory (MiB) |")
    print("|---:|---|---:|---:|---:|")
    measured: dict[str, dict[int, dict[str, float]]] = {"feistel": {}, "randperm": {}}
    for length in lengths:
        for method in ("feistel", "randperm"):
            if method == "randperm" and length > 10**8:
                print(f"| {length:.0e} | randperm | not run (needs ~{length * 8 / 2**30:.0f} GiB) | | |")
                continue
            command = [sys.executable, __file__, "--one", method, str(length)]
            result = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
            measured[method][length] = result
            print(
                f"| {length:.0e} | {method} | {result['first_ms']:.1f} | {result['next_ms']:.2f} "
                f"| {result['extra_mib']:.1f} |",
                flush=True,
            )

    if args.plot:
        plot(args.plot, measured)


def plot(path: str, measured: dict[str, dict[int, dict[str, float]]]) -> None:
    """First-batch time and extra memory of both orders against the dataset size, from the rows just measured."""
    from plots import save_panels

    names = {"feistel": "DistributedBatchSampler", "randperm": "torch.randperm (earlier versions)"}

    def series(key: str) -> dict[str, list[tuple[float, float]]]:
        return {names[method]: sorted((length, row[key]) for length, row in rows.items())
                for method, rows in measured.items()}

    lengths = sorted(measured["feistel"])
    save_panels(path, x_label="samples in the dataset", x_ticks=lengths,
                x_tick_labels=[f"{length:.0e}".replace("e+0", "e") for length in lengths],
                panels=[("first batch of an epoch (ms)", series("first_ms")),
                        ("extra memory (MiB)", series("extra_mib"))],
                title=f"Sampler, rank {RANK} of {WORLD}, {BATCH_SIZE} samples per rank, 1 thread, a fresh process each")


if __name__ == "__main__":
    main()
