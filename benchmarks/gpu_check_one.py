"""The one-GPU sections of ``gpu_check.py``: precision against float64, then time and memory per global batch.

One section per (precision, loss), so a failure costs that pair's rows only; inside a section a
method that raises costs its own rows only (an allocator error reads as out of memory), and the
allocator's cache is emptied between methods. Each function yields rows (without their
``section``) for :func:`gpu_check_report.run_section`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from gpu_check_anchors import INF_CL, SIGLIP_KERNEL, specialists
from gpu_check_losses import (
    Method,
    Precision,
    gradients,
    make_inputs,
    open_clip_loss,
    ours,
    reference,
    relative_errors,
    train_step,
)
from gpu_check_report import Deadline, Row, Sizes, failure, measure, out_of_memory, release
from gpu_check_summary import ANCHOR_BATCH

OPEN_CLIP_MISSING = "skipped: open_clip is not installed (pip install open_clip_torch, or its wheels: gpu_day.sh)"
DEFAULT_CHUNK = "default"  # the chunk cell of our default call (chunk_size=None: the core's rule)
ANCHOR = SIGLIP_KERNEL  # the method every SigLIP row is compared with at ANCHOR_BATCH, measured on the same GPU
ANCHORS = {"siglip": ANCHOR, "info_nce": f"{INF_CL} cal_flash_loss, both directions"}  # the same for each loss


def methods(loss: str, precision: Precision, device: torch.device, chunk_sizes: Sequence[int | None],
            specialist_batches: Sequence[int] = ()) -> list[Method]:
    """open_clip, ours in gather mode per chunk size (``None``: the default call), ours in ring mode at the
    first (one rank: one block), then the specialists in bf16 (:func:`gpu_check_anchors.specialists`): for
    SigLIP siglip-kernel's default entry point, its minimum-memory chunk 1024 and its distributed module on
    one rank, for InfoNCE Inf-CL's flash loss."""
    found = [Method("open_clip", None, open_clip_loss(loss), precision.open_clip, OPEN_CLIP_MISSING)]
    compute = precision.ours(device)
    found += [Method("ours gather", chunk, ours(loss, chunk_size=chunk), compute) for chunk in chunk_sizes]
    found.append(Method("ours ring", chunk_sizes[0], ours(loss, chunk_size=chunk_sizes[0], communication="ring"),
                        compute))
    return found + specialists(loss, precision, device, specialist_batches)


def _with_note(note: str, method: Method) -> str:
    return f"{note}; {method.note}" if method.note else note


def _row(loss: str, method: Method, precision: Precision, batch: int | None) -> Row:
    ours_by_default = method.label.startswith("ours") and method.chunk_size is None
    return {"check": f"{loss}: {method.label}", "dtype": str(precision.dtype).removeprefix("torch."), "batch": batch,
            "compute": method.compute, "chunk_size": DEFAULT_CHUNK if ours_by_default else method.chunk_size,
            "ranks": 1}


def exactness(device: torch.device, sizes: Sizes, precision: Precision, loss: str) -> Iterator[Row]:
    """Every method's value and gradients (features, scale, bias) against the float64 reference; and ours
    with sample ids in both modes (ids compared in the fused kernels on CUDA) against the reference with ids."""
    x = make_inputs(sizes.exact_batch, sizes.dim, precision.dtype, device)
    want, want_with_ids = reference(loss, x), reference(loss, x, ids=True)
    chunk = sizes.chunk_sizes[0]
    with_ids = [Method(f"ours {mode}, ids", chunk, ours(loss, chunk_size=chunk, communication=mode, ids=True),
                       precision.ours(device)) for mode in ("gather", "ring")]  # fmt: skip
    for method in [*methods(loss, precision, device, sizes.chunk_sizes[:1], sizes.specialist_batches),
                   *with_ids]:
        row = _row(loss, method, precision, sizes.exact_batch)
        if method.fn is None:
            yield {**row, "note": method.missing}
            continue
        try:
            value = train_step(method.fn, x, precision, device)()
            expected = want_with_ids if method in with_ids else want
            errors = relative_errors(gradients(loss, value, x), expected)
            yield {**row, **errors, "note": _with_note(errors["note"], method)}
        except Exception as error:  # noqa: BLE001 - one method's failure costs its own row only
            yield {**row, "note": failure(error)}
        for leaf in x.leaves():
            leaf.grad = None
        release(device)


