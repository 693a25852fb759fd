"""``recipes/clip.py --data webdataset:PATH`` as a user runs it: real tar shards, real Lightning DDP on CPU.

The shards are written here with webdataset. Two processes read uneven shards (rank 0 three, rank 1
two, so rank 1 runs out first and trains on an empty batch); one process reads shards laid out in
the order of the two-process run's global batches (rank 0's share, then rank 1's, step by step), so
it is fed the very same global batches, which its own record confirms. Both train with plain SGD.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_recipes import TINY_CLIP, run, weights

wds = pytest.importorskip("webdataset")

SHARD, SHARDS, BATCH = 4, 5, 4  # 5 shards of 4 pairs; 2 ranks × 4 per step: global batches of 8, 8, 4


def write(directory: Path, groups: list[list[int]], dataset, *, key_offset: int = 0) -> None:
    """One shard per group of sample ids: ``png`` image and ``txt`` caption under the id as key."""
    directory.mkdir()
    for number, ids in enumerate(groups):
        with wds.TarWriter(str(directory / f"part-{number:06d}.tar")) as sink:
            for index in ids:
                image, text = dataset[index][:2]
                sink.write({"__key__": f"{index + key_offset:09d}", "png": image.permute(1, 2, 0).numpy(),
                            "txt": text})


def recorded(directory: Path, rank: int) -> list[tuple[int, int, list[int]]]:
    """``(epoch, step, ids)`` of each training step of ``rank``, as tests/recipe_hooks.py wrote them."""
    steps = []
    for line in (directory / f"rank{rank}.txt").read_text().splitlines():
        epoch, step, *ids = map(int, line.split())
        steps.append((epoch, step, ids))
    return steps


@pytest.mark.timeout(400)
def test_two_processes_on_uneven_shards_train_to_the_weights_of_one_fed_the_same_global_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from contrastive_dist.shapes import ShapesDataset

    train = ShapesDataset("train", size=SHARD * SHARDS, image_size=32, seed=5)
    write(tmp_path / "shards", [list(range(start, start + SHARD)) for start in range(0, len(train), SHARD)], train)
    write(tmp_path / "held_out", [list(range(8))], ShapesDataset("val", size=8, image_size=32, seed=5),
          key_offset=1000)
    # 32-pixel images keep a 2×2 last feature map, so BatchNorm has values per channel on a 1-row rank.
    common = [*TINY_CLIP, "--image-size", "32", "--val-data", str(tmp_path / "held_out"), "--fixed-shard-order",
              "--deterministic-data", "--optimizer", "sgd", "--lr", "0.5", "--max-steps", "6", "--val-every", "100",
              "--no-plots"]
    (tmp_path / "two_record").mkdir()
    run("clip.py", *common, "--data", f"webdataset:{tmp_path / 'shards'}", "--devices", "2", "--batch-size",
        str(BATCH), "--output-dir", "two", cwd=tmp_path, env={"RECIPE_RECORD_SAMPLES": str(tmp_path / "two_record")},
        hooks=True, timeout=300)
    ranks = [recorded(tmp_path / "two_record", rank) for rank in (0, 1)]

    # Equal step counts, rank 1 out first, every sample exactly once per epoch, over 2 epochs.
    for rank_steps in ranks:
        assert [(epoch, step) for epoch, step, _ in rank_steps] == [(e, s) for e in (0, 1) for s in range(3)]
    assert [len(ids) for _, _, ids in ranks[0]] == [4, 4, 4] * 2  # shards 0, 2, 4
    assert [len(ids) for _, _, ids in ranks[1]] == [4, 4, 0] * 2  # shards 1, 3, then an empty batch
    global_batches = [ranks[0][step][2] + ranks[1][step][2] for step in range(6)]
    for epoch in (0, 1):
        assert sorted(sum(global_batches[3 * epoch : 3 * epoch + 3], [])) == list(range(len(train)))
    assert global_batches[:3] == global_batches[3:]  # --fixed-shard-order: the same stream each epoch

    # One process, 8 a step, over shards holding the global batches in order: the same global batches.
    write(tmp_path / "one_shards", global_batches[:3], train)
    (tmp_path / "one_record").mkdir()
    run("clip.py", *common, "--data", f"webdataset:{tmp_path / 'one_shards'}", "--devices", "1", "--batch-size",
        str(2 * BATCH), "--output-dir", "one", cwd=tmp_path,
        env={"RECIPE_RECORD_SAMPLES": str(tmp_path / "one_record")}, hooks=True)
    assert [ids for _, _, ids in recorded(tmp_path / "one_record", 0)] == global_batches

    two, one = weights(tmp_path / "two/checkpoints/last.ckpt"), weights(tmp_path / "one/checkpoints/last.ckpt")
    for key, value in one.items():
        if value.is_floating_point():
            # float32 sums in another order on 2 processes: measured up to 5e-6 relative after 6 steps at lr 0.5
            # (batch-norm running means); the bound of the map-style recipe test.
            scale = value.abs().max().clamp_min(1e-6)
            assert (two[key] - value).abs().max() / scale <= 5e-5, key
    assert float(one["logit_scale"]) != pytest.approx(float(torch.tensor(1 / 0.07).log()), abs=1e-6)  # it trained


def test_write_shards_layout_and_help(tmp_path: Path) -> None:
    usage = run("clip.py", "--help", cwd=tmp_path).stdout
    assert "webdataset:PATH" in usage and "txt)" in usage and "--write-shards" in usage
    result = run("clip.py", "--write-shards", "out", "--train-size", "10", "--val-size", "3", "--shard-size", "4",
                 "--image-size", "16", cwd=tmp_path)
    assert "--data webdataset:out" in result.stdout
    paths = sorted((tmp_path / "out").glob("*.tar"))
    assert [path.name for path in paths] == [f"shapes-{number:06d}.tar" for number in range(4)]
    samples = [list(wds.WebDataset(str(path), shardshuffle=False).decode("torchrgb8")) for path in paths]
    assert [len(shard) for shard in samples] == [4, 4, 2, 3]  # training shards of 4, then the held-out split
    keys = [int(sample["__key__"]) for shard in samples for sample in shard]
    assert keys == list(range(13))
    first = samples[0][0]
    assert first["png"].shape == (3, 16, 16) and first["png"].dtype == torch.uint8 and first["txt"].startswith("a ")


def test_bad_webdataset_input_ends_in_one_line(tmp_path: Path) -> None:
    run("clip.py", "--write-shards", "one", "--train-size", "3", "--val-size", "2", "--shard-size", "8",
        "--image-size", "16", cwd=tmp_path)
    (tmp_path / "one/shapes-000000.tar").unlink()  # left: the held-out shard only
    cases = [(["--data", "webdataset:nowhere"], "1 missing: nowhere"),
             (["--data", "webdataset:shards/{000..002}.tar"], "3 missing"),
             (["--data", "webdataset:one"], "held out for evaluation")]
    for flags, cause in cases:
        result = run("clip.py", *flags, cwd=tmp_path, check=False, timeout=120)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and cause in line, line


@pytest.mark.timeout(500)
def test_resume_mid_epoch_on_three_processes_sees_every_sample_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Shards of 1, 9, 5 and 7 pairs. Two processes × 2 DataLoader workers stop after 2 steps (Lightning saves
    # rank 0's checkpoint); three processes without workers resume mid-epoch and finish it.
    from contrastive_dist.shapes import ShapesDataset

    train = ShapesDataset("train", size=22, image_size=32, seed=5)
    write(tmp_path / "shards", [[0], list(range(1, 10)), list(range(10, 15)), list(range(15, 22))], train)
    write(tmp_path / "held_out", [list(range(4))], ShapesDataset("val", size=4, image_size=32, seed=5),
          key_offset=1000)
    (tmp_path / "record").mkdir()
    common = [*TINY_CLIP, "--image-size", "32", "--data", f"webdataset:{tmp_path / 'shards'}", "--val-data",
              str(tmp_path / "held_out"), "--val-size", "4", "--val-every", "100", "--no-plots", "--batch-size", "2",
              "--max-epochs", "1", "--output-dir", "out"]
    env = {"RECIPE_RECORD_SAMPLES": str(tmp_path / "record")}
    run("clip.py", *common, "--devices", "2", "--num-workers", "2", "--max-steps", "2", cwd=tmp_path, env=env,
        hooks=True, timeout=300)
    result = run("clip.py", *common, "--devices", "3", "--num-workers", "0", "--max-steps", "100", "--resume",
                 "out/checkpoints/last.ckpt", cwd=tmp_path, env=env, hooks=True, timeout=300)
    assert ("resumed on 3 process(es) × 2 with 0 worker(s) from 2 × 2 with 2 (another global batch)"
            in result.stdout), result.stdout[-2000:]
    ranks = [recorded(tmp_path / "record", rank) for rank in range(3)]
    assert all(epoch == 0 for rank_steps in ranks for epoch, _, _ in rank_steps)
    first = [[step for _, step, _ in rank_steps if step < 2] for rank_steps in ranks]
    assert first == [[0, 1], [0, 1], []]
    resumed = [[step for _, step, _ in rank_steps if step >= 2] for rank_steps in ranks]
    assert resumed[0] and resumed[0][0] == 2 and resumed[0] == resumed[1] == resumed[2]  # equal steps, numbered on
    seen = sorted(sample for rank_steps in ranks for _, _, ids in rank_steps for sample in ids)
    assert seen == list(range(22))  # every sample exactly once over the epoch
