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
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import background
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


LOSSES = ("info_nce", "siglip")


def _section(rows: list[dict[str, str]], name: str, *, start: bool = False) -> list[dict[str, str]]:
    """The rows of the section that ends with ``name`` (``start``: of every section of the 1-rank ``name``)."""
    if start:
        return [row for row in rows if row["section"].startswith(f"1 rank: {name}")]
    return [row for row in rows if row["section"].endswith(name)]


SIGLIP_KERNEL_CUDA = "skipped: siglip-kernel runs on CUDA only (Triton)"
INF_CL_CUDA = "skipped: Inf-CL's flash kernels run on CUDA only (Triton; they assert CUDA tensors)"
INF_CL_MISSING = "skipped: inf-cl is not installed (pip install inf-cl==1.2.1, or its wheel: gpu_day.sh)"


def _specialist(row: dict[str, str]) -> bool:
    return "siglip-kernel" in row["check"] or "Inf-CL" in row["check"]


def _check_conformance(rows: list[dict[str, str]]) -> None:
    """The conformance section on CPU: ours on the 1-rank group against float64, the rest skipped or noted."""
    checks = [row["check"] for row in rows]
    assert checks[0] == "info_nce: ours ring, 1-rank group" and checks[-1] == "not checkable on one GPU", checks
    assert "siglip: ours ring, 1-rank group" in checks
    for row in rows:
        if row["check"].endswith("ours ring, 1-rank group"):
            assert row["dtype"] == "float32" and float(row["max_error"]) < 1e-5, row
        elif "siglip-kernel" in row["check"] or row["check"].startswith("info_nce: Inf-CL cal_flash_loss"):
            assert row["note"] in (SIGLIP_KERNEL_CUDA, INF_CL_CUDA), row
    by_check = dict(zip(checks, rows))
    assert by_check["info_nce: Inf-CL cal_inf_loss, 1-rank group"]["note"] == INF_CL_CUDA
    assert "siglip+: siglip-kernel DistributedSigLIPPlusLoss, 1-rank group, ids" in by_check
    ring = by_check["info_nce: Inf-CL cal_ring_loss, 1-rank group"]["note"]
    # Installed, its ring runs on gloo: the value is checked; its backward's send to its own rank fails there.
    assert ring == INF_CL_MISSING or (ring.startswith("failed: ") and "(in its backward); value only, relative: value"
                                      in ring), ring
    assert "torchrun" in rows[-1]["note"] and "W x scale gradient" in rows[-1]["note"]


def test_without_cuda_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--csv", str(tmp_path / "out.csv")],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=environment,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "no CUDA device" in result.stdout, result.stdout
    assert not (tmp_path / "out.csv").exists()


def _one_rank() -> str:
    """Declare ``python benchmarks/gpu_check.py`` on the CPU, one thread, writing to ``$OUT``: a background
    command (no time budget: the run may get only the CPU time the rest of the suite leaves)."""
    key = "gpu_check one rank"
    environment = {**os.environ, "OUT": str(background.workspace(key) / "out"), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *FAST, "--time-budget", "1e9"]
    return background.command(key, command, cwd=background.workspace(key), env=environment)


ONE_RANK = _one_rank()


