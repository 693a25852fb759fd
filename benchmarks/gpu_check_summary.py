"""The last lines ``gpu_check.py`` prints: a summary short enough for the tail of output a remote run returns.

``python benchmarks/gpu_check_summary.py gpu_check_1gpu.csv`` prints it again from a CSV (what
``gpu_day.sh`` does last, so the summary comes even when the check was stopped).

The machine, the worst error per (section, method), the anchor's ratios, the speed table at the
anchor's batch, every failure, and the largest batch each method reached: at most 9k characters.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Callable, Sequence
from typing import Any

Row = dict[str, Any]  # as gpu_check_report's; this file runs alone too (no torch needed)

ANCHOR_BATCH = 65536  # the batch of siglip-kernel's published figures, where every SigLIP method meets it
LIMIT = 9000  # characters: inside the 12,000-character tail a remote run returns, with the lines around it


def _figure(value: object, digits: str = ".1f") -> str:
    return "-" if value is None else format(value, digits) if isinstance(value, float) else str(value)


def summary(rows: Sequence[Row], *, anchor_batch: int) -> list[str]:
    """The summary's lines (at most ``LIMIT`` characters together)."""
    lines = ["== gpu_check summary =="]
    lines += [f"machine: {row['check']}: {row.get('note', '')}" for row in rows if row.get("section") == "machine"]
    worst: dict[tuple[str, str], tuple[float, str]] = {}
    for row in rows:
        if row.get("max_error") is not None:
            key = (str(row.get("section", "")).split(": ")[-1], f"{row['check']} {row.get('dtype', '')}")
            if key not in worst or row["max_error"] > worst[key][0]:
                worst[key] = (row["max_error"], str(row.get("batch", "")))
    if worst:
        lines.append("exactness, worst relative error (value and every gradient) against float64:")
        lines += [f"  {check} @ {batch}: {error:.1e}" for (_, check), (error, batch) in sorted(worst.items())]
    ratios = [row for row in rows if str(row.get("section", "")).endswith("anchor")]
    lines += ["anchor (each loss's specialist measured on this GPU: siglip-kernel, Inf-CL):"] + [
        f"  {row['check']}: {_figure(row.get('ratio'), '.2f')}x; {row.get('note', '')}" for row in ratios
        if "(published)" not in row["check"]]
    speed = [row for row in rows if row.get("time_ms") is not None and row.get("batch") == anchor_batch
             and "(published)" not in row["check"]]
    if speed:
        lines.append(f"speed at batch {anchor_batch}: time_ms, peak_mib, ratio to open_clip")
        lines += [f"  {row['check']} {row.get('dtype', '')} chunk {_figure(row.get('chunk_size'))}: "
                  f"{_figure(row['time_ms'])} ms, {_figure(row.get('peak_mib'), '.0f')} MiB, "
                  f"{_figure(row.get('ratio'), '.2f')}" for row in speed]
    problems = [row for row in rows if str(row.get("note") or "").startswith(("failed", "out of memory"))
                or row.get("check") == "section failed"]
    lines.append(f"failures and out-of-memory rows: {len(problems)}")
    lines += [f"  {row.get('section', '')} | {row['check']} | {row.get('batch', '')}: {row.get('note', '')}"[:200]
              for row in problems]
    reached: dict[str, int] = {}
    for row in rows:
        if row.get("time_ms") is not None and isinstance(row.get("batch"), int) and "(published)" not in row["check"]:
            key = f"{row['check']} {row.get('dtype', '')} chunk {_figure(row.get('chunk_size'))}"
            reached[key] = max(reached.get(key, 0), row["batch"])
    if reached:
        lines.append("largest batch measured: " + "; ".join(f"{key} {batch}" for key, batch in reached.items()))
    return _fit(lines)


def _fit(lines: list[str]) -> list[str]:
    """Keep the first lines that fit in ``LIMIT`` characters, and say how many were left out."""
    kept, used = [], 0
    for index, line in enumerate(lines):
        if used + len(line) + 1 > LIMIT - 80:
            kept.append(f"... {len(lines) - index} more lines in the log file")
            break
        kept.append(line)
        used += len(line) + 1
    return kept


def _chunk(value: str) -> int | str:
    return int(value) if value.isdigit() else value  # a number of rows, or "default"


_NUMBERS: dict[str, Callable[[str], object]] = {
    "ranks": int, "batch": int, "chunk_size": _chunk, "repeats": int, "time_ms": float, "peak_mib": float,
    "ratio": float, "max_error": float}


def rows_from_csv(path: str) -> list[Row]:
    """The rows of a CSV that ``gpu_check.py`` wrote, with their numbers as numbers and empty cells left out."""
    with open(path, newline="") as handle:
        return [{key: _NUMBERS.get(key, str)(value) for key, value in row.items() if value != ""}
                for row in csv.DictReader(handle)]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/gpu_check_summary.py GPU_CHECK_CSV")
    try:
        found = rows_from_csv(sys.argv[1])
    except OSError as error:
        sys.exit(f"gpu_check_summary: no rows to summarise: {error}")
    print("\n".join(summary(found, anchor_batch=ANCHOR_BATCH)))
