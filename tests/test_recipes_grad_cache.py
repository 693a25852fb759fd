"""``--grad-cache M`` in the three recipes, run as a user runs them (2 CPU processes, an empty rank at the end).

Where exactness holds it is checked: against the same run without the flag, to the weights. That
is a backbone without batch statistics (``--norm group``) in float64 for the CLIP recipe, and
``M`` at least the per-rank batch (one mini-batch, so BatchNorm sees the same rows) for SimCLR and the
torchrun recipe. Where it does not (BatchNorm on mini-batches of ``M < batch`` rows, bf16 autocast)
the run must train and report its held-out metrics; the README shows them beside the plain run's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from forked_runs import run_command
from test_recipes import RECIPES, TINY_CLIP, TINY_SIMCLR, check_summary, floating_weights_close, metrics, run, weights

# 33 samples, global batch 16 on 2 processes: steps of 16, 16, 1, the last split [1, 0] (an empty rank).
COMMON = ["--train-size", "33", "--val-size", "8", "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.5",
          "--max-steps", "6", "--val-every", "100", "--no-plots"]


@pytest.mark.timeout(330)  # two runs of at most 150 s each (see test_recipes.run)
def test_clip_with_grad_cache_trains_to_the_weights_of_plain_training(tmp_path: Path) -> None:
    flags = [*TINY_CLIP, "--image-size", "32", "--norm", "group", "--precision", "64-true", *COMMON]
    for name, extra in (("plain", []), ("cached", ["--grad-cache", "3"])):  # mini-batches of 3, 3, 2 rows
        run("clip.py", *flags, *extra, "--output-dir", name, cwd=tmp_path)
    plain, cached = (weights(tmp_path / f"{name}/checkpoints/last.ckpt") for name in ("plain", "cached"))
    # Float64; only the order of the mini-batch gradient sums differs: measured 3.4e-15 relative.
    floating_weights_close(plain, cached, 1e-10)
    assert not torch.equal(plain["logit_scale"], torch.tensor(1 / 0.07).log().double())  # it trained
    assert not any(key.endswith("running_mean") for key in plain)  # no batch statistics in this backbone


@pytest.mark.timeout(480)  # three runs of at most 150 s each (see test_recipes.run)
def test_simclr_with_grad_cache_one_mini_batch_is_exact_and_smaller_ones_train(tmp_path: Path) -> None:
    flags = [*TINY_SIMCLR, "--bank-size", "16", "--precision", "64-true", *COMMON]
    # 2 views × 8 images = 16 rows per rank: M=16 is one mini-batch, M=6 three (6, 6, 4 rows), in bf16-mixed.
    runs = (("plain", []), ("one", ["--grad-cache", "16"]), ("six", ["--grad-cache", "6", "--precision", "bf16-mixed"]))
    results = {name: run("simclr.py", *flags, *extra, "--output-dir", name, cwd=tmp_path) for name, extra in runs}
    plain, one, six = (weights(tmp_path / f"{name}/checkpoints/last.ckpt") for name in ("plain", "one", "six"))
    floating_weights_close(plain, one, 1e-10)  # measured: identical; synchronized BatchNorm and its statistics too
    assert any(key.endswith("running_mean") for key in plain)
    moved = max(float((six[key] - value).abs().max()) for key, value in plain.items() if value.is_floating_point())
    assert moved > 1e-6  # 6-image BatchNorm statistics (and bf16): a different run, as documented
    for name in ("plain", "six"):
        accuracy = [float(row["val/knn_accuracy"]) for row in metrics(tmp_path / name) if row.get("val/knn_accuracy")]
        assert len(accuracy) == 1 and 0 <= accuracy[0] <= 1 and "knn_accuracy" in check_summary(results[name])


def torchrun(cwd: Path, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(RECIPES / "clip_torchrun.py"), "--train-size", "33", "--lr", "0.5", "--batch-size", "8",
               "--max-steps", "5", *args]
    result = run_command(command, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=150)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.timeout(480)  # three runs of at most 150 s each
def test_torchrun_recipe_with_grad_cache(tmp_path: Path) -> None:
    torchrun(tmp_path, "--output-dir", "plain")
    torchrun(tmp_path, "--output-dir", "one", "--grad-cache", "8")  # one mini-batch of the 8 rows per rank
    output = torchrun(tmp_path, "--output-dir", "three", "--grad-cache", "3")  # BatchNorm on 3, 3, 2 rows
    assert "held-out recall over 64 pairs" in output and "5 steps" in output
    plain, one, three = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"]
                         for name in ("plain", "one", "three"))
    # Float32, the same rows through the same ops; measured: identical (0 difference) after 5 steps.
    floating_weights_close(plain, one, 1e-6)
    assert max(float((three[key] - value).abs().max()) for key, value in plain.items()
               if value.is_floating_point()) > 1e-6
