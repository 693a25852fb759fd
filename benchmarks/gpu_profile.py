"""Where one training step of a loss spends its time: ``torch.profiler``'s tables, host and device.

A step as ``gpu_check.py`` times it (forward under the precision's context, backward), after warm-up
steps, profiled over ``--steps`` steps: the operators by their own host time (Python, dispatch and
launches: what bounds a step whose chunks are too small for the GPU) and by their own device time.
Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/gpu_profile.py --loss siglip --batch 65536 --chunk-size 1024

``--chunk-size default`` profiles the default call (``chunk_size=None``). ``--device cpu`` runs the
same on the CPU (the test suite does, at a tiny size).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from gpu_check import chunk_size_argument
from gpu_check_losses import PRECISIONS, PROFILED, make_inputs, ours, train_step
from torch.profiler import ProfilerActivity, profile


def main(argv: Sequence[str] | None = None) -> str:
    """Print (and return) the step's host and device time and the profiler's two tables."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--loss", choices=PROFILED, default="siglip")
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--chunk-size", type=chunk_size_argument, default=1024, help="rows, or 'default'")
    parser.add_argument("--communication", choices=("gather", "ring"), default="gather")
    parser.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25, help="rows of each table")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    device, precision = torch.device(args.device), PRECISIONS[args.precision]
    cuda = device.type == "cuda"
    x = make_inputs(args.batch, args.dim, precision.dtype, device)
    step = train_step(ours(args.loss, chunk_size=args.chunk_size, communication=args.communication), x, precision,
                      device)

    def steps() -> float:
        """Run ``--steps`` steps; the host's seconds to issue them (no synchronisation in between)."""
        start = time.perf_counter()
        for _ in range(args.steps):
            for leaf in x.leaves():
                leaf.grad = None
            step()
        issued = time.perf_counter() - start
        if cuda:
            torch.cuda.synchronize(device)
        return issued

    steps()  # warm-up: kernels compiled, allocator and library handles ready
    start = time.perf_counter()
    issued = steps()
    elapsed = time.perf_counter() - start
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiled:
        steps()
    averages = profiled.key_averages()
    lines = [f"{args.loss} {args.communication}, {args.precision}, batch {args.batch}, D {args.dim}, chunk_size "
             f"{args.chunk_size}, {args.device}: {elapsed * 1e3 / args.steps:.2f} ms a step, "
             f"host {issued * 1e3 / args.steps:.2f} ms to issue it",
             averages.table(sort_by="self_cpu_time_total", row_limit=args.rows)]
    if cuda:
        lines.append(averages.table(sort_by="self_device_time_total", row_limit=args.rows))
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
