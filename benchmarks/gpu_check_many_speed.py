"""The multi-rank timing and memory sections of ``gpu_check.py``: every rank runs them, rank 0 writes the rows.

Times are the slowest rank's median, peaks the largest rank's (:func:`gpu_check_report.measure`).
Shards are even here except where a row says otherwise, so every rank does the same work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from gpu_check_losses import LOSSES, PRECISIONS, LossFn, make_inputs, open_clip_loss, ours, train_step
from gpu_check_many import COMMUNICATIONS
from gpu_check_one import OPEN_CLIP_MISSING
from gpu_check_report import Deadline, Row, Sizes, failure, measure, out_of_memory, release
from torch import Tensor

from contrastive_dist import all_gather

# all_gather_into_tensor / reduce_scatter_tensor under the names the installed torch uses (2.13 renamed them).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _PadToMax(torch.autograd.Function):
    """The common hand-written gather: pad every rank to the largest, gather equal blocks, drop the padding."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: tuple[int, ...]) -> Tensor:  # type: ignore[override]
        largest = max(sizes)
        padded = x.new_zeros((largest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((len(sizes) * largest, *x.shape[1:]))
        _all_gather_single(out, padded)
        ctx.largest, ctx.rows = largest, x.shape[0]
        ctx.keep = torch.cat([torch.arange(r * largest, r * largest + n) for r, n in enumerate(sizes)]).to(x.device)
        return out[ctx.keep]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        padded = grad.new_zeros((dist.get_world_size() * ctx.largest, *grad.shape[1:]))
        padded[ctx.keep] = grad
        out = grad.new_empty((ctx.largest, *grad.shape[1:]))
        _reduce_scatter_single(out, padded)
        return out[: ctx.rows], None


def _raw_collectives(x: Tensor, upstream: Tensor, sizes: tuple[int, ...]) -> None:
    """The floor for equal sizes: the forward's all-gather and the backward's reduce-scatter, no autograd."""
    _all_gather_single(x.new_empty((sum(sizes), *x.shape[1:])), x.detach())
    _reduce_scatter_single(x.new_empty(x.shape), upstream)


def _ours(x: Tensor, upstream: Tensor, sizes: tuple[int, ...], *, given: bool) -> None:
    all_gather(x, sizes=sizes if given else None).tensor.backward(upstream)


def _pad_to_max(x: Tensor, upstream: Tensor, sizes: tuple[int, ...]) -> None:
    _PadToMax.apply(x, sizes).backward(upstream)


def gather_speed(rank: int, world_size: int, device: torch.device, sizes: Sizes, point_seconds: float) -> Iterator[Row]:
    """Forward+backward of the gather against the raw collectives (even) and pad-to-max (uneven).

    Every method receives the same upstream gradient and returns the gradient of its rows: the same
    backward work. ``ratio`` is the time over the first row of its shards (the baseline).
    """
    even = (sizes.gather_rows,) * world_size
    skewed = tuple(sizes.gather_rows * (2 * r + 1) // world_size for r in range(world_size))
    cases: list[tuple[str, tuple[int, ...], Callable[[Tensor, Tensor, tuple[int, ...]], None]]] = [
        ("all_gather_single + reduce_scatter_single (raw, no autograd)", even, _raw_collectives),
        ("all_gather, sizes given", even, functools.partial(_ours, given=True)),
        ("all_gather, sizes exchanged", even, functools.partial(_ours, given=False)),
        ("pad-to-max + all_gather_single (autograd)", skewed, _pad_to_max),
        ("all_gather, sizes given", skewed, functools.partial(_ours, given=True)),
    ]
    baseline: dict[tuple[int, ...], float] = {}
    generator = torch.Generator(device).manual_seed(rank)
    for check, shards, operation in cases:
        x = torch.randn(shards[rank], sizes.dim, generator=generator, device=device).requires_grad_()
        upstream = torch.randn(sum(shards), sizes.dim, generator=generator, device=device)
        timing = measure(functools.partial(operation, x, upstream, shards), device, leaves=(x,),
                         point_seconds=point_seconds)
        baseline.setdefault(shards, timing.time_ms)
        yield {"check": check, "dtype": "float32", "ranks": world_size, "batch": sum(shards), "repeats": timing.repeats,
               "time_ms": timing.time_ms, "peak_mib": timing.peak_mib, "ratio": timing.time_ms / baseline[shards],
               "note": f"shards {list(shards)}, D={sizes.dim}"}


def _timed(fn: LossFn | None, rows: int, device: torch.device, sizes: Sizes, point_seconds: float, *, seed: int,
           group: dist.ProcessGroup | None = None) -> Row:
    """One loss's forward+backward on bf16 features of ``rows`` rows: its timing fields, or why there are none."""
    if fn is None:
        return {"note": OPEN_CLIP_MISSING}
    precision = PRECISIONS["bf16"]
    x = make_inputs(rows, sizes.dim, precision.dtype, device, seed=seed)
    try:
        timing = measure(train_step(fn, x, precision, device), device, leaves=x.leaves(), group=group,
                         point_seconds=point_seconds)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        # The same size on every rank: every rank runs out alike. Any other error is raised (the
        # section's), since a rank that went on alone would wait for the others' collectives.
        if not out_of_memory(error):
            raise
        del x
        release(device)
        return {"note": failure(error)}
    del x
    release(device)  # the next method starts from an empty cache, as the first did
    return {"time_ms": timing.time_ms, "peak_mib": timing.peak_mib, "repeats": timing.repeats}


def loss_speed(rank: int, world_size: int, device: torch.device, sizes: Sizes, point_seconds: float) -> Iterator[Row]:
    """Each loss, open_clip's distributed setting against ours in both modes; ``ratio``: time over open_clip's."""
    chunk = sizes.chunk_sizes[0]
    for loss in LOSSES:
        methods = [("open_clip", open_clip_loss(loss, rank=rank, world_size=world_size))]
        methods += [(f"ours {mode}", ours(loss, chunk_size=chunk, communication=mode)) for mode in COMMUNICATIONS]
        open_clip_ms = None
        for label, fn in methods:
            fields = _timed(fn, sizes.loss_rows, device, sizes, point_seconds, seed=rank)
            ratio = None
            if label == "open_clip":
                open_clip_ms = fields.get("time_ms")
            elif open_clip_ms and "time_ms" in fields:
                ratio = fields["time_ms"] / open_clip_ms
            compute = PRECISIONS["bf16"].open_clip if label == "open_clip" else PRECISIONS["bf16"].ours(device)
            yield {"check": f"{loss}: {label}", "dtype": "bfloat16", "compute": compute, "ranks": world_size,
                   "batch": sizes.loss_rows * world_size, "chunk_size": None if label == "open_clip" else chunk,
                   "ratio": ratio, **fields}


def memory_by_ranks(rank: int, world_size: int, device: torch.device, sizes: Sizes,
                    point_seconds: float) -> Iterator[Row]:
    """Per-rank peak of CLIP at a fixed ``memory_rows`` per rank on the first 1, 2, 4, … W ranks.

    ``ratio`` is the peak over the 2-rank peak of the same mode (the one-rank peak where there is
    one rank): from W = 2 on, ring mode holds the same blocks in flight at any W, so its ratio stays
    near 1, while gather mode's grows with W (it holds every rank's features). One rank has no ring
    buffers at all: normalising to it would read every ring row as growth.
    """
    counts = sorted({min(2**power, world_size) for power in range(world_size.bit_length() + 1)})
    # Every rank creates every group; a rank outside one gets a placeholder it never passes on.
    groups = {count: cast(dist.ProcessGroup, dist.new_group(list(range(count)))) for count in counts}
    chunk = sizes.chunk_sizes[0]
    for mode in COMMUNICATIONS:
        measured: dict[int, Row] = {}
        for count in counts:
            measured[count] = {}
            if rank < count:  # the other ranks wait for the next section
                fn = ours("info_nce", chunk_size=chunk, communication=mode, group=groups[count])
                measured[count] = _timed(fn, sizes.memory_rows, device, sizes, point_seconds, seed=rank,
                                         group=groups[count])
        ratios = over_two_ranks({count: fields.get("peak_mib") for count, fields in measured.items()})
        for count, fields in measured.items():
            yield {"check": f"info_nce: ours {mode}, per-rank peak", "dtype": "bfloat16",
                   "compute": PRECISIONS["bf16"].ours(device), "ranks": count,
                   "batch": sizes.memory_rows * count, "chunk_size": chunk, "ratio": ratios[count], **fields}


def over_two_ranks(peaks: dict[int, float | None]) -> dict[int, float | None]:
    """Each rank count's peak over the 2-rank peak (the 1-rank peak where there is no 2); ``None`` where unknown.

    Example: ``{1: 10.0, 2: 40.0, 4: 40.0}`` gives ``{1: 0.25, 2: 1.0, 4: 1.0}``: flat from 2 ranks on.
    """
    base = peaks.get(2 if 2 in peaks else 1)
    known = base is not None and base > 0  # NaN (no memory counters, CPU) is not > 0
    return {count: peak / base if known and peak is not None and base else None
            for count, peak in peaks.items()}


# Cheng et al. 2024, "Breaking the Memory Barrier: Near Infinite Batch Size Scaling for Contrastive
# Loss" (Inf-CL, arXiv 2410.17243), Table 1, 8×A800 80 GB: ViT-L/14 (embeddings D = 768), data
# parallel, automatic mixed precision (fp16), gradient cache (accumulation batch 128); the loss's
# memory per GPU in GB (read as 10^9 bytes). Inf-CL* adds its "data offload". Their speed figures
# (Fig. 4) are whole training iterations, not the loss alone: not comparable, not copied here.
INF_CL = "Inf-CL (arXiv 2410.17243) Table 1: 8×A800, ViT-L/14 (D 768), AMP fp16, gradient cache; loss memory per GPU"
INF_CL_GB = {"Inf-CL": {32768: 0.18, 65536: 0.36, 131072: 0.72, 262144: 1.45},
             "Inf-CL* (data offload)": {1048576: 6.53},
             "OpenCLIP local loss": {32768: 2.27, 65536: 8.63, 131072: 33.64}}


def published() -> Iterator[Row]:
    for method, figures in INF_CL_GB.items():
        for batch, gigabytes in figures.items():
            yield {"check": f"info_nce: {method} (published)", "dtype": "float16", "ranks": 8, "batch": batch,
                   "peak_mib": gigabytes * 1e9 / 2**20, "note": INF_CL}


def sweep(rank: int, world_size: int, device: torch.device, sizes: Sizes, deadline: Deadline,
          point_seconds: float) -> Iterator[Row]:
    """CLIP, gather against ring mode, at global batches 64k–1M on ``sweep_world_size`` ranks or more.

    ``ratio``: ring's time over gather mode's; then our per-rank peaks over Inf-CL's published ones.
    """
    if world_size < sizes.sweep_world_size:
        yield {"check": "info_nce: gather vs ring sweep", "ranks": world_size,
               "note": f"skipped: needs {sizes.sweep_world_size} ranks or more"}
        return
    chunk, measured = sizes.chunk_sizes[0], []
    last: dict[str, tuple[int, float]] = {}  # mode → (global batch, seconds a step) of its last size
    out_of_memory: set[str] = set()
    for batch in sizes.sweep_batches:
        gather_ms = None
        for mode in COMMUNICATIONS:
            row: Row = {"check": f"info_nce: ours {mode}", "dtype": "bfloat16",
                        "compute": PRECISIONS["bf16"].ours(device),
                        "ranks": world_size, "batch": batch, "chunk_size": chunk}
            before = last.get(mode)
            step_s = 0.0 if before is None else before[1] * (batch / before[0]) ** 2
            if mode in out_of_memory:
                yield {**row, "note": "skipped: out of memory at a smaller batch"}
                continue
            if not deadline.allows(2 * step_s + max(point_seconds, 3 * step_s), device):
                yield {**row, "note": "skipped: past the time budget (--time-budget)"}
                continue
            fields = _timed(ours("info_nce", chunk_size=chunk, communication=mode), batch // world_size, device,
                            sizes, point_seconds, seed=rank)
            if "time_ms" in fields:
                last[mode] = (batch, fields["time_ms"] / 1e3)
            else:
                out_of_memory.add(mode)
            ratio = None
            if mode == "gather":
                gather_ms = fields.get("time_ms")
            elif gather_ms and "time_ms" in fields:
                ratio = fields["time_ms"] / gather_ms
            measured.append({**row, **fields, "ratio": ratio})
            yield measured[-1]
    yield from published()
    yield from _against_inf_cl(measured)


def _against_inf_cl(measured: Sequence[Row]) -> Iterator[Row]:
    theirs = INF_CL_GB["Inf-CL"] | INF_CL_GB["Inf-CL* (data offload)"]
    for row in measured:
        if row["batch"] in theirs and row.get("peak_mib") is not None:
            yield {"check": f"{row['check']} / Inf-CL, per-rank peak", "dtype": "bfloat16", "ranks": row["ranks"],
                   "batch": row["batch"], "ratio": row["peak_mib"] * 2**20 / 1e9 / theirs[row["batch"]],
                   "note": "memory ratio; theirs: the loss's share of a training step (fp16, A800), ours: the "
                           "peak of forward+backward above the inputs"}
