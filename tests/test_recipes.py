"""The recipes as a user runs them: real multi-process Lightning DDP on CPU, tiny settings."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked_runs import forked_runs, run_command

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
HOOKS = Path(__file__).resolve().parent / "recipe_hooks.py"
TINY_CLIP = ["--image-size", "16", "--width", "4", "--text-width", "16", "--embed-dim", "16",
             "--context-length", "40", "--accelerator", "cpu"]
TINY_SIMCLR = ["--image-size", "16", "--width", "4", "--hidden", "16", "--out", "8", "--accelerator", "cpu"]


def run(recipe: str, *args: str, cwd: Path, env: dict[str, str] | None = None, timeout: int = 150,
        check: bool = True, hooks: bool = False, strategy: str = "ddp_fork") -> subprocess.CompletedProcess[str]:
    """``python recipes/<recipe> args``, output redirected as to a log file; ``hooks``: via tests/recipe_hooks.py.

    ``strategy``: the ranks forked from the command's process (``ddp_fork``), itself a fork of a process
    that imported torch and Lightning once (tests/forked_runs.py), unless a test asks for the users'
    default, ``ddp``: then the command and each rank start as commands of their own, each importing
    torch and Lightning (~5 s here).
    """
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [str(HOOKS), recipe.removesuffix(".py")] if hooks else [str(RECIPES / recipe)]
    if strategy == "ddp" or "--help" in args:
        result = run_command([sys.executable, *command, *args], cwd=cwd, env=environment, timeout=timeout)
    else:
        result = forked_runs().script([*command, *args, "--strategy", strategy], cwd=cwd, env=environment,
                                      timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"exit code {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def metrics(output_dir: Path, version: int = 0) -> list[dict[str, str]]:
    with open(output_dir / f"logs/version_{version}/metrics.csv") as file:
        return list(csv.DictReader(file))


def check_summary(result: subprocess.CompletedProcess[str]) -> str:
    """The end-of-run summary: present, free of NaN, and no progress bar in redirected output."""
    summary = result.stdout[result.stdout.index("== "):]
    assert "chance" in summary and "done in" in summary and "nan" not in summary.lower(), summary
    assert "it/s" not in result.stdout + result.stderr and len(result.stdout + result.stderr) < 20_000
    return summary


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


@pytest.mark.timeout(480)  # three runs and a fourth of 1 step on 1 process
def test_clip_end_to_end_resumed_by_folder_and_a_new_run_keeps_the_old_one(tmp_path: Path) -> None:
    usage = run("clip.py", "--help", cwd=tmp_path).stdout
    assert "--num-nodes" in usage and "(default: filepath)" in usage and "(default: title)" in usage
    out = tmp_path / "runs/clip/version_0"  # the default folder of a first run
    common = [*TINY_CLIP, "--train-size", "60", "--val-size", "24", "--batch-size", "8", "--val-every", "3"]
    result = run("clip.py", *common, "--max-steps", "4", cwd=tmp_path, strategy="ddp")  # the users' default
    recalls = [float(row["val/image_to_text_r5"]) for row in metrics(out) if row.get("val/image_to_text_r5")]
    assert len(recalls) == 2 and all(0 <= value <= 1 for value in recalls)  # at step 3 and after the last, 4
    for name in ("curves.png", "retrievals.png", "checkpoints/last.ckpt", "checkpoints/best.ckpt"):
        assert (out / name).stat().st_size > 0, name
    assert list(out.glob("tensorboard/version_*/events.*"))
    summary = check_summary(result)
    assert "4 steps ==" in summary and "recall by caption" in summary and str(Path("runs/clip/version_0")) in summary
    assert "weights_only" not in result.stdout + result.stderr
    assert weights(out / "checkpoints/last.ckpt")["logit_scale"].ndim == 0

    result = run("clip.py", *common, "--max-steps", "7", "--resume", "runs/clip/version_0", cwd=tmp_path)
    assert "steps 5-7 (resumed; the run has 7 steps)" in check_summary(result)
    from contrastive_dist.lightning.report import read_metrics

    first, resumed = metrics(out, 0), metrics(out, 1)
    assert max(int(row["step"]) for row in first) < min(int(row["step"]) for row in resumed)
    whole = read_metrics(out)  # what curves.png plots: both invocations
    assert {row["step"] for row in whole} == {float(row["step"]) for row in first + resumed}
    assert [row["step"] + 1 for row in whole if "val/image_to_text_r1" in row] == [3, 4, 6, 7]
    assert {row["train/samples"] for row in whole if "train/samples" in row} == {16.0, 12.0}  # 60 = 3 × 16 + 12

    # A second new run (a mistaken one) goes to a folder of its own: the first run's files stay as they were.
    kept = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    result = run("clip.py", *common, "--max-steps", "1", "--devices", "1", "--batch-size", "3", cwd=tmp_path)
    assert "runs/clip/version_1" in check_summary(result).replace("\\", "/")
    assert "gives each pair 2 negatives, fewer than 16" in result.stderr and "--batch-size" in result.stderr
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == kept
    assert (tmp_path / "runs/clip/version_1/checkpoints/last.ckpt").is_file()
    # An --output-dir that holds a run is refused: tests/test_lightning_runs.py (the recipes turn the
    # ValueError into one "error:" line, as for bad data: test_clip_bad_csv_ends_in_one_line).


def test_clip_on_csv_with_tiny_held_out_splits_short_runs_and_an_id_column(tmp_path: Path) -> None:
    from PIL import Image

    colours = ["red", "green", "blue", "yellow", "white", "black", "orange", "purple", "cyan", "gray"]
    for index, colour in enumerate(colours):
        Image.new("RGB", (20, 24), colour).save(tmp_path / f"{index}.png")
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n" + "".join(f"{i}.png,a plain {colour} picture\n"
                                                   for i, colour in enumerate(colours)))
    # The same pairs with an id column: ids 0-4, each shared by two pairs (a label, say).
    labelled = tmp_path / "labelled.csv"
    labelled.write_text("filepath,title,id\n" + "".join(f"{i}.png,a plain {colour} picture,{i // 2}\n"
                                                        for i, colour in enumerate(colours)))
    for val_size, data in (("2", table), ("4", labelled)):
        # 2 steps, below --val-every (50): the run still ends with a validation and writes best.ckpt.
        out = tmp_path / f"val{val_size}"
        result = run("clip.py", *TINY_CLIP, "--data", f"csv:{data}", "--val-size", val_size, "--batch-size", "2",
                     "--max-steps", "2", "--output-dir", str(out), cwd=tmp_path)
        summary = check_summary(result)
        assert "image_to_text_r1" in summary and "image_to_text_r5" not in summary  # top-k only for k <= split
        assert (out / "checkpoints/best.ckpt").exists() and (out / "retrievals.png").stat().st_size > 0
        assert "gives each pair 3 negatives" in result.stderr  # 2 per process × 2 processes
        # With the id column, ids= are its values (--caption-ids mask by default) and recall counts by them:
        # 4 held-out pairs of ids 3, 3, 4, 4 have chance R@1 1 - C(3, 1) / C(4, 1) = 0.5.
        counted = "the CSV's id column" if data == labelled else "caption"
        assert f"recall by {counted}" in summary, summary
        assert data != labelled or "(chance 0.500," in summary  # by caption: 0.250


def test_clip_bad_csv_ends_in_one_line(tmp_path: Path) -> None:
    missing = run("clip.py", "--data", "csv:nowhere.csv", cwd=tmp_path, check=False)
    (tmp_path / "few.csv").write_text("filepath,title\na.png,one\nb.png,two\n")
    few = run("clip.py", "--data", f"csv:{tmp_path / 'few.csv'}", "--val-size", "2", cwd=tmp_path, check=False)
    for result, cause in ((missing, "no such file"), (few, "has 2 rows")):
        assert result.returncode != 0 and "Traceback" not in result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and cause in line


def test_simclr_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run("simclr.py", *TINY_SIMCLR, "--train-size", "60", "--val-size", "20", "--bank-size", "30",
                 "--batch-size", "8", "--max-steps", "4", "--val-every", "2", "--output-dir", str(out), cwd=tmp_path)
    accuracies = [float(row["val/knn_accuracy"]) for row in metrics(out) if row.get("val/knn_accuracy")]
    assert len(accuracies) == 2 and all(0 <= value <= 1 for value in accuracies)
    state = weights(out / "checkpoints/last.ckpt")
    assert any(key.endswith("running_mean") for key in state)
    assert (out / "curves.png").exists() and "knn_accuracy" in check_summary(result)


def test_two_processes_and_a_resume_on_three_train_to_the_weights_of_one(tmp_path: Path) -> None:
    # 49 samples, global batch 24: steps of 24, 24, 1 per epoch; the last step splits [1, 0] on 2 processes
    # and [1, 0, 0] on 3 (32-pixel images keep a 2×2 last feature map, so BatchNorm has 4 values per
    # channel then). A third run stops at step 2 on 2 processes and resumes mid-epoch on 3 × 8.
    common = [*TINY_CLIP, "--image-size", "32", "--train-size", "49", "--val-size", "8",
              "--optimizer", "sgd", "--lr", "0.5", "--val-every", "100", "--no-plots", "--precision", "64-true"]
    run("clip.py", *common, "--max-steps", "6", "--devices", "2", "--batch-size", "12", "--output-dir", "two",
        cwd=tmp_path)
    run("clip.py", *common, "--max-steps", "6", "--devices", "1", "--batch-size", "24", "--output-dir", "one",
        cwd=tmp_path)
    run("clip.py", *common, "--max-steps", "2", "--devices", "2", "--batch-size", "12", "--output-dir", "three",
        cwd=tmp_path)
    result = run("clip.py", *common, "--max-steps", "6", "--devices", "3", "--batch-size", "8", "--output-dir",
                 "three", "--resume", "three/checkpoints/last.ckpt", cwd=tmp_path)
    assert ("steps 3-6 (resumed; the run has 6 steps), resumed on 3 process(es) × 8 with 0 worker(s) from 2 × 12 "
            "with 0 (the same global batch)") in check_summary(result)
    one = weights(tmp_path / "one/checkpoints/last.ckpt")
    for other in ("two", "three"):
        # 64-true, but the recipe's loss runs in float32, so the order of its sums differs between layouts:
        # measured at most 4.1e-7 relative, for both. A loss off the contract (a mean of per-rank means) is
        # off by more than 1e-2.
        floating_weights_close(one, weights(tmp_path / f"{other}/checkpoints/last.ckpt"), 1e-5)
    assert float(one["logit_scale"]) != pytest.approx(float(torch.tensor(1 / 0.07).log()), abs=1e-6)  # it trained


@pytest.mark.parametrize("strategy", ["ddp", "ddp_fork"])
def test_a_failing_rank_makes_the_command_fail(tmp_path: Path, strategy: str) -> None:
    result = run("clip.py", *TINY_CLIP, "--train-size", "64", "--val-size", "8", "--batch-size", "4",
                 "--max-steps", "8", "--val-every", "100", "--no-plots", "--output-dir", "out", cwd=tmp_path,
                 env={"RECIPE_FAIL_AT_STEP": "3"}, check=False, timeout=120, hooks=True, strategy=strategy)
    assert result.returncode != 0
    assert "fails on purpose" in result.stdout + result.stderr


@pytest.mark.parametrize("num_workers", ["0", "2"])
def test_resume_mid_epoch_sees_every_sample_once(tmp_path: Path, num_workers: str) -> None:
    # 37 samples, global batch 8: five steps per epoch, the last split [3, 2]; stop after 2. Workers
    # prefetch batches beyond the checkpoint's step: the loader's saved state must not count them.
    record = tmp_path / "samples"
    record.mkdir()
    common = [*TINY_CLIP, "--train-size", "37", "--val-size", "8", "--batch-size", "4", "--val-every", "100",
              "--no-plots", "--output-dir", "out", "--num-workers", num_workers]
    env = {"RECIPE_RECORD_SAMPLES": str(record)}
    run("clip.py", *common, "--max-steps", "2", cwd=tmp_path, env=env, hooks=True)
    run("clip.py", *common, "--max-steps", "5", "--resume", "out/checkpoints/last.ckpt", cwd=tmp_path, env=env,
        hooks=True)
    seen: list[int] = []
    steps: dict[int, list[int]] = {0: [], 1: []}
    for rank in (0, 1):
        for line in (record / f"rank{rank}.txt").read_text().splitlines():
            epoch, step, *ids = map(int, line.split())
            assert epoch == 0
            steps[rank].append(step)
            seen += ids
    assert steps[0] == steps[1] == [0, 1, 2, 3, 4]
    assert sorted(seen) == list(range(37))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_on_localhost(tmp_path: Path) -> None:
    args = [sys.executable, str(RECIPES / "clip.py"), *TINY_CLIP, "--train-size", "20", "--val-size", "8",
            "--batch-size", "4", "--max-steps", "2", "--val-every", "2", "--no-plots", "--num-nodes", "2",
            "--devices", "1"]
    port = str(free_port())
    processes = []
    for node in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
               "NODE_RANK": str(node)}
        processes.append(subprocess.Popen([*args, "--output-dir", f"node{node}"], cwd=tmp_path, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=150)[0])
    finally:
        for process in processes:
            process.kill()
    assert [process.returncode for process in processes] == [0, 0], "\n".join(output[-3000:] for output in outputs)
    assert "2 process(es)" in outputs[0]


@pytest.mark.parametrize("recipe", ["clip.py", "simclr.py"])
def test_module_docstring_gives_the_launch_commands(recipe: str) -> None:
    text = (RECIPES / recipe).read_text()
    for command in ("--num-nodes", "NODE_RANK", "MASTER_ADDR", "torchrun --nnodes"):
        assert command in text


def test_shapes_background_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from contrastive_dist.shapes import ShapesDataset

    default = ShapesDataset("train", size=32, seed=3)
    explicit = ShapesDataset("train", size=32, seed=3, background_noise=0.04, tint_spread=0.2)
    plain = ShapesDataset("train", size=32, seed=3, background_noise=0.0, tint_spread=0.0)
    assert torch.equal(default.images, explicit.images) and default.captions == plain.captions
    shape = (plain.images != 51).any(dim=1, keepdim=True)  # 51 = round(0.2 · 255), the plain grey
    assert 0.01 < shape.float().mean() < 0.3
    assert torch.equal(torch.where(shape, default.images, 0), torch.where(shape, plain.images, 0))  # same shapes
    with pytest.raises(ValueError, match="tint_spread"):
        ShapesDataset("train", size=4, tint_spread=1.0)


def test_torchrun_recipe_resumes_mid_epoch_on_three_processes_to_the_weights_of_one(tmp_path: Path) -> None:
    # 49 pairs, global batch 24: steps of 24, 24, 1 per epoch, the last split [1, 0] on 2 processes and
    # [1, 0, 0] on 3. Two processes × 12 stop after 1 step (mid-epoch); three × 8, the same global batch,
    # resume to step 5; one process × 24 runs the 5 steps at once.
    def torchrun(processes: int, *args: str) -> str:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
                   str(RECIPES / "clip_torchrun.py"), "--train-size", "49", "--lr", "0.5", *args]
        result = run_command(command, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=150)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
        return result.stdout

    torchrun(2, "--batch-size", "12", "--max-steps", "1", "--output-dir", "three")
    output = torchrun(3, "--batch-size", "8", "--max-steps", "5", "--output-dir", "three", "--resume",
                      "three/checkpoint.pt")
    assert "held-out recall over 64 pairs" in output and "5 steps" in output
    assert "resumed on 3 processes × 8 from a run on 2 × 12 (the same global batch)" in output
    torchrun(1, "--batch-size", "24", "--max-steps", "5", "--output-dir", "one")
    three, one = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True) for name in ("three", "one"))
    assert three["step"] == one["step"] == 5
    assert {key: three["sampler"][key] for key in ("epoch", "step", "consumed", "num_replicas")} == {
        "epoch": 1, "step": 2, "consumed": 48, "num_replicas": 3}
    for key, value in one["model"].items():
        if value.is_floating_point():
            scale = value.abs().max().clamp_min(1e-6)
            # float32 in another sum order: measured up to 4.3e-6 relative here (1.2e-4 for 2 processes × 8 vs
            # 1 × 16 under load); a loss off the gradient contract (a mean of per-rank means) is off by more than 1e-2.
            assert (three["model"][key] - value).abs().max() / scale <= 1e-3, key
    assert not torch.equal(one["model"]["logit_scale"], torch.tensor(1 / 0.07).log())  # it trained


@pytest.mark.timeout(480)  # four short torchrun runs and a refused one
def test_torchrun_recipe_gives_each_run_a_folder_and_a_second_run_keeps_the_first_files(tmp_path: Path) -> None:
    def torchrun(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   str(RECIPES / "clip_torchrun.py"), "--train-size", "49", "--batch-size", "12", *args]
        result = run_command(command, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=150)
        assert result.returncode == 0 or not check, result.stdout[-2000:] + result.stderr[-4000:]
        return result

    first = tmp_path / "runs/clip_torchrun/version_0"  # the default folder of a first run
    assert str(Path("runs/clip_torchrun/version_0/checkpoint.pt")) in torchrun("--max-steps", "1").stdout
    kept = {path: path.read_bytes() for path in first.rglob("*") if path.is_file()}
    assert list(kept) == [first / "checkpoint.pt"]
    # A second new run (a mistaken one) goes to a folder of its own: the first run's files stay as they were.
    assert str(Path("runs/clip_torchrun/version_1")) in torchrun("--max-steps", "1", "--seed", "1").stdout
    assert {path: path.read_bytes() for path in first.rglob("*") if path.is_file()} == kept
    # --resume names the run's folder and continues there.
    assert "2 steps" in torchrun("--max-steps", "2", "--resume", "runs/clip_torchrun/version_0").stdout
    assert torch.load(first / "checkpoint.pt", weights_only=True)["step"] == 2
    assert sorted(path.name for path in first.parent.iterdir()) == ["version_0", "version_1"]
    # An --output-dir that holds a run is refused, in one line and before any step, unless --overwrite.
    refused = torchrun("--max-steps", "1", "--output-dir", str(first), check=False)
    assert refused.returncode != 0 and f"error: {first} holds a run already" in refused.stderr
    assert "--overwrite" in refused.stderr and "step 1" not in refused.stdout
    assert torch.load(first / "checkpoint.pt", weights_only=True)["step"] == 2
    torchrun("--max-steps", "1", "--output-dir", str(first), "--overwrite")
    assert torch.load(first / "checkpoint.pt", weights_only=True)["step"] == 1


def floating_weights_close(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], tolerance: float) -> None:
    """The same keys; every floating tensor within ``tolerance`` of the other, relative to its largest entry."""
    assert first.keys() == second.keys()
    for key, value in first.items():
        if value.is_floating_point():
            scale = value.abs().max().clamp_min(1e-6)
            assert (second[key] - value).abs().max() / scale <= tolerance, (key, value.dtype)


# 33 samples, global batch 16 on 2 processes: steps of 16, 16, 1, the last split [1, 0] (an empty rank).
RING_RUNS = {
    # The CLIP recipe computes its loss in float32, so the two modes differ by the order of the loss's
    # sums: measured 2.4e-6 relative after 6 steps at lr 0.5.
    "clip.py": ([*TINY_CLIP, "--image-size", "32"], 1e-5),
    # SimCLR in float64, augmentations on (the same seed in both runs): measured 1.3e-13.
    "simclr.py": ([*TINY_SIMCLR, "--bank-size", "16", "--precision", "64-true"], 1e-10),
}


@pytest.mark.parametrize("recipe", sorted(RING_RUNS))
def test_ring_communication_trains_to_the_weights_of_gather(tmp_path: Path, recipe: str) -> None:
    flags, tolerance = RING_RUNS[recipe]
    common = [*flags, "--train-size", "33", "--val-size", "8", "--batch-size", "8", "--optimizer", "sgd",
              "--lr", "0.5", "--max-steps", "6", "--val-every", "100", "--no-plots"]
    for mode in ("gather", "ring"):
        run(recipe, *common, "--communication", mode, "--output-dir", mode, cwd=tmp_path)
    gather, ring = (weights(tmp_path / f"{mode}/checkpoints/last.ckpt") for mode in ("gather", "ring"))
    floating_weights_close(gather, ring, tolerance)
    if recipe == "clip.py":
        assert not torch.equal(gather["logit_scale"], torch.tensor(1 / 0.07).log())  # it trained
    else:
        assert gather["head.3.weight"].dtype == torch.float64


@pytest.mark.timeout(480)  # three runs of at most 150 s each (see run); ~190 s on the loaded 2 cores
def test_simclr_queue_is_in_the_checkpoint_resumes_exactly_and_matches_ring_mode(tmp_path: Path) -> None:
    # Global batch 16 on 2 processes, 33 samples: 16, 16, 1 ([1, 0]), 16, 16 keys pushed; a queue of 40
    # (not a multiple of 16) holds 16, 32, 33, 40, 40. Float64 and no augmentation: resuming is exact.
    common = [*TINY_SIMCLR, "--train-size", "33", "--val-size", "8", "--bank-size", "16", "--batch-size", "8",
              "--queue-size", "40", "--optimizer", "sgd", "--lr", "0.5", "--val-every", "100", "--no-plots",
              "--precision", "64-true", "--deterministic-data", "--checkpoint-every", "2"]
    straight = run("simclr.py", *common, "--max-steps", "5", "--output-dir", "straight", cwd=tmp_path)
    assert "knn_accuracy" in check_summary(straight)
    run("simclr.py", *common, "--max-steps", "2", "--output-dir", "resumed", cwd=tmp_path)
    early = weights(tmp_path / "resumed/checkpoints/last.ckpt")
    assert int(early["queue.count"]) == 32 and early["queue.memory"].shape == (40, 8)
    assert early["queue.memory"][:32].norm(dim=1).sub(1).abs().max() < 1e-12  # normalised keys
    assert early["queue.memory"][32:].abs().max() == 0  # not filled yet
    run("simclr.py", *common, "--max-steps", "5", "--output-dir", "resumed", "--resume",
        str(tmp_path / "resumed/checkpoints/last.ckpt"), cwd=tmp_path)
    one_go, resumed = (weights(tmp_path / f"{name}/checkpoints/last.ckpt") for name in ("straight", "resumed"))
    assert int(one_go["queue.count"]) == int(resumed["queue.count"]) == 40
    assert any(key.startswith("key_backbone.") for key in one_go)  # the momentum encoder is carried too
    assert not torch.equal(one_go["key_head.3.weight"], one_go["head.3.weight"])  # and lags behind
    floating_weights_close(one_go, resumed, 1e-10)
    # Ring mode with the queue's shared negatives: the same run, to the same weights and queue.
    run("simclr.py", *common, "--max-steps", "5", "--output-dir", "ring", "--communication", "ring", cwd=tmp_path)
    floating_weights_close(one_go, weights(tmp_path / "ring/checkpoints/last.ckpt"), 1e-10)


def test_a_csv_id_column_gives_the_loss_its_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    for index in range(6):
        Image.new("RGB", (8, 8), (index * 40, 0, 0)).save(tmp_path / f"{index}.png")
    table = tmp_path / "labelled.tsv"
    table.write_text("filepath\ttitle\tgroup\n" + "".join(f"{i}.png\ta picture\t{i // 3}\n" for i in range(6)))
    monkeypatch.syspath_prepend(str(RECIPES))
    import clip

    args = clip.parse_args([*TINY_CLIP, "--data", f"csv:{table}", "--csv-id-column", "group", "--val-size", "2"])
    assert args.csv_ids and args.caption_ids == "mask"  # the column's ids, masked by default
    assert clip.parse_args([*TINY_CLIP, "--data", f"csv:{table}"]).caption_ids == "none"  # no "id" column
    train, val = clip.csv_data(str(table), args)
    model = clip.CLIP(args, train, val)
    batch = model.collate([train[i] for i in range(len(train))])
    assert batch[2].tolist() == [0, 0, 0, 1] and batch[3].tolist() == [0, 1, 2, 3]  # ids=, then the row indices
    captured = {}
    model.loss.forward = lambda *tensors, **options: captured.update(options) or tensors[0].sum()  # type: ignore
    monkeypatch.setattr(clip.CLIP, "trainer", property(lambda self: None))  # one process, no Trainer
    monkeypatch.setattr(clip, "step_sizes", lambda trainer, batch_idx: [4])
    monkeypatch.setattr(model, "log", lambda *a, **k: None)
    monkeypatch.setattr(model, "log_dict", lambda *a, **k: None)
    model.training_step(batch, 0)
    assert captured["ids"].tolist() == [0, 0, 0, 1]
