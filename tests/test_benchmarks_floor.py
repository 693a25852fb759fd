"""``benchmarks/floor.py`` end to end at its ``--quick`` sizes: every row comes out (no speed assert)."""

from __future__ import annotations

import csv
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

BENCHMARKS = str(Path(__file__).resolve().parents[1] / "benchmarks")


def _floor() -> Any:
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    return __import__("floor")


@pytest.fixture
def threads_kept() -> Iterator[None]:
    """The benchmark sets one thread for the process: give the tests after it theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_quick_run_has_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str], threads_kept: None) -> None:
    floor = _floor()
    path = tmp_path / "floor.csv"
    floor.main(["--quick", "--world-size", "2", "--csv", str(path)])
    calls = ("default", "chunk16")
    expected = [
        (loss, mode, call, dtype)
        for loss in floor.LOSSES
        for call in calls
        for dtype in floor.DTYPES
        for mode in ("gather", "gather W=2", "ring W=2")
    ] + [(peer, "gather", "default", dtype) for peer in floor.PEERS for dtype in floor.DTYPES]
    expected += [(loss, "gather", "default+ids", "fp32") for loss in floor.ID_LOSSES]
    expected += [(loss, mode, "default M=4N", "fp32") for loss in floor.CAPTION_LOSSES
                 for mode in ("gather", "gather W=2", "ring W=2")]  # fmt: skip
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted((row["loss"], row["mode"], row["call"], row["dtype"]) for row in rows) == sorted(expected)
    assert all(float(row["ms"]) >= 0 and float(row["floor ms"]) > 0 for row in rows)
    ring_rows = [row for row in rows if row["mode"].startswith("ring")]
    assert all(float(row["ring ÷ gather"]) > 0 and "÷ gather at W" in row["target"] for row in ring_rows)
    assert all(row["target"].startswith("÷ no ids") for row in rows if row["call"].endswith("+ids"))
    targets = {row["loss"]: row["target"] for row in rows if row["target"].startswith("≤")}
    assert set(targets) == set(floor.TARGETS)
    table = capsys.readouterr().out
    assert table.count("\n| ") == len(expected) + 1  # the header row, then one line per row
