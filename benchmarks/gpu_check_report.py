"""What ``gpu_check.py`` records and how: rows written as they are measured, guarded sections, timing.

* :class:`Report`: each row goes to the CSV (flushed) and to stdout the moment it is measured, so a
  crash or a kill keeps every row before it;
* :func:`run_section`: one section's rows; an exception costs that section's remaining rows only
  (on every rank alike, when the failure is the same on every rank);
* :func:`measure`: median step time from CUDA events (wall clock on CPU) and peak memory above the
  inputs, the same protocol for every method; with a process group, the slowest rank's figures;
* :func:`out_of_memory` and :func:`release`: an allocator failure of any kind reads as out of memory,
  and the cache is emptied between methods, so one method's memory does not fail the next.
"""

from __future__ import annotations

import csv
import gc
import math
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Sizes:
    """Every size the check uses; the defaults are the GPU run's, :data:`TINY` the test suite's (CPU)."""

    dim: int = 768
    exact_batch: int = 4096  # one GPU: every method against float64
    batches: tuple[int, ...] = (16384, 32768, 65536, 131072)  # one GPU: time and memory
    specialist_batches: tuple[int, ...] = (16384, 65536, 131072)  # one GPU: siglip-kernel's module and Inf-CL
    chunk_sizes: tuple[int | None, ...] = (None, 1024, 4096)  # None: the default call (its chunk rule)
    precisions: tuple[str, ...] = ("bf16", "fp32", "tf32")
    exact_rows: int = 16  # several GPUs: float64 checks, about this many rows per rank, one rank empty
    scale_rows: int = 1024  # several GPUs: bf16 features against float64, rows per rank, one rank empty
    gather_rows: int = 8192  # several GPUs: the gather's timing, rows of D features per rank
    loss_rows: int = 16384  # several GPUs: the losses' timing, rows per rank
    memory_rows: int = 8192  # several GPUs: per-rank memory against the number of ranks
    sweep_batches: tuple[int, ...] = (65536, 131072, 262144, 524288, 1048576)  # global, gather vs ring
    sweep_world_size: int = 8  # the sweep runs with at least this many ranks (Inf-CL's 8-GPU setting)


TINY = Sizes(dim=16, exact_batch=48, batches=(32, 64), specialist_batches=(32, 64), chunk_sizes=(8, 16),
             precisions=("bf16", "fp32"), exact_rows=8, scale_rows=12, gather_rows=16, loss_rows=16, memory_rows=8,
             sweep_batches=(48, 96), sweep_world_size=3)
COLUMNS = ("section", "check", "dtype", "compute", "ranks", "batch", "chunk_size", "repeats", "time_ms",
           "peak_mib", "ratio", "max_error", "note")
Row = dict[str, Any]


class Report:
    """Rows to a CSV file and a markdown log, and a short line on stdout, each as soon as it is measured.

    Args:
        path: the CSV file (overwritten); ``None`` writes no file.
        echo: print a short line per row to stdout (the whole row is in the files).
        log: a markdown file that gets the whole table (overwritten); ``None`` writes none.
    """

    def __init__(self, path: str | None, *, echo: bool = True, log: str | None = None) -> None:
        self.rows: list[Row] = []
        self.echo = echo
        self._handle: IO[str] | None = open(path, "w", newline="") if path else None
        self._writer = csv.DictWriter(self._handle, fieldnames=COLUMNS) if self._handle else None
        if self._writer is not None:
            self._writer.writeheader()
        self._log: IO[str] | None = open(log, "w") if log else None
        if self._log is not None:
            self._log.write("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n")

    def write(self, row: Row) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ValueError(f"row columns must be among {COLUMNS}, got {sorted(unknown)}")
        self.rows.append(row)
        if self._writer is not None and self._handle is not None:
            self._writer.writerow({column: _cell(row.get(column)) for column in COLUMNS})
            self._handle.flush()
        if self._log is not None:
            self._log.write("| " + " | ".join(_cell(row.get(column)) for column in COLUMNS) + " |\n")
            self._log.flush()
        if self.echo:  # the device tool returns only the output's tail: keep each line short
            print(short_line(row), flush=True)

    def close(self) -> None:
        for handle in (self._handle, self._log):
            if handle is not None:
                handle.close()
        self._handle = self._writer = self._log = None


def short_line(row: Row) -> str:
    """One row in about a hundred characters: where, what, and its figures."""
    figures = [f"{key} {_cell(row.get(key))}" for key in ("dtype", "batch", "chunk_size", "time_ms", "peak_mib",
                                                            "ratio", "max_error") if row.get(key) is not None]
    note = str(row.get("note") or "")
    return " | ".join([str(row.get("section", "")), str(row.get("check", "")), *figures, note[:80]]).rstrip(" |")


