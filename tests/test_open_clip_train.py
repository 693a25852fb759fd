"""open_clip's own training script, through the documented entry, on 2 gloo processes equals one process.

``python -m contrastive_dist.compat.open_clip_train`` runs open_clip 3.3's ``open_clip_train`` unedited
(``tests/open_clip_train_hooks.py`` adds float64, a tiny model config and uneven batches from the test
side). On 8 generated image-caption pairs (PNG files and a CSV written here), one global batch split
[7, 1] over two processes under ``torchrun``: the script builds the drop-in, every rank gets the
global loss, and the gradients DDP averaged equal one process's on all 8 rows to 1e-12, for the
default CLIP loss, ``--siglip`` and ``--local-loss --gather-with-grad`` (against the one process of
the default loss: on one process these flags change nothing).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from forked_runs import run_command

pytest.importorskip("open_clip_train")
pytest.importorskip("pandas")
Image = pytest.importorskip("PIL.Image")

HOOKS = Path(__file__).resolve().parent / "open_clip_train_hooks.py"
TOWERS = {"embed_dim": 16, "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "patch_size": 8, "head_width": 8},
          "text_cfg": {"context_length": 12, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1}}
CASES = {  # flags → the drop-in the script must build
    "clip": (["--model", "tiny-clip"], "contrastive_dist.compat.open_clip.ClipLoss"),
    "siglip": (["--model", "tiny-sigmoid", "--siglip"], "contrastive_dist.compat.open_clip.SigLipLoss"),
    "local loss": (["--model", "tiny-clip", "--local-loss", "--gather-with-grad"],
                   "contrastive_dist.compat.open_clip.ClipLoss"),
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("open_clip_data")
    (folder / "tiny-clip.json").write_text(json.dumps(TOWERS))
    (folder / "tiny-sigmoid.json").write_text(json.dumps({**TOWERS, "init_logit_bias": -10}))
    generator = torch.Generator().manual_seed(0)
    words = "red green blue small large square circle cat dog".split()
    lines = ["filepath\ttitle"]
    for index in range(8):
        pixels = torch.randint(0, 256, (16, 16, 3), generator=generator, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(folder / f"{index}.png")
        caption = " ".join(words[i] for i in torch.randint(0, len(words), (3,), generator=generator))
        lines.append(f"{folder / f'{index}.png'}\t{caption}")
    (folder / "pairs.csv").write_text("\n".join(lines) + "\n")
    return folder


def _train(data_dir: Path, tmp_path: Path, name: str, flags: list[str], processes: int) -> None:
    root = HOOKS.parents[1]
    launcher = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
        "--"]  # the script's --logs is not torchrun's --logs-specs
    arguments = [
        str(HOOKS), str(data_dir), str(tmp_path / name), "--train-data", str(data_dir / "pairs.csv"),
        "--dataset-type", "csv", "--csv-img-key", "filepath", "--csv-caption-key", "title", "--batch-size", "8",
        "--epochs", "1", "--workers", "0", "--precision", "fp32", "--lr", "1e-3", "--warmup", "0",
        "--logs", str(tmp_path / "logs"), "--name", name, "--seed", "0", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    result = run_command([*launcher, *arguments], cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def one_process(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict]:
    """The one-process run of a model, made once: on one process the loss flags change nothing."""
    folder, runs = tmp_path_factory.mktemp("one_process"), {}

    def run(model: str) -> dict:
        if model not in runs:
            flags = ["--model", model] + (["--siglip"] if model == "tiny-sigmoid" else [])
            _train(data_dir, folder, model, flags, 1)
            runs[model] = torch.load(folder / f"{model}-rank0.pt")
        return runs[model]

    return run


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_open_clip_train_on_uneven_ranks_gives_the_one_process_gradient(
    data_dir: Path, tmp_path: Path, one_process: Callable[[str], dict], case: str
) -> None:
    flags, loss_class = CASES[case]
    _train(data_dir, tmp_path, "two", flags, 2)
    assert (tmp_path / "two-loss-class.txt").read_text() == loss_class
    single = one_process(flags[1])
    assert len(single["grads"]) > 10
    for rank in (0, 1):
        result = torch.load(tmp_path / f"two-rank{rank}.pt")
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-12), f"rank {rank}: the global loss"
        assert result["grads"].keys() == single["grads"].keys()
        for name, grad in single["grads"].items():
            assert grad.dtype == torch.float64
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-12, atol=1e-12, msg=f"rank {rank} {name}")
