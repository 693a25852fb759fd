"""The one-GPU sections of ``gpu_check.py``: precision against float64, then time and memory per global batch.

Each function yields rows (without their ``section``) for :func:`gpu_check_report.run_section`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from gpu_check_losses import (
    LOSSES,
    PRECISIONS,
    LossFn,
    Precision,
    gradients,
    make_inputs,
    open_clip_loss,
    ours,
    reference,
    relative_errors,
    train_step,
)
from gpu_check_report import Deadline, Row, Sizes, measure

OPEN_CLIP_MISSING = "skipped: open_clip is not installed (pip install open_clip_torch)"


def _methods(loss: str, chunk_sizes: Sequence[int], *, ring: bool) -> list[tuple[str, int | None, LossFn | None]]:
    """(label, chunk_size, loss function or None when open_clip is missing): open_clip first, then ours."""
    methods: list[tuple[str, int | None, LossFn | None]] = [("open_clip", None, open_clip_loss(loss))]
    methods += [("ours gather", chunk, ours(loss, chunk_size=chunk)) for chunk in chunk_sizes]
    if ring:  # one rank: the ring has one block, here to show its single-device cost and precision
        methods.append(("ours ring", chunk_sizes[0], ours(loss, chunk_size=chunk_sizes[0], communication="ring")))
    return methods


def _row(loss: str, label: str, precision: Precision, batch: int, chunk: int | None) -> Row:
    return {"check": f"{loss}: {label}", "dtype": str(precision.dtype).removeprefix("torch."), "batch": batch,
            "compute": precision.open_clip if label == "open_clip" else precision.ours, "chunk_size": chunk,
            "ranks": 1}


def exactness(device: torch.device, sizes: Sizes) -> Iterator[Row]:
    """Every method's value and gradients (features, scale, bias) against the float64 reference."""
    for precision in (PRECISIONS[name] for name in sizes.precisions):
        for loss in LOSSES:
            x = make_inputs(sizes.exact_batch, sizes.dim, precision.dtype, device)
            want = reference(loss, x)
            for label, chunk, fn in _methods(loss, sizes.chunk_sizes[:1], ring=True):
                row = _row(loss, label, precision, sizes.exact_batch, chunk)
                if fn is None:
                    yield {**row, "note": OPEN_CLIP_MISSING}
                    continue
                value = train_step(fn, x, precision, device)()
                yield {**row, **relative_errors(gradients(loss, value, x), want)}
                for leaf in x.leaves():
                    leaf.grad = None


def speed(device: torch.device, sizes: Sizes, deadline: Deadline, point_seconds: float) -> Iterator[Row]:
    """Forward+backward time and peak memory per global batch; a method stops growing at its first OOM.

    ``ratio`` is the time over open_clip's at the same loss, precision and batch.
    """
    for precision in (PRECISIONS[name] for name in sizes.precisions):
        for loss in LOSSES:
            open_clip_ms: dict[int, float] = {}
            for label, chunk, fn in _methods(loss, sizes.chunk_sizes, ring=False):
                if fn is None:
                    yield {**_row(loss, label, precision, 0, chunk), "batch": None, "note": OPEN_CLIP_MISSING}
                    continue
                last: tuple[int, float] | None = None  # (batch, seconds a step) of the last size measured
                for batch in sizes.batches:
                    row = _row(loss, label, precision, batch, chunk)
                    # Time grows as batch² here: skip what would end past the budget, say so.
                    step_s = 0.0 if last is None else last[1] * (batch / last[0]) ** 2
                    if not deadline.allows(2 * step_s + max(point_seconds, 3 * step_s), device):
                        yield {**row, "note": "skipped: past the time budget (--time-budget)"}
                        continue
                    x = make_inputs(batch, sizes.dim, precision.dtype, device)
                    try:
                        timing = measure(train_step(fn, x, precision, device), device, leaves=x.leaves(),
                                         point_seconds=point_seconds)
                    except torch.OutOfMemoryError:
                        del x
                        torch.cuda.empty_cache()
                        yield {**row, "note": "out of memory (larger batches not tried)"}
                        break
                    del x
                    last = (batch, timing.time_ms / 1e3)
                    ratio = None
                    if label == "open_clip":
                        open_clip_ms[batch] = timing.time_ms
                    elif batch in open_clip_ms:
                        ratio = timing.time_ms / open_clip_ms[batch]
                    yield {**row, "time_ms": timing.time_ms, "peak_mib": timing.peak_mib, "repeats": timing.repeats,
                           "ratio": ratio}


# siglip-kernel 0.1.1's README (github.com/avocardio/siglip-kernel, PyPI "siglip-kernel"): Triton
# kernels for the SigLIP loss, measured on Hopper (GH200/H100), B = 65,536, bf16, forward+backward.
# Its summary does not restate D; its usage example uses D = 768. "GB" read as 10^9 bytes.
TRITON_SIGLIP = "siglip-kernel 0.1.1 README, Hopper (GH200/H100), bf16, fwd+bwd"
PUBLISHED: list[Row] = [
    {"check": "siglip: siglip-kernel fused (published)", "dtype": "bfloat16", "batch": 65536, "time_ms": 48.8,
     "peak_mib": 1.4e9 / 2**20, "ranks": 1, "note": f"{TRITON_SIGLIP}: 48.8 ms on 1.4 GB"},
    {"check": "siglip: siglip-kernel chunk_size=1024 (published)", "dtype": "bfloat16", "batch": 65536,
     "chunk_size": 1024, "time_ms": 54.3, "peak_mib": 640e6 / 2**20, "ranks": 1,
     "note": f"{TRITON_SIGLIP}: its minimum-memory setting, 54.3 ms on 640 MB"},
    {"check": "siglip: eager cuBLAS reference (published)", "dtype": "bfloat16", "batch": 65536, "time_ms": 102.0,
     "peak_mib": 33e9 / 2**20, "ranks": 1, "note": f"{TRITON_SIGLIP}: 102.0 ms on 33 GB"},
]


def published(measured: Sequence[Row]) -> Iterator[Row]:
    """The published figures, then ours at the same setting as ratios (targets: ≤ 1.3× the time, ≤ 1.5 GB)."""
    yield from PUBLISHED
    anchor = PUBLISHED[0]
    for row in measured:
        same = row.get("check") == "siglip: ours gather" and row.get("dtype") == "bfloat16"
        if same and row.get("batch") == anchor["batch"] and row.get("time_ms") is not None:
            yield {"check": f"siglip: ours gather chunk {row['chunk_size']} / siglip-kernel fused",
                   "dtype": "bfloat16", "batch": anchor["batch"], "chunk_size": row["chunk_size"],
                   "ratio": row["time_ms"] / anchor["time_ms"],
                   "note": f"time ratio; peak {row['peak_mib'] * 2**20 / 1e9:.2f} GB against 1.4 GB "
                           "(targets: ratio ≤ 1.3, peak ≤ 1.5 GB; D here vs. unstated there)"}