_ALLOCATOR_WORDS = re.compile(r"out of memory|ALLOC_FAILED|cudaErrorMemoryAllocation|CUDA error: alloc", re.IGNORECASE)


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is the allocator's: ``torch.OutOfMemoryError``, or a ``RuntimeError`` naming a failed
    allocation (cuBLAS's ``CUBLAS_STATUS_ALLOC_FAILED`` when another method has filled the memory, cuDNN's, ...)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and bool(_ALLOCATOR_WORDS.search(str(error))))


def failure(error: BaseException) -> str:
    """A row's note for a method that raised: out of memory, or the error's first line."""
    if out_of_memory(error):
        return "out of memory (larger batches not tried)"
    return f"failed: {type(error).__name__}: {error}".splitlines()[0][:300]


def release(device: torch.device) -> None:
    """Free what the last method left: its tensors, then the allocator's cache (what the next one may need)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:.2f}" if 1 <= abs(value) < 1e4 else f"{value:.3g}"
    return str(value)


def run_section(report: Report, name: str, rows: Iterable[Row], *, device: torch.device | None = None) -> bool:
    """Write each row of the section ``name`` as it comes; return whether the section finished.

    A failure writes one ``section failed`` row naming the error and the rank, and the run goes on
    with the next section. Under a process group every rank runs every section; the ranks agree on
    the outcome afterwards, so a failure that happens on every rank alike (out of memory at the
    same size, an unsupported operation) leaves them in step. One that strikes a single rank
    inside a collective ends at the process group's timeout, with every earlier row on disk.
    """
    error = None
    try:
        for row in rows:
            report.write({"section": name, **row})
    except Exception as exc:  # noqa: BLE001 - one section's failure must not cost the others
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(f"gpu_check: section {name!r} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    if device is not None:
        release(device)
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(rank, message) for rank, message in enumerate(errors) if message is not None]
    if failed:
        rank, message = failed[0]
        report.write({"section": name, "check": "section failed", "note": f"rank {rank}: {message}"})
    return not failed


@dataclass(frozen=True)
class Timing:
    """One method at one size: median step time, peak memory above the inputs, timed steps."""

    time_ms: float
    peak_mib: float  # NaN where the device has no memory counters (CPU)
    repeats: int
    host_ms: float  # the host's time to issue one step (CUDA: the timed steps' loop over their number)


def measure(step: Callable[[], object], device: torch.device, *, leaves: Sequence[Tensor] = (),
            group: dist.ProcessGroup | None = None, point_seconds: float = 3.0) -> Timing:
    """Time ``step()`` and record its peak memory, the same way for every method.

    Warm-up steps first (allocator, cuBLAS, communicators), then as many timed steps as fit in
    ``point_seconds`` (at least 3, at most 50: at least 20 for any step under ``point_seconds / 20``),
    each between two CUDA events on the current stream (wall clock on CPU) with nothing in between:
    no synchronisation or barrier inside the timed steps. ``leaves`` lose their ``.grad`` before each
    step, so every step allocates what a training step allocates. The peak is counted above what is
    allocated before a step (the inputs). With several ranks in ``group`` the ranks agree on the
    number of steps, and the slowest rank's median and the largest peak are returned.
    """
    cuda = device.type == "cuda"

    def clear() -> None:
        for leaf in leaves:
            leaf.grad = None

    def timed_once() -> float:
        clear()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    # Every decision below is taken on agreed (slowest-rank) figures: ranks that ran different
    # numbers of steps would wait for each other's collectives forever.
    warm = agreed_max(timed_once(), device, group)
    if warm < point_seconds:  # the first step pays one-time costs; the faster of two is what a step costs
        warm = min(warm, agreed_max(timed_once(), device, group))
    repeats = int(min(50, max(3, point_seconds // max(warm, 1e-6))))
    clear()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    times, issued_s = [], 0.0
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        issued_s = time.perf_counter()
        for begin, end in events:
            clear()
            begin.record()
            step()
            end.record()
        issued_s = time.perf_counter() - issued_s  # the host's time alone: no synchronisation in the loop
        torch.cuda.synchronize(device)
        times = [begin.elapsed_time(end) for begin, end in events]
    else:
        for _ in range(repeats):
            clear()
            begin_s = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin_s) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - start_bytes) / 2**20 if cuda else float("nan")
    clear()
    host_ms = issued_s * 1e3 / repeats if cuda else statistics.median(times)
    return Timing(agreed_max(statistics.median(times), device, group), agreed_max(peak, device, group), repeats,
                  agreed_max(host_ms, device, group))


def agreed_max(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The largest ``value`` over the ranks of ``group`` (the value itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


class Deadline:
    """The run's time budget: a measurement that would end past it is skipped, on every rank alike."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def allows(self, predicted_s: float, device: torch.device, group: dist.ProcessGroup | None = None) -> bool:
        late = float(time.monotonic() + predicted_s > self.end)
        return agreed_max(late, device, group) == 0.0
