"""contrastive_dist.lightning's run folders, small-batch warning, loss curve and CSV pairs, against plain references."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from contrastive_dist.lightning.image_text import caption_id, csv_rows
from contrastive_dist.lightning.report import loss_curve
from contrastive_dist.lightning.runs import RUN_FOLDER_VARIABLE, check_global_batch, run_folder


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (RUN_FOLDER_VARIABLE, "LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)


def finished_run(folder: Path) -> Path:
    (folder / "checkpoints").mkdir(parents=True)
    checkpoint = folder / "checkpoints" / "last.ckpt"
    checkpoint.write_bytes(b"weights")
    return checkpoint


def test_new_runs_get_new_folders_and_never_touch_old_ones(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    first, checkpoint = run_folder(root)
    assert first == root / "version_0" and first.is_dir() and checkpoint is None
    finished_run(first)
    (root / "version_7").mkdir()  # numbering continues above the highest, whatever the gaps
    (root / "notes").mkdir()
    assert run_folder(root)[0] == root / "version_8"
    assert (first / "checkpoints" / "last.ckpt").read_bytes() == b"weights"


def test_an_output_dir_that_holds_a_run_is_refused_unless_overwrite(tmp_path: Path) -> None:
    folder = tmp_path / "mine"
    assert run_folder(tmp_path, output_dir=folder)[0] == folder  # new: fine
    assert run_folder(tmp_path, output_dir=folder)[0] == folder  # still empty: fine
    finished_run(folder)
    with pytest.raises(ValueError, match=r"holds a run already.*--resume .*mine.*--overwrite"):
        run_folder(tmp_path, output_dir=folder)
    assert run_folder(tmp_path, output_dir=folder, overwrite=True)[0] == folder
    assert folder.is_dir() and not any(folder.iterdir())  # emptied: no old logs join the new run's curves


def test_resume_names_a_run_folder_or_a_checkpoint_and_continues_in_its_folder(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "version_0"
    checkpoint = finished_run(run)
    assert run_folder(tmp_path / "runs", resume=run) == (run, checkpoint)
    assert run_folder(tmp_path / "runs", resume=checkpoint) == (run, checkpoint)
    elsewhere = tmp_path / "elsewhere"
    assert run_folder(tmp_path / "runs", resume=run, output_dir=elsewhere) == (elsewhere, checkpoint)
    assert (checkpoint.read_bytes(), sorted(p.name for p in (tmp_path / "runs").iterdir())) == (b"weights",
                                                                                                ["version_0"])
    for bad in (tmp_path / "nowhere", tmp_path / "runs"):  # missing; a folder without checkpoints/last.ckpt
        with pytest.raises(ValueError, match="expected a run folder holding checkpoints/last.ckpt"):
            run_folder(tmp_path / "runs", resume=bad)


def test_a_checkpoint_name_without_subfolders_resumes_in_the_folder_that_holds_it(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "version_0"  # a plain PyTorch loop's run: <folder>/checkpoint.pt
    run.mkdir(parents=True)
    checkpoint = run / "checkpoint.pt"
    checkpoint.write_bytes(b"weights")
    for resume in (run, checkpoint):
        assert run_folder(tmp_path / "runs", resume=resume, checkpoint_name="checkpoint.pt") == (run, checkpoint)
    assert run_folder(tmp_path / "runs", checkpoint_name="checkpoint.pt")[0] == tmp_path / "runs" / "version_1"
    with pytest.raises(ValueError, match="expected a run folder holding checkpoint.pt"):
        run_folder(tmp_path / "runs", resume=tmp_path / "runs" / "version_1", checkpoint_name="checkpoint.pt")
    with pytest.raises(ValueError, match="holds a run already"):
        run_folder(tmp_path / "runs", output_dir=run, checkpoint_name="checkpoint.pt")


def test_rank_processes_take_the_folder_their_launcher_chose(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chosen, _ = run_folder(tmp_path)
    finished_run(chosen)  # the launcher's run has started writing
    monkeypatch.setenv("LOCAL_RANK", "1")  # as Lightning's ddp launcher starts rank 1
    assert run_folder(tmp_path)[0] == chosen
    monkeypatch.delenv(RUN_FOLDER_VARIABLE)
    monkeypatch.setenv("RANK", "1")  # torchrun: every process chooses, only global rank 0 creates
    folder, _ = run_folder(tmp_path)
    assert folder == tmp_path / "version_1" and not folder.exists()


@pytest.mark.parametrize(("batch", "negatives", "warned"), [(3, 2, True), (16, 15, True), (17, 16, False),
                                                            (9, 16, False)])
def test_small_global_batch_warns_with_what_to_change(batch: int, negatives: int, warned: bool) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        message = check_global_batch(batch, negatives=negatives, advice="raise --batch-size")
    assert (message is not None) == warned == (len(caught) == 1)
    if warned:
        assert str(caught[0].message) == message
        assert f"global batch of {batch} gives each pair {negatives} negatives, fewer than 16" in message
        assert message.endswith("; raise --batch-size")


def test_loss_curve_weights_each_step_by_its_rows_so_a_short_batch_is_no_event() -> None:
    # Steps of 16 rows at loss 1.0, the last of each epoch of 2 rows at loss 0.01 (steps 4 and 9).
    rows = [{"step": float(step), "train/loss": 0.01 if step % 5 == 4 else 1.0,
             "train/samples": 2.0 if step % 5 == 4 else 16.0} for step in range(10)]
    rows.insert(3, {"step": 2.0, "val/image_to_text_r1": 0.5})  # other metrics' rows are skipped
    curve = loss_curve(rows, interval=5)
    expected = (4 * 16 * 1.0 + 2 * 0.01) / (4 * 16 + 2)
    assert curve == [(5.0, pytest.approx(expected, abs=1e-15)), (10.0, pytest.approx(expected, abs=1e-15))]
    assert min(value for _, value in loss_curve(rows, interval=1)) == pytest.approx(0.01)  # per step: the dip
    assert loss_curve([{"step": 0.0, "train/loss": 2.0}], interval=10) == [(1.0, 2.0)]  # no rows logged: weight 1


def test_csv_rows_take_the_id_column_or_hash_the_caption(tmp_path: Path) -> None:
    table = tmp_path / "pairs.tsv"
    table.write_text("filepath\ttitle\tid\na.png\tA cat.\t7\nb.png\ta cat\t7\nc.png\ta dog\tdog-12\n")
    rows, has_ids = csv_rows(table)
    assert has_ids and rows == [("a.png", "A cat.", 7), ("b.png", "a cat", 7), ("c.png", "a dog", caption_id("dog-12"))]
    plain = tmp_path / "plain.csv"
    plain.write_text("path,text\na.png,A cat.\nb.png,a cat\n")
    rows, has_ids = csv_rows(plain, image_column="path", caption_column="text")
    assert not has_ids and rows[0][2] == rows[1][2] == caption_id("a cat")  # case and punctuation aside
    with pytest.raises(ValueError, match=r"expected columns \('filepath', 'title'\).*--csv-image-column"):
        csv_rows(plain)
    assert 0 <= caption_id("x") < 2**63  # an int64 for ids=
