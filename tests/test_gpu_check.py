"""``benchmarks/gpu_check.py``: its one line without CUDA, and every part of it that runs on CPU, at tiny sizes."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = str(ROOT / "benchmarks")


def _gpu_check() -> Any:
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    import gpu_check

    return gpu_check


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--csv", str(tmp_path / "out.csv")],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "no CUDA device" in result.stdout, result.stdout
    assert not (tmp_path / "out.csv").exists()


def test_our_kernels_match_open_clip_on_cpu() -> None:
    rows = _gpu_check().against_open_clip(torch.device("cpu"), batch=48, dim=16)
    assert len(rows) == 4
    for row in rows:
        assert row["max_error"] < 1e-5, row


def test_sweep_table_and_csv_on_cpu(tmp_path: Path) -> None:
    gpu_check = _gpu_check()
    rows = gpu_check.sweep(torch.device("cpu"), [16, 32], 8, (torch.float32, torch.bfloat16), (8,), repeats=1)
    assert len(rows) == 2 * 4 * 2  # dtypes × (2 ours + 2 open_clip) × batches
    assert all(row["time_ms"] > 0 and math.isnan(row["peak_mib"]) for row in rows)
    rows += gpu_check.PUBLISHED
    text = gpu_check.table(rows)
    assert text.count("\n") == len(rows) + 1 and "48.8" in text and "Inf-CL" in text
    gpu_check.write_csv(rows, str(tmp_path / "table.csv"))
    with open(tmp_path / "table.csv") as handle:
        read = list(csv.DictReader(handle))
    assert [row["check"] for row in read] == [row["check"] for row in rows]
    assert list(read[0]) == list(gpu_check.COLUMNS)


def distributed_on_cpu(rank: int, world_size: int) -> list[dict[str, Any]]:
    return _gpu_check().distributed_checks(rank, world_size, "cpu", 8, 8, 16, 1)


def test_distributed_checks_on_gloo(pool: Any) -> None:
    rows = pool(3).run(distributed_on_cpu, timeout=120)[0]
    exactness = [row for row in rows if "exactness" in row["section"]]
    checks = {row["check"] for row in exactness}
    assert {"all_gather sizes=given", "all_gather sizes=exchanged", "supcon value and gradients"} <= checks
    assert any("SyncBatchNorm" in check for check in checks)
    assert all(row["max_error"] < 1e-12 for row in exactness), exactness
    speed = [row for row in rows if "speed" in row["section"]]
    assert len(speed) == 5 and all(row["time_ms"] > 0 for row in speed), speed