@pytest.mark.timeout(960)
@pytest.mark.background(ONE_RANK)
def test_one_rank_sections_end_to_end_on_cpu_with_every_file_under_out() -> None:
    done = background.outcome(ONE_RANK, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    out = background.workspace(ONE_RANK) / "out"
    assert sorted(os.listdir(out)) == ["gpu_check_1cpu.csv", "gpu_check_1cpu.md", "gpu_check_1cpu_summary.txt"]
    path = out / "gpu_check_1cpu.csv"
    rows = _read(path)
    assert list(rows[0]) == list(_module("gpu_check_report").COLUMNS)
    machine = rows[0]
    assert machine["section"] == "machine" and machine["check"].startswith("1 x CPU")
    for fact in (f"torch {torch.__version__}", "CUDA ", "Triton ", "TF32 matmul off", "CONTRASTIVE_DIST_PRODUCTS=",
                 "NVIDIA_TF32_OVERRIDE=", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=",
                 "bf16 route: bfloat16 upcast to float32 before the products", "open_clip ", "siglip-kernel ",
                 "inf-cl ", "UTC"):
        assert fact in machine["note"], machine
    exactness = _section(rows, "exactness", start=True)
    assert {row["section"] for row in exactness} == {f"1 rank: exactness {precision} {loss}"
                                                     for precision in ("bf16", "fp32") for loss in LOSSES}
    # 2 precisions × 2 losses × (open_clip, ours gather, ours ring, both with ids), and in bf16 the specialists:
    # siglip-kernel's four (CUDA only) and Inf-CL's flash loss (CUDA only).
    kernel = [row for row in exactness if _specialist(row)]
    assert [(row["section"], row["check"], row["note"]) for row in kernel] == [
        *(("1 rank: exactness bf16 siglip", f"siglip: siglip-kernel{method}", SIGLIP_KERNEL_CUDA) for method in (
            "", " chunk_size=1024", " DistributedSigLIPLoss ring, W=1", " DistributedSigLIPLoss gather, W=1")),
        ("1 rank: exactness bf16 info_nce", "info_nce: Inf-CL cal_flash_loss, both directions", INF_CL_CUDA)]
    exactness = [row for row in exactness if row not in kernel]
    assert len(exactness) == 20 and all("scale" in _errors(row["note"]) for row in exactness)
    assert len([row for row in exactness if row["check"].endswith(", ids")]) == 8
    assert all("bias" in _errors(row["note"]) for row in exactness if row["check"].startswith("siglip"))
    for row in exactness:
        errors = _errors(row["note"])
        assert float(row["max_error"]) == pytest.approx(max(errors.values()), rel=0.1), row  # the note has 2 digits
        if row["dtype"] == "float32":
            assert float(row["max_error"]) < 1e-5 and row["compute"].startswith(("float32 products", "IEEE")), row
        else:  # bf16 features: gradients come back in bf16, whose rounding is 2**-9 relative
            assert float(row["max_error"]) < 2e-2, row
            if "ours" in row["check"]:  # our core's float32 logits keep the value to fp32 precision; its route
                assert errors["value"] < 1e-5, row
                assert row["compute"] == "bfloat16 upcast to float32 before the products; fp32 logits and state", row
            else:
                assert row["compute"] == "bf16 products, bf16 logits (autocast)", row
    speed = [row for row in _section(rows, "speed", start=True) if not _specialist(row)]
    # 2 precisions × 2 losses × (open_clip, ours gather with 2 chunk sizes, ours ring) × 2 batches.
    assert len(speed) == 32
    assert {row["check"].split(": ")[1] for row in speed} == {"open_clip", "ours gather", "ours ring"}
    assert all(float(row["time_ms"]) > 0 and int(row["repeats"]) >= 3 and row["peak_mib"] == "" for row in speed)
    assert all(float(row["ratio"]) > 0 for row in speed if "ours" in row["check"])
    # Each specialist: one row saying why it was not run.
    assert [row["note"] for row in _section(rows, "speed", start=True) if _specialist(row)] == [
        SIGLIP_KERNEL_CUDA] * 4 + [INF_CL_CUDA]
    _check_conformance(_section(rows, "conformance"))
    anchor = _section(rows, "anchor")
    assert [row["note"].split(":")[0] for row in anchor[:2]] == ["no ratio", "no ratio"]
    assert "siglip-kernel" in anchor[0]["check"] and "Inf-CL" in anchor[1]["check"]
    assert [row["time_ms"] for row in anchor[2:]] == ["48.80", "54.30"]
    assert all("siglip-kernel 0.1.2 README" in row["note"] and row["batch"] == "65536" for row in anchor[2:])
    printed = done.stdout
    assert printed.count("\n1 rank: ") == len(rows) - 1 and f"written to {path}" in printed
    summary = printed[printed.index("== gpu_check summary =="): printed.index("written to")]
    assert len(summary) < _module("gpu_check_summary").LIMIT and "siglip: ours gather bfloat16 @ 48" in summary
    assert (out / "gpu_check_1cpu_summary.txt").read_text() == summary
    # gpu_day.sh prints the summary again from the CSV, last: the same lines.
    again = _module("gpu_check_summary").summary(_module("gpu_check_summary").rows_from_csv(str(path)),
                                                  anchor_batch=65536)
    assert "\n".join(again) + "\n" == summary


def test_a_failing_section_costs_only_its_rows_and_earlier_rows_are_already_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    path, seen_on_disk = tmp_path / "one.csv", []
    one = _module("gpu_check_one")
    original = one.speed

    def failing_speed(device: Any, sizes: Any, precision: Any, loss: str, *args: Any) -> Iterator[dict[str, Any]]:
        if (precision.name, loss) != ("bf16", "siglip"):
            yield from original(device, sizes, precision, loss, *args)
            return
        seen_on_disk.extend(_read(path))  # what a crash at this moment would leave
        yield {"check": "measured before the failure"}
        raise RuntimeError("injected failure")

    monkeypatch.setattr(one, "speed", failing_speed)
    assert _module("gpu_check").main([*FAST, "--csv", str(path), "--out", str(tmp_path)]) == 1
    rows = _read(path)
    assert seen_on_disk[0]["section"] == "machine"
    assert all(row["section"].startswith("1 rank: exactness") for row in seen_on_disk[1:])
    assert len(seen_on_disk) == 1 + 20 + 5  # and the specialists' 5 exactness rows
    assert rows[: len(seen_on_disk)] == seen_on_disk
    failed = _section(rows, "speed bf16 siglip")
    assert [row["check"] for row in failed] == ["measured before the failure", "section failed"]
    assert failed[1]["note"] == "rank 0: RuntimeError: injected failure"
    for other in ("speed bf16 info_nce", "speed fp32 siglip", "speed fp32 info_nce"):  # the next sections still ran
        measured = [row for row in _section(rows, other) if not _specialist(row)]
        assert len(measured) == 8 and all(row["time_ms"] for row in measured)
    assert [row["note"] for row in _section(rows, "speed bf16 info_nce") if _specialist(row)] == [INF_CL_CUDA]
    assert len(_section(rows, "anchor")) == 4 and rows[-1]["check"] == "not checkable on one GPU"


def test_a_method_that_raises_costs_its_own_rows_and_an_allocator_error_reads_as_out_of_memory(
        monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    one, report, losses = _module("gpu_check_one"), _module("gpu_check_report"), _module("gpu_check_losses")
    original, released = one.ours, []

    def ours(loss: str, *, chunk_size: int | None, communication: str = "gather") -> Any:
        if communication == "gather" and chunk_size == 16:  # as after open_clip filled the memory
            return lambda x: (_ for _ in ()).throw(RuntimeError(
                "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
        if communication == "ring":
            return lambda x: (_ for _ in ()).throw(ValueError("injected"))
        return original(loss, chunk_size=chunk_size, communication=communication)

    monkeypatch.setattr(one, "ours", ours)
    monkeypatch.setattr(one, "release", lambda device: released.append(device))
    rows = list(one.speed(torch.device("cpu"), report.TINY, losses.PRECISIONS["fp32"], "info_nce",
                          report.Deadline(120.0), 0.02))
    by_method: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        by_method.setdefault((row["check"], str(row["chunk_size"])), []).append(row)
    assert [row["note"] for row in by_method[("info_nce: ours gather", "16")]] == [
        "out of memory (larger batches not tried)"]
    assert [row["note"] for row in by_method[("info_nce: ours ring", "8")]] == [
        "failed: ValueError: injected (larger batches not tried)"]
    for method in (("info_nce: open_clip", "None"), ("info_nce: ours gather", "8")):  # unaffected: every batch
        assert [row["batch"] for row in by_method[method]] == [32, 64] and all(
            row["time_ms"] > 0 for row in by_method[method])
    assert len(released) >= 4  # after each method (and each failure): the next starts from an empty cache


@pytest.mark.parametrize(("error", "allocator"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 GiB"), True),
    (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("out of memory"), False),
])
def test_allocator_errors_read_as_out_of_memory(error: BaseException, allocator: bool) -> None:
    assert _module("gpu_check_report").out_of_memory(error) is allocator


def test_per_rank_memory_is_normalised_to_two_ranks_where_the_ring_buffers_exist() -> None:
    over_two_ranks = _module("gpu_check_many_speed").over_two_ranks
    # One rank has no ring buffers: against its peak a flat ring would read as 4× growth.
    assert over_two_ranks({1: 10.0, 2: 40.0, 4: 40.0, 8: 42.0}) == {1: 0.25, 2: 1.0, 4: 1.0, 8: 1.05}
    assert over_two_ranks({1: 10.0}) == {1: 1.0}
    assert over_two_ranks({1: float("nan"), 2: float("nan")}) == {1: None, 2: None}
    assert over_two_ranks({1: 10.0, 2: None}) == {1: None, 2: None}


def test_past_the_time_budget_every_measurement_is_skipped_with_a_row_saying_so() -> None:
    report, losses = _module("gpu_check_report"), _module("gpu_check_losses")
    rows = list(_module("gpu_check_one").speed(torch.device("cpu"), report.TINY, losses.PRECISIONS["fp32"],
                                               "info_nce", report.Deadline(0.0), 0.02))
    assert len(rows) == 8 and all(row["note"] == "skipped: past the time budget (--time-budget)" for row in rows)


def test_conformance_runs_a_ring_on_a_1_rank_group_and_divides_its_scale_gradient_by_ours(
        monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    """With a stand-in for Inf-CL's ring (its documented call: one direction's mean cross-entropy, the scale times
    q only), the section runs it on its 1-rank gloo group, both directions, and finds our scale gradient."""

    def cal_ring_loss(q: torch.Tensor, k: torch.Tensor, labels: Any = None, scale: Any = None,
                      head_dim: int = 256) -> torch.Tensor:
        assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
        assert q.shape[1] % head_dim == 0
        return torch.nn.functional.cross_entropy((scale * q).float() @ k.float().T, torch.arange(len(q)))

    monkeypatch.setitem(sys.modules, "inf_cl", types.SimpleNamespace(cal_ring_loss=cal_ring_loss))
    rows = {row["check"]: row for row in _module("gpu_check_conformance").conformance(
        torch.device("cpu"), _module("gpu_check_report").TINY)}
    assert not torch.distributed.is_initialized()  # the group lives for the section only
    ring = rows["info_nce: Inf-CL cal_ring_loss, 1-rank group"]
    assert ring["max_error"] < 1e-5 and set(_errors(ring["note"])) == {"value", "images", "texts", "scale"}, ring
    scale = rows["info_nce: Inf-CL cal_ring_loss, 1-rank group: scale gradient / ours"]
    assert scale["ratio"] == pytest.approx(1.0, abs=1e-5) and scale["max_error"] < 1e-5, scale
    assert "not checkable on one GPU" in scale["note"]
    assert rows["info_nce: Inf-CL cal_inf_loss, 1-rank group"]["note"] == INF_CL_CUDA


def test_ring_model_prints_its_table_and_a_faster_link_never_predicts_a_slower_step(tmp_path: Path) -> None:
    model = _module("ring_model")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ring_model.py")], capture_output=True,
                            text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(row[0], row[1]) for row in rows[1:]] == [("| 1 GPU", "even")] + [
        (f"| {name}", pattern) for name in ("4 GPUs, 1 node", "8 GPUs, 1 node", "8 GPUs, 2 nodes")
        for pattern in model.PATTERNS]
    assert {(row[0], row[-1]) for row in rows if row[-1] != "- |"} == {
        ("| setting", "published ms |"), ("| 1 GPU", "46.9 |"), ("| 4 GPUs, 1 node", "13.1 |"),
        ("| 8 GPUs, 2 nodes", "10.1 |")}
    assert "a model, not a measurement" in result.stdout and "ASSUMPTION" in result.stdout
    # Block times from a gpu_check CSV: the fastest bf16 speed row of the method at each batch.
    path = tmp_path / "one.csv"
    path.write_text("section,check,dtype,batch,time_ms\n1 rank: speed bf16 siglip,siglip: siglip-kernel,bfloat16,"
                    "16384,3.5\n1 rank: speed bf16 siglip,siglip: siglip-kernel,bfloat16,16384,3.0\n"
                    "1 rank: anchor,siglip: siglip-kernel,bfloat16,65536,1.0\n")
    blocks = model.block_times_from_csv(str(path), "siglip: siglip-kernel")
    assert blocks.ms_by_batch == {16384: 3.0} and blocks.block_ms(8192, 8192) == pytest.approx(0.75)
    assert "| 4 GPUs, 1 node | even | 16,384 | 25.2 | 12.0 |" in model.main(["--csv", str(path)])
    for shards in ([16384] * 4, model.shards(65536, 4, "one rank empty"), model.shards(65536, 8, "one rank +25%")):
        for nodes, backward_share in ((1, 0.0), (2, 0.0), (2, 0.6)):
            slow, fast = (model.predict(shards, dim=768, nodes=nodes, blocks=blocks, backward_share=backward_share,
                                        links=model.Links(nvlink_gbs=gbs, inter_node_gbs=gbs / 10))
                          for gbs in (50, 900))
            assert fast.serial_ms < slow.serial_ms and fast.overlapped_ms <= slow.overlapped_ms, (shards, nodes)
            assert fast.overlapped_ms <= fast.serial_ms and slow.overlapped_ms <= slow.serial_ms
    even, empty = (model.predict(model.shards(65536, 4, pattern), dim=768, nodes=1, blocks=blocks, links=model.Links())
                   for pattern in ("even", "one rank empty"))
    assert empty.blocks_ms > even.blocks_ms  # the fullest rank's rows set every step


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
                                   csv_path, 3600.0, 0.02)  # no budget skips, however loaded the machine
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
    assert all(row["ratio"] == "" for row in memory)  # no memory counters on CPU: no ratio rather than NaN
    sweep = _section(rows, "gather vs ring sweep")
    measured = [row for row in sweep if "published" not in row["check"]]
    assert [(row["check"], row["batch"]) for row in measured] == [
        (f"info_nce: ours {mode}", batch) for batch in ("48", "96") for mode in ("gather", "ring")]
    assert all(float(row["time_ms"]) > 0 for row in measured)
    assert sum("Inf-CL (arXiv 2410.17243) Table 1" in row["note"] for row in sweep) == 8


def _torchrun_without_open_clip() -> str:
    """Declare the all-GPU command's entry under ``torchrun`` on 2 gloo processes, a background command."""
    key = "gpu_check under torchrun"
    where = background.workspace(key)

    def no_open_clip() -> None:  # a package named open_clip that fails to import, first on the path
        (where / "no_open_clip" / "open_clip").mkdir(parents=True, exist_ok=True)
        (where / "no_open_clip" / "open_clip" / "__init__.py").write_text("raise ImportError('not installed here')\n")

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(ROOT / "benchmarks" / "gpu_check.py"), *FAST, "--csv", "two.csv",
               "--time-budget", "1e9"]  # at idle priority a busy suite may stretch it: skip nothing
    environment = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(where / "no_open_clip"), str(ROOT)])}
    return background.command(key, command, cwd=where, env=environment, before=no_open_clip)


