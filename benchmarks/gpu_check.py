"""Exactness, speed and memory of the package on GPUs: one command for one GPU, one for all of them.

Run from the repository root (the package needs no install; ``benchmarks/gpu_day.sh`` runs the whole
first day on a bare machine)::

    PYTHONPATH=$PWD python benchmarks/gpu_check.py                                      # one GPU
    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node=gpu benchmarks/gpu_check.py  # every GPU

Each command is sized to finish within 10 minutes on H100/H200 GPUs; ``--time-budget`` (480 s)
skips, with a row saying so, any measurement that would end past it. Every row goes, as it is
measured, to a CSV and a markdown log in ``--out`` (default: ``$OUT`` when set, else
``gpu_check_out/``; both git-ignored names) and as one short line to stdout; a summary of at most 9k
characters comes last, so the end of the output carries the machine, the errors and the anchor. The
first row records the GPU, driver, clocks, torch, CUDA, NCCL and Triton versions, the TF32 state,
``CONTRASTIVE_DIST_PRODUCTS`` / ``NVIDIA_TF32_OVERRIDE`` / ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE`` and
the product route the loss core resolves. One section per (precision, loss): a section that fails
costs only its own rows (a ``section failed`` row names the error), a method that raises only its own
(an allocator error, ``torch.OutOfMemoryError`` or a ``RuntimeError`` such as
``CUBLAS_STATUS_ALLOC_FAILED``, reads as out of memory), and the allocator's cache is emptied
between methods; the exit status is 1 when a section failed.

One GPU: every method's value and gradients (features, the learnable ``logit_scale`` and SigLIP
``logit_bias``) against a float64 reference, in bf16, TF32 and fp32, and ours with sample ids
(``same_id="mask"``; one sample in 50 shares its neighbour's id) in both modes; then forward+backward time
(CUDA events, the median of up to 50 steps, at least 20 for steps under ``--point-seconds / 20``) and
peak memory at global batch 16k–128k, D = 768: ``info_nce`` and ``siglip`` in gather mode called by
default (``chunk_size=None``) and with ``chunk_size`` 1024 and 4096 (``--chunk-sizes``), and in ring
mode by default (one block on one rank), with the host's time to issue a step, against open_clip's
``ClipLoss`` / ``SigLipLoss`` and, in bf16, the specialists on the same GPU: siglip-kernel (Triton)
for SigLIP (its default entry point and ``chunk_size=1024``, and its ``DistributedSigLIPLoss`` ring and
gather on one rank, at 16k, 64k and 128k), Inf-CL's ``cal_flash_loss`` for InfoNCE (two calls, one per
direction, at the same three), each until its first out-of-memory. The ``compute`` column says how each
multiplies (ours: the route the core resolves here). Then every bf16 method at B = 65,536 over its
loss's specialist measured live. Last, a conformance section on a process group of one rank: Inf-CL's
``cal_ring_loss`` and ``cal_inf_loss``, siglip-kernel's distributed losses, Inf-CL's gradient of the
scale over ours, and a row naming what one GPU cannot check.

Several GPUs (``torchrun``; each process on the GPU of its ``LOCAL_RANK``, NCCL bound to it with
``device_id``): the gather, every loss in ``communication="gather"`` and ``"ring"`` (ring's NCCL
``batch_isend_irecv`` path) and SyncBatchNorm (ours and ``torch.nn.SyncBatchNorm``) against float64
references on uneven shards with an empty rank; bf16 features in both modes against float64; the
gather against the raw collectives and pad-to-max with the same backward work; each loss in both
modes against open_clip's distributed setting; the per-rank peak on 1, 2, 4, … W ranks over the
2-rank peak; and with 8 GPUs or more, gather against ring mode at global batch 64k–1M beside
Inf-CL's published 8-GPU memory.

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
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in main(), after the arguments: --help works before torch or the package load
    import torch
    from gpu_check_report import Row, Sizes

OUT_VARIABLE, DEFAULT_OUT = "OUT", "gpu_check_out"
LOSS_ORDER = ("siglip", "info_nce")  # SigLIP first: the anchor's rows come before any time budget runs out


def _paths(out: str, csv_path: str | None, world_size: int, kind: str) -> tuple[str, str, str]:
    """The CSV, the markdown log and the summary file of one run."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"gpu_check_{world_size}{kind}")
    return csv_path or f"{stem}.csv", f"{stem}.md", f"{stem}_summary.txt"