def speed(device: torch.device, sizes: Sizes, precision: Precision, loss: str, deadline: Deadline,
          point_seconds: float) -> Iterator[Row]:
    """Forward+backward time and peak memory per global batch; a method stops growing at its first failure.

    ``ratio`` is the time over open_clip's at the same loss, precision and batch.
    """
    open_clip_ms: dict[int, float] = {}
    for method in methods(loss, precision, device, sizes.chunk_sizes, sizes.specialist_batches):
        if method.fn is None:
            yield {**_row(loss, method, precision, None), "note": method.missing}
            continue
        last: tuple[int, float] | None = None  # (batch, seconds a step) of the last size measured
        for batch in method.batches or sizes.batches:
            row = _row(loss, method, precision, batch)
            # Time grows as batch² here: skip what would end past the budget, say so.
            step_s = 0.0 if last is None else last[1] * (batch / last[0]) ** 2
            if not deadline.allows(2 * step_s + max(point_seconds, 3 * step_s), device):
                yield {**row, "note": "skipped: past the time budget (--time-budget)"}
                continue
            try:
                x = make_inputs(batch, sizes.dim, precision.dtype, device)
                timing = measure(train_step(method.fn, x, precision, device), device, leaves=x.leaves(),
                                 point_seconds=point_seconds)
            except Exception as error:  # noqa: BLE001 - out of memory or not: this method's larger sizes only
                x = None
                release(device)
                yield {**row, "note": failure(error) if out_of_memory(error) else
                       failure(error) + " (larger batches not tried)"}
                break
            del x
            last = (batch, timing.time_ms / 1e3)
            ratio = None
            if method.label == "open_clip":
                open_clip_ms[batch] = timing.time_ms
            elif batch in open_clip_ms:
                ratio = timing.time_ms / open_clip_ms[batch]
            yield {**row, "time_ms": timing.time_ms, "peak_mib": timing.peak_mib, "repeats": timing.repeats,
                   "ratio": ratio, "note": _with_note(f"host {timing.host_ms:.1f} ms a step", method)}
        release(device)


# siglip-kernel 0.1.2's README (github.com/avocardio/siglip-kernel, PyPI "siglip-kernel"), measured on
# Hopper (GH200/H100), B = 65,536, bf16, forward+backward; "GB" read as 10^9 bytes. Context only: the
# ratios below are against siglip-kernel measured live on the same GPU.
PUBLISHED_NOTE = "siglip-kernel 0.1.2 README, Hopper (GH200/H100), bf16, fwd+bwd; context, not a ratio's base"
PUBLISHED: list[Row] = [
    {"check": "siglip: siglip-kernel fused (published)", "dtype": "bfloat16", "batch": ANCHOR_BATCH,
     "time_ms": 48.8, "peak_mib": 1.4e9 / 2**20, "ranks": 1, "note": f"{PUBLISHED_NOTE}: 48.8 ms on 1.4 GB"},
    {"check": "siglip: siglip-kernel chunk_size=1024 (published)", "dtype": "bfloat16", "batch": ANCHOR_BATCH,
     "chunk_size": 1024, "time_ms": 54.3, "peak_mib": 640e6 / 2**20, "ranks": 1,
     "note": f"{PUBLISHED_NOTE}: 54.3 ms on 640 MB"},
]


def anchor(measured: Sequence[Row]) -> Iterator[Row]:
    """Every bf16 method at ``ANCHOR_BATCH`` over its loss's specialist measured on the same GPU (SigLIP over
    siglip-kernel, InfoNCE over Inf-CL), then siglip-kernel's published figures for context. ``ratio``: time
    over the specialist's; the note gives the peak ratio."""
    for loss, base_label in ANCHORS.items():
        at_anchor = [row for row in measured if row.get("check", "").startswith(f"{loss}: ")
                     and row.get("dtype") == "bfloat16" and row.get("batch") == ANCHOR_BATCH
                     and row.get("time_ms") is not None and "(published)" not in row["check"]]
        base = next((row for row in at_anchor if row["check"] == f"{loss}: {base_label}"), None)
        if base is None:
            yield {"check": f"{loss}: each method / {base_label} (live)", "dtype": "bfloat16", "batch": ANCHOR_BATCH,
                   "note": f"no ratio: {base_label} was not measured at this batch here (CUDA and its wheel are "
                           "needed)"}
            continue
        for row in at_anchor:
            if row is base:
                continue
            peak = row["peak_mib"] / base["peak_mib"] if base.get("peak_mib") else float("nan")
            chunk = "" if row.get("chunk_size") is None else f" (chunk {row['chunk_size']})"
            yield {"check": f"{row['check']}{chunk} / {base_label} (live)", "dtype": "bfloat16",
                   "batch": ANCHOR_BATCH, "chunk_size": row.get("chunk_size"),
                   "ratio": row["time_ms"] / base["time_ms"],
                   "note": f"time ratio, same GPU, same protocol; peak ratio {peak:.2f}"}
    yield from PUBLISHED
