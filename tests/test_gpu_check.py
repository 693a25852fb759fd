"""``benchmarks/gpu_check.py``: its one line without CUDA, and every part of it that runs on CPU, at tiny sizes.

One process runs the one-GPU sections in-process; 3 gloo processes run the multi-rank sections;
``torchrun`` runs the all-GPU command's entry point on 2 gloo processes. Failures are injected from here.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = str(ROOT / "benchmarks")
FAST = ["--device", "cpu", "--tiny", "--point-seconds", "0.02"]


def _module(name: str) -> Any:
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    return __import__(name)


def _read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _errors(note: str) -> dict[str, float]:
    """``{"value": 3e-08, "images": ...}`` from a row's note ``relative: value 3.0e-08, images ...``."""
    return {key: float(value) for key, value in re.findall(r"(\w+) (\d\.\de[+-]\d\d)", note.split("relative:")[-1])}


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny steps on one thread: on a loaded machine, waking a second one costs more than the step itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _section(rows: list[dict[str, str]], suffix: str) -> list[dict[str, str]]:
    return [row for row in rows if row["section"].endswith(suffix)]


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--csv", str(tmp_path / "out.csv")],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "no CUDA device" in result.stdout, result.stdout
    assert not (tmp_path / "out.csv").exists()


def test_one_rank_sections_end_to_end_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             one_thread: None) -> None:
    path = tmp_path / "one.csv"
    assert _module("gpu_check").main([*FAST, "--csv", str(path)]) == 0
    rows = _read(path)
    assert list(rows[0]) == list(_module("gpu_check_report").COLUMNS)
    machine = rows[0]
    assert machine["section"] == "machine" and machine["check"].startswith("1 x CPU")
    for fact in (f"torch {torch.__version__}", "CUDA ", "TF32 matmul off", "open_clip ", "UTC"):
        assert fact in machine["note"], machine
    exactness = _section(rows, "exactness")
    # 2 precisions × 2 losses × (open_clip, ours gather, ours ring), each with its scale (and bias) gradient.
    assert len(exactness) == 12 and all("scale" in _errors(row["note"]) for row in exactness)
    assert all("bias" in _errors(row["note"]) for row in exactness if row["check"].startswith("siglip"))
    for row in exactness:
        errors = _errors(row["note"])
        assert float(row["max_error"]) == pytest.approx(max(errors.values()), rel=0.1), row  # the note has 2 digits
        if row["dtype"] == "float32":
            assert float(row["max_error"]) < 1e-5, row
        else:  # bf16 features: gradients come back in bf16, whose rounding is 2**-9 relative
            assert float(row["max_error"]) < 2e-2, row
            if "ours" in row["check"]:  # our core's float32 logits keep the value to fp32 precision
                assert errors["value"] < 1e-5 and row["compute"].startswith("bf16 operands"), row
            else:
                assert row["compute"] == "bf16 products, bf16 logits (autocast)", row
    speed = _section(rows, "speed and memory")
    # 2 precisions × 2 losses × (open_clip, ours with 2 chunk sizes) × 2 batches.
    assert len(speed) == 24
    assert all(float(row["time_ms"]) > 0 and int(row["repeats"]) >= 3 and row["peak_mib"] == "" for row in speed)
    assert all(float(row["ratio"]) > 0 for row in speed if "ours" in row["check"])
    published = _section(rows, "published")
    assert [row["time_ms"] for row in published] == ["48.80", "54.30", "102.00"]
    assert all("siglip-kernel 0.1.1 README" in row["note"] and row["batch"] == "65536" for row in published)
    printed = capsys.readouterr().out
    assert printed.count("\n| 1 rank: ") == len(rows) - 1 and f"written to {path}" in printed


def test_a_failing_section_costs_only_its_rows_and_earlier_rows_are_already_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    path, seen_on_disk = tmp_path / "one.csv", []

    def failing_speed(*args: Any) -> Iterator[dict[str, Any]]:
        seen_on_disk.extend(_read(path))  # what a crash at this moment would leave
        yield {"check": "measured before the failure"}
        raise RuntimeError("injected failure")

    monkeypatch.setattr(_module("gpu_check_one"), "speed", failing_speed)
    assert _module("gpu_check").main([*FAST, "--csv", str(path)]) == 1
    assert [row["section"] for row in seen_on_disk] == ["machine"] + ["1 rank: exactness"] * 12
    rows = _read(path)
    assert rows[: len(seen_on_disk)] == seen_on_disk
    speed = _section(rows, "speed and memory")
    assert [row["check"] for row in speed] == ["measured before the failure", "section failed"]
    assert speed[1]["note"] == "rank 0: RuntimeError: injected failure"
    assert len(_section(rows, "published")) == 3  # the next section still ran


def test_past_the_time_budget_every_measurement_is_skipped_with_a_row_saying_so() -> None:
    report = _module("gpu_check_report")
    rows = list(_module("gpu_check_one").speed(torch.device("cpu"), report.TINY, report.Deadline(0.0), 0.02))
    assert len(rows) == 24 and all(row["note"] == "skipped: past the time budget (--time-budget)" for row in rows)