def _finish(rows: Sequence[Row], summary_path: str | None) -> None:
    from gpu_check_summary import ANCHOR_BATCH, summary

    lines = summary(rows, anchor_batch=ANCHOR_BATCH)
    if summary_path:
        with open(summary_path, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def run_one(device: torch.device, sizes: Sizes, csv_path: str, deadline_s: float, point_seconds: float, *,
            log_path: str | None = None, summary_path: str | None = None) -> int:
    """The one-device sections; the number of sections that failed."""
    import gpu_check_one as one
    from gpu_check_conformance import conformance
    from gpu_check_losses import PRECISIONS
    from gpu_check_machine import machine_row
    from gpu_check_report import Deadline, Report, run_section

    report, deadline = Report(csv_path, log=log_path), Deadline(deadline_s)
    report.write(machine_row(device, 1))
    pairs = [(PRECISIONS[name], loss) for name in sizes.precisions for loss in LOSS_ORDER]
    finished = [run_section(report, f"1 rank: exactness {precision.name} {loss}",
                            one.exactness(device, sizes, precision, loss), device=device) for precision, loss in pairs]
    finished += [run_section(report, f"1 rank: speed {precision.name} {loss}",
                             one.speed(device, sizes, precision, loss, deadline, point_seconds), device=device)
                 for precision, loss in pairs]
    finished.append(run_section(report, "1 rank: anchor", one.anchor(report.rows), device=device))
    # Last: its rings' backward passes gradients to the process's own rank; should that ever stall, the
    # day's backstop stops this section alone, with every measurement already on disk.
    finished.append(run_section(report, "1 rank: conformance", conformance(device, sizes), device=device))
    report.close()
    _finish(report.rows, summary_path)
    return finished.count(False)


def run_ranks(rank: int, world_size: int, device: torch.device, sizes: Sizes, csv_path: str, deadline_s: float,
              point_seconds: float, *, log_path: str | None = None, summary_path: str | None = None) -> list[Row]:
    """The multi-rank sections, on every rank of an initialised process group; rank 0 writes ``csv_path``.

    Returns the rows (every rank computes them; rank 0's are the ones written).
    """
    import gpu_check_many as many
    import gpu_check_many_speed as many_speed
    from gpu_check_machine import machine_row
    from gpu_check_report import Deadline, Report, run_section

    report = Report(csv_path if rank == 0 else None, echo=rank == 0, log=log_path if rank == 0 else None)
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
    if rank == 0:
        _finish(report.rows, summary_path)
    return report.rows


def _run_under_torchrun(cuda: bool, sizes: Sizes, args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

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
    path, log, summary = _paths(args.out, args.csv, world_size, "gpu" if cuda else "cpu")
    rows = run_ranks(rank, world_size, device, sizes, path, args.time_budget, args.point_seconds, log_path=log,
                     summary_path=summary)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    if rank == 0:
        print(f"written to {path}, {log} and {summary}")
    return int(any(row.get("check") == "section failed" for row in rows))


def chunk_size_argument(text: str) -> int | None:
    """``--chunk-sizes`` entries: a number of rows, or ``default`` (the loss's own rule)."""
    return None if text == "default" else int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default=os.environ.get(OUT_VARIABLE) or DEFAULT_OUT,
                        help=f"folder of the CSV, the markdown log and the summary (default: ${OUT_VARIABLE} when "
                             f"set, else {DEFAULT_OUT}/)")
    parser.add_argument("--csv", help="the CSV file instead (default: <out>/gpu_check_<W>gpu.csv)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA if present, otherwise one line and exit 0")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (what the test suite runs on CPU)")
    parser.add_argument("--batches", type=int, nargs="+", help="one-GPU global batches (default 16k 32k 64k 128k)")
    parser.add_argument("--chunk-sizes", nargs="+", type=chunk_size_argument,
                        help="our chunk sizes, 'default' for chunk_size=None (default: default 1024 4096)")
    parser.add_argument("--precisions", nargs="+", choices=("bf16", "fp32", "tf32"),
                        help="one-GPU precisions, in this order (default bf16 fp32 tf32)")
    parser.add_argument("--time-budget", type=float, default=480.0, help="seconds; later measurements are skipped")
    parser.add_argument("--point-seconds", type=float, default=3.0, help="timed seconds per measurement, about")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait (torchrun)")
    args = parser.parse_args(argv)
    try:
        import torch
        from gpu_check_report import TINY, Sizes

        import contrastive_dist  # noqa: F401 - fail here, with the fix in the message, not in a section
    except ModuleNotFoundError as error:  # the package is imported by name: from the checkout or installed
        parser.exit(2, f"gpu_check: {error}; run it from the repository root with PYTHONPATH=$PWD "
                       "(or after pip install -e .), or through benchmarks/gpu_day.sh\n")
    if args.device == "auto" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure (run it where a GPU is).")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    cuda = args.device != "cpu"
    sizes = TINY if args.tiny else Sizes()
    if args.batches:
        sizes = replace(sizes, batches=tuple(args.batches))
    if args.precisions:
        sizes = replace(sizes, precisions=tuple(args.precisions))
    if args.chunk_sizes:
        sizes = replace(sizes, chunk_sizes=tuple(args.chunk_sizes))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return _run_under_torchrun(cuda, sizes, args)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    path, log, summary = _paths(args.out, args.csv, 1, "gpu" if cuda else "cpu")
    failed = run_one(device, sizes, path, args.time_budget, args.point_seconds, log_path=log, summary_path=summary)
    print(f"written to {path}, {log} and {summary}" + (f"; {failed} section(s) failed" if failed else ""))
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