TORCHRUN = _torchrun_without_open_clip()


@pytest.mark.timeout(960)
@pytest.mark.background(TORCHRUN)
def test_all_gpu_command_entry_on_2_gloo_processes_under_torchrun_without_open_clip() -> None:
    # As if the dev extra were missing: open_clip does not import.
    result = background.outcome(TORCHRUN, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = _read(background.workspace(TORCHRUN) / "two.csv")
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


WHEELS = ROOT / ".whl"  # git-ignored: filled by `bash benchmarks/gpu_day.sh --fetch-wheels`, never committed


def _bare_environment(**extra: str) -> dict[str, str]:
    """A process environment as on a bare machine: no PYTHONPATH, no GPU, and nothing about this checkout."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "OUT")}
    return {**environment, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, **extra}


def _gpu_day() -> str:
    """Declare ``bash benchmarks/gpu_day.sh`` run from elsewhere, as on a machine without CUDA (the wheels if
    any): a background command, whose outcome two tests read."""
    key = "gpu_day"
    where = background.workspace(key)
    wheels = WHEELS if any(WHEELS.glob("*.whl")) else where / "no_wheels"
    environment = _bare_environment(OUT=str(where / "out"), GPU_DAY_WHEELS=str(wheels))
    return background.command(key, ["bash", str(ROOT / "benchmarks" / "gpu_day.sh")], cwd=where, env=environment)


GPU_DAY = _gpu_day()


@pytest.fixture(scope="module")
def gpu_day() -> tuple[subprocess.CompletedProcess[str], Path]:
    """The outcome of ``gpu_day.sh`` and the folder it wrote (its ``$OUT``)."""
    return background.outcome(GPU_DAY, timeout=900), background.workspace(GPU_DAY) / "out"


@pytest.mark.timeout(960)
@pytest.mark.background(GPU_DAY)
def test_gpu_day_without_cuda_runs_to_its_end_on_the_checkout_itself_and_exits_0(
        gpu_day: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    result, out = gpu_day
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "gpu_day: no CUDA device on this machine" in result.stdout
    assert lines[-1].startswith("== gpu_day: done in ") and "(no CUDA: nothing measured)" in lines[-1]
    # The package comes from this checkout (PYTHONPATH set by the script), not from an install.
    assert f"import contrastive_dist: ok 0.1.0 ({ROOT / 'contrastive_dist' / '__init__.py'})" in lines
    for fact in ("torch ", "TF32: matmul", "CONTRASTIVE_DIST_PRODUCTS=", "NVIDIA_TF32_OVERRIDE=",
                 "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=", "product route on cpu: bf16 bfloat16 upcast"):
        assert fact in result.stdout, fact
    assert sorted(os.listdir(out)) == ["gpu_day.log", "machine.txt"]
    assert (out / "gpu_day.log").read_text() == result.stdout  # everything is in the log that comes back


@pytest.mark.background(GPU_DAY)
def test_gpu_day_installs_the_wheels_into_a_temporary_target_and_imports_them(
        gpu_day: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    if not any(WHEELS.glob("*.whl")):
        pytest.skip(f"no wheels in {WHEELS}: `bash benchmarks/gpu_day.sh --fetch-wheels` fills it")
    result, _ = gpu_day
    site = re.search(r"^wheels: installed into (\S+): ", result.stdout, re.MULTILINE)
    assert site is not None, result.stdout
    assert re.search(rf"^import open_clip: ok \S+ \({re.escape(site[1])}/open_clip/__init__.py\)$", result.stdout,
                     re.MULTILINE), result.stdout
    assert re.search(r"^import open_clip.loss: ok", result.stdout, re.MULTILINE)
    # siglip-kernel asks the driver for the GPU when imported: without CUDA it is found in the target and raises.
    kernel = re.search(r"^import siglip_kernel: (.*)$", result.stdout, re.MULTILINE)
    assert kernel is not None and (kernel[1].startswith("ok") or kernel[1].startswith(
        f"FAILED (installed at {site[1]}/siglip_kernel/__init__.py) RuntimeError")), kernel
    if any(WHEELS.glob("inf_cl-*.whl")):  # pure Python: it imports wherever Triton does
        assert re.search(rf"^import inf_cl: ok \S* ?\({re.escape(site[1])}/inf_cl/__init__.py\)$", result.stdout,
                         re.MULTILINE), result.stdout
    assert not Path(site[1]).exists()  # the temporary target is removed at the end


def test_gpu_check_help_on_a_bare_checkout(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env=_bare_environment())
    assert result.returncode == 0 and result.stdout.startswith("usage: gpu_check.py"), result.stderr
    assert "--out OUT" in result.stdout and "$OUT" in result.stdout


@pytest.mark.parametrize("loss", ["info_nce", "siglip", "nt_xent", "supcon"])
def test_gpu_profile_on_cpu_at_a_tiny_size(loss: str, one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The profile's tool runs each loss it offers (the default call, both modes) and prints its step and tables."""
    profile = _module("gpu_profile")
    assert set(_module("gpu_check_losses").PROFILED) == {"info_nce", "siglip", "nt_xent", "supcon"}
    for communication in ("gather", "ring"):
        text = profile.main(["--device", "cpu", "--loss", loss, "--batch", "64", "--dim", "16", "--chunk-size",
                             "default", "--communication", communication, "--steps", "1", "--rows", "3"])
        assert re.match(rf"{loss} {communication}, bf16, batch 64, D 16, chunk_size None, cpu: \d+\.\d\d ms a step",
                        text), text
        assert "Self CPU" in text and "Self CUDA" not in text
    assert capsys.readouterr().out.count(" ms a step") == 2


def test_gpu_tiles_launches_every_kernel_and_tile_in_the_interpreter_without_cuda() -> None:
    """The tile sweep on a CPU: each kernel of the package's tile table, at every tile swept, launches."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tiles.py"), "--transposed"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("P 64 x 1024 (P.T), cpu: copy P into bf16 G"), lines[0]
    # Not imported here: without CUDA the module turns Triton's interpreter on for its whole process.
    tiles = [line for line in lines if line.startswith("sigmoid rows ")]
    launched = [line for line in lines if line.endswith(": nan ms")]  # run once, timed only on CUDA
    kernels = {line.split(" rows ")[0] for line in lines if " rows " in line}
    assert {"sigmoid", "state", "grad", "block", "pairs", "pair_grad"} <= kernels, kernels
    assert len(tiles) > 10 and len(launched) == len(tiles) * len(kernels), result.stdout
