"""The CLIP recipe with several captions per image (``--several-captions``): real 2-process Lightning DDP runs.

With one caption per image the runs must train to the weights of the plain run (the loss with
``image_ids=`` / ``text_ids=`` is then CLIP's); with several, images with 1–3 captions (repeated
paths and a JSON list cell) on ranks whose caption counts differ must train.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from test_recipes import TINY_CLIP, check_summary, floating_weights_close, metrics, run, weights

from contrastive_dist.lightning.image_captions import captions_by_image
from contrastive_dist.lightning.image_text import csv_rows

COLOURS = ["red", "green", "blue", "yellow", "white", "black", "orange", "purple", "cyan", "gray"]
COMMON = [*TINY_CLIP, "--batch-size", "2", "--optimizer", "sgd", "--lr", "0.5", "--no-plots", "--deterministic-data",
          "--val-size", "2", "--val-every", "100", "--image-size", "32"]  # 32 pixels: a 2 × 2 last map (BatchNorm)


def _images(folder: Path) -> None:
    from PIL import Image

    for index, colour in enumerate(COLOURS):
        Image.new("RGB", (20, 24), colour).save(folder / f"{index}.png")


@pytest.mark.timeout(360)  # two runs of at most 150 s each
def test_one_caption_per_image_trains_to_the_weights_of_the_plain_run(tmp_path: Path) -> None:
    _images(tmp_path)
    table = tmp_path / "pairs.csv"
    table.write_text("filepath,title\n" + "".join(f"{i}.png,a plain {colour} picture\n"
                                                   for i, colour in enumerate(COLOURS)))  # fmt: skip
    flags = [*COMMON, "--data", f"csv:{table}", "--max-steps", "3", "--precision", "64-true"]
    run("clip.py", *flags, "--output-dir", "plain", cwd=tmp_path)
    run("clip.py", *flags, "--several-captions", "--output-dir", "several", cwd=tmp_path)
    plain, several = (weights(tmp_path / name / "checkpoints/last.ckpt") for name in ("plain", "several"))
    assert float(plain["logit_scale"]) != pytest.approx(math.log(1 / 0.07), abs=1e-6)  # it trained
    floating_weights_close(plain, several, 1e-9)


@pytest.mark.timeout(240)
def test_several_captions_per_image_train(tmp_path: Path) -> None:
    _images(tmp_path)
    lines = ["filepath,title"]
    for index, colour in enumerate(COLOURS[:8]):  # 1, 2 or 3 captions: rows that repeat the path
        lines += [f"{index}.png,{form} {colour}" for form in ("a plain", "all", "only")[: 1 + index % 3]]
    lines.append('8.png,"[""a plain cyan picture"", ""cyan, plainly""]"')  # a JSON list cell: two captions
    lines += [f"{index}.png,a plain {colour} picture" for index, colour in enumerate(COLOURS) if index >= 8]
    table = tmp_path / "several.csv"
    table.write_text("\n".join(lines) + "\n")
    rows, _ = csv_rows(table)
    groups = captions_by_image(rows[:-2])
    assert [len(captions) for _, captions in groups] == [1, 2, 3, 1, 2, 3, 1, 2, 2]
    result = run("clip.py", *COMMON, "--data", f"csv:{table}", "--several-captions", "--max-steps", "4",
                 "--output-dir", "out", cwd=tmp_path)  # fmt: skip
    check_summary(result)
    losses = [float(row["train/loss"]) for row in metrics(tmp_path / "out") if row.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(loss) and loss > 0 for loss in losses), losses


def test_several_captions_refuses_other_data_and_caption_ids(tmp_path: Path) -> None:
    shapes = run("clip.py", "--several-captions", cwd=tmp_path, check=False)
    assert shapes.returncode != 0 and "--several-captions takes --data csv:PATH" in shapes.stderr