def ranks_on_cpu(rank: int, world_size: int, csv_path: str) -> list[dict[str, Any]]:
    """The multi-rank sections at tiny sizes; the gather's timing fails on rank 1 after its rows."""
    gpu_check, many_speed = _module("gpu_check"), _module("gpu_check_many_speed")
    original = many_speed.gather_speed

    def failing_on_rank_1(*args: Any) -> Iterator[dict[str, Any]]:
        yield from original(*args)
        if rank == 1:
            raise ValueError("injected on rank 1")

    many_speed.gather_speed = failing_on_rank_1
    try:  # the pool's processes serve other tests afterwards: put the original back
        return gpu_check.run_ranks(rank, world_size, torch.device("cpu"), _module("gpu_check_report").TINY,
                                   csv_path, 120.0, 0.02)
    finally:
        many_speed.gather_speed = original


def test_multi_rank_sections_on_3_gloo_processes(pool: Any, tmp_path: Path) -> None:
    path = tmp_path / "three.csv"
    returned = pool(3).run(ranks_on_cpu, str(path), timeout=240)
    rows = _read(path)
    assert len(rows) == len(returned[0]) and rows[0]["section"] == "machine" and rows[0]["ranks"] == "3"
    exactness = _section(rows, "exactness")
    checks = {row["check"] for row in exactness}
    for loss in ("info_nce", "nt_xent", "siglip", "supcon"):
        for mode in ("gather", "ring"):
            assert f"{loss} {mode}: value and gradients (features, scale, bias)" in checks
    assert {"all_gather, sizes given", "all_gather, sizes exchanged"} <= checks
    syncbn = [row for row in exactness if row["check"].startswith("SyncBatchNorm")]
    assert len(syncbn) == 1 and syncbn[0]["batch"] == "21" and syncbn[0]["note"].startswith("shards [8, 0, 13];")
    assert all(float(row["max_error"]) < 1e-12 for row in exactness), exactness
    assert all("scale" in _errors(row["note"]) for row in exactness if "value and gradients" in row["check"])
    bf16 = _section(rows, "bf16 vs float64")
    assert len(bf16) == 4 and all(row["note"].startswith("shards [12, 0, 20];") for row in bf16)
    assert all(_errors(row["note"])["value"] < 1e-5 and float(row["max_error"]) < 2e-2 for row in bf16), bf16
    gather = _section(rows, "gather speed")
    assert [row["check"] for row in gather[-1:]] == ["section failed"]
    assert gather[-1]["note"] == "rank 1: ValueError: injected on rank 1"
    assert len(gather) == 6 and all(float(row["time_ms"]) > 0 for row in gather[:-1])
    assert gather[0]["ratio"] == gather[3]["ratio"] == "1.00"  # each baseline against itself
    losses = _section(rows, "loss speed and memory")  # the sections after the failure still ran
    assert len(losses) == 6 and all(float(row["time_ms"]) > 0 for row in losses), losses
    memory = _section(rows, "per-rank memory")
    assert [(row["check"].split(",")[0], row["ranks"]) for row in memory] == [
        (f"info_nce: ours {mode}", str(ranks)) for mode in ("gather", "ring") for ranks in (1, 2, 3)]
    sweep = _section(rows, "gather vs ring sweep")
    measured = [row for row in sweep if "published" not in row["check"]]
    assert [(row["check"], row["batch"]) for row in measured] == [
        (f"info_nce: ours {mode}", batch) for batch in ("48", "96") for mode in ("gather", "ring")]
    assert all(float(row["time_ms"]) > 0 for row in measured)
    assert sum("Inf-CL (arXiv 2410.17243) Table 1" in row["note"] for row in sweep) == 8


def test_all_gpu_command_entry_on_2_gloo_processes_under_torchrun_without_open_clip(tmp_path: Path) -> None:
    # A package named open_clip that fails to import, first on the path: as if the dev extra were missing.
    (tmp_path / "no_open_clip" / "open_clip").mkdir(parents=True)
    (tmp_path / "no_open_clip" / "open_clip" / "__init__.py").write_text("raise ImportError('not installed here')\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "benchmarks" / "gpu_check.py"), *FAST, "--csv", "two.csv"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(tmp_path / "no_open_clip"), str(ROOT)])}
    result = subprocess.run(command, cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = _read(tmp_path / "two.csv")
    assert rows[0]["section"] == "machine" and rows[0]["ranks"] == "2" and "open_clip not installed" in rows[0]["note"]
    open_clip_rows = [row for row in rows if "open_clip" in row["check"]]
    assert len(open_clip_rows) == 2 and all(row["note"].startswith("skipped: open_clip is not installed")
                                            for row in open_clip_rows)
    assert not [row for row in rows if row["check"] == "section failed"], rows
    assert {row["section"] for row in rows[1:]} == {f"2 ranks: {name}" for name in (
        "exactness", "bf16 vs float64", "gather speed", "loss speed and memory", "per-rank memory",
        "gather vs ring sweep")}
    assert [row for row in rows if "sweep" in row["section"]][0]["note"] == "skipped: needs 3 ranks or more"
    assert result.stdout.count("written to two.csv") == 1  # rank 0 alone reports
