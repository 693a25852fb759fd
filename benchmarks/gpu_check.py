"""Exactness, speed and memory of the package on GPUs: one command for one GPU, one for all of them.

Run::

    python benchmarks/gpu_check.py                                      # one GPU
    torchrun --standalone --nproc-per-node=gpu benchmarks/gpu_check.py  # every GPU, one process each

Each command is sized to finish within 10 minutes on H100/H200 GPUs (about 4 and 5 minutes by
estimate, not yet timed on such a machine); ``--time-budget`` (480 s) skips, with a row saying so,
any measurement that would end past it. Rows go to stdout (a markdown table) and to ``--csv``
(default ``gpu_check_<W>gpu.csv``) one at a time, as they are measured; the first row records the
GPU, driver, torch, CUDA and NCCL versions and the TF32 state. A section that fails costs only its
own rows: a ``section failed`` row names the error and the run goes on (exit status 1 at the end).

One GPU: every method's value and gradients (features, the learnable ``logit_scale`` and SigLIP
``logit_bias``) against a float64 reference, in bf16, fp32 and TF32; then forward+backward time
(CUDA events, the median of up to 50 steps, at least 20 for steps under 0.15 s) and peak memory at
global batch 16k–128k, D = 768: ``info_nce`` and ``siglip`` with ``chunk_size`` 1024 and 4096
against open_clip's ``ClipLoss`` / ``SigLipLoss``, each until its first out-of-memory. The
``compute`` column says how each multiplies: our core keeps bf16 features as tensor-core operands
(float32 results and state), open_clip runs under ``torch.autocast`` on bf16 tensor cores. Then the
published siglip-kernel
figures (Triton, B = 65,536, bf16) with ours as ratios.

Several GPUs (``torchrun``; each process on the GPU of its ``LOCAL_RANK``, NCCL bound to it with
``device_id``): the gather, every loss in ``communication="gather"`` and ``"ring"`` (ring's NCCL
``batch_isend_irecv`` path) and SyncBatchNorm (ours and ``torch.nn.SyncBatchNorm``) against float64
references on uneven shards with an empty rank; bf16 features in both modes against float64; the
gather against the raw collectives and pad-to-max with the same backward work; each loss in both
modes against open_clip's distributed setting; the per-rank peak on 1, 2, 4, … W ranks; and with 8
GPUs or more, gather against ring mode at global batch 64k–1M beside Inf-CL's published 8-GPU memory.

Without CUDA it prints one line and exits 0. ``--device cpu`` runs the same sections on CPU (gloo
under ``torchrun``), ``--tiny`` at tiny sizes: that is how the test suite checks the script.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

import gpu_check_many as many
import gpu_check_many_speed as many_speed
import gpu_check_one as one
import torch
import torch.distributed as dist
from gpu_check_report import TINY, Deadline, Report, Row, Sizes, machine_row, run_section


def run_one(device: torch.device, sizes: Sizes, csv_path: str, deadline: Deadline, point_seconds: float) -> int:
    """The one-device sections; the number of sections that failed."""
    report = Report(csv_path)
    report.write(machine_row(device, 1))
    finished = [
        run_section(report, "1 rank: exactness", one.exactness(device, sizes), device=device),
        run_section(report, "1 rank: speed and memory", one.speed(device, sizes, deadline, point_seconds),
                    device=device),
        run_section(report, "1 rank: published", one.published(report.rows), device=device),
    ]
    report.close()
    return finished.count(False)


def run_ranks(rank: int, world_size: int, device: torch.device, sizes: Sizes, csv_path: str, deadline_s: float,
              point_seconds: float) -> list[Row]:
    """The multi-rank sections, on every rank of an initialised process group; rank 0 writes ``csv_path``.

    Returns the rows (every rank computes them; rank 0's are the ones written).
    """
    report = Report(csv_path if rank == 0 else None, echo=rank == 0)
    if rank == 0:
        report.write(machine_row(device, world_size))
    deadline, prefix = Deadline(deadline_s), f"{world_size} ranks"
    sections = [
        ("exactness", many.exactness(rank, world_size, device, sizes)),
        ("bf16 vs float64", many.precision_at_scale(rank, world_size, device, sizes)),
        ("gather speed", many_speed.gather_speed(rank, world_size, device, sizes, point_seconds)),
        ("loss speed and memory", many_speed.loss_speed(rank, world_size, device, sizes, point_seconds)),
        ("per-rank memory", many_speed.memory_by_ranks(rank, world_size, device, sizes, point_seconds)),
        ("gather vs ring sweep", many_speed.sweep(rank, world_size, device, sizes, deadline, point_seconds)),
    ]
    for name, rows in sections:
        run_section(report, f"{prefix}: {name}", rows, device=device)
    report.close()
    return report.rows


def _run_under_torchrun(cuda: bool, sizes: Sizes, csv_path: str | None, args: argparse.Namespace) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=args.timeout)
    if cuda:
        # Each process on its own GPU, chosen before the process group exists, and NCCL bound to it.
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    path = csv_path or f"gpu_check_{world_size}{'gpu' if cuda else 'cpu'}.csv"
    rows = run_ranks(rank, world_size, device, sizes, path, args.time_budget, args.point_seconds)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    if rank == 0:
        print(f"written to {path}")
    return int(any(row.get("check") == "section failed" for row in rows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--csv", help="where the rows go (default: gpu_check_<W>gpu.csv)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA if present, otherwise one line and exit 0")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (what the test suite runs on CPU)")
    parser.add_argument("--batches", type=int, nargs="+", help="one-GPU global batches (default 16k 32k 64k 128k)")
    parser.add_argument("--time-budget", type=float, default=480.0, help="seconds; later measurements are skipped")
    parser.add_argument("--point-seconds", type=float, default=3.0, help="timed seconds per measurement, about")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait (torchrun)")
    args = parser.parse_args(argv)
    if args.device == "auto" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure (run it where a GPU is).")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    cuda = args.device != "cpu"
    sizes = TINY if args.tiny else Sizes()
    if args.batches:
        sizes = replace(sizes, batches=tuple(args.batches))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_under_torchrun(cuda, sizes, args.csv, args)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    path = args.csv or f"gpu_check_1{'gpu' if cuda else 'cpu'}.csv"
    failed = run_one(device, sizes, path, Deadline(args.time_budget), args.point_seconds)
    print(f"written to {path}" + (f"; {failed} section(s) failed" if failed else ""))
    return int(failed > 0)


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Everything is written. Skip the interpreter's teardown of torch's C++ state, which aborted
        # ("terminate called without an active exception") in about 1 run in 10 under CPU load.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
