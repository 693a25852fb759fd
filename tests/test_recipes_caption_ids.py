"""Repeated captions in the CLIP recipe: ``--duplicate-captions``, ``--caption-ids``, recall by caption.

The runs are real 2-process Lightning DDP runs on CPU, tiny settings. Where ids cannot matter (every
caption distinct) the ids runs must train to the weights of the run without; where they do (repeated
captions) they must change the loss the run starts from. The metric, the ids and the data change are
checked in this process against plain references.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_recipes import TINY_CLIP, check_summary, floating_weights_close, metrics, run, weights

from contrastive_dist import retrieval_accuracy
from contrastive_dist.lightning.image_text import caption_id
from contrastive_dist.lightning.retrieval import recall_by_chance
from contrastive_dist.lightning.retrieval import recall_by_id as recall_by_caption
from contrastive_dist.shapes import COLOURS, KINDS, SHAPES, ShapesDataset, kind_caption

MODES = ("none", "mask", "positive")
# Global batch 16 on 2 processes, SGD at a constant rate: the runs differ only by --caption-ids.
COMMON = [*TINY_CLIP, "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.5", "--no-plots"]


def first_loss(output_dir: Path) -> float:
    """The loss of the first step: the same initial weights and global batch in every mode."""
    return float(next(row["train/loss"] for row in metrics(output_dir) if row.get("train/loss")))


@pytest.mark.timeout(480)  # three runs of at most 150 s each (see test_recipes.run)
def test_caption_ids_on_repeated_captions_change_the_loss_and_report_recall_by_caption(tmp_path: Path) -> None:
    # --duplicate-captions 1: every image captioned by its colour-shape kind (30 captions, 4 written forms
    # each), so a global batch of 16 holds pairs that share a caption, mostly in different forms (with
    # identical texts, multi-positive rows would give the plain loss exactly: the forms make it differ).
    flags = [*COMMON, "--duplicate-captions", "1", "--train-size", "40", "--val-size", "16", "--max-steps", "3",
             "--val-every", "1"]
    results = {mode: run("clip.py", *flags, "--caption-ids", mode, "--output-dir", mode, cwd=tmp_path)
               for mode in MODES}
    loss = {mode: first_loss(tmp_path / mode) for mode in MODES}
    # Masking takes terms out of each row's log-sum-exp: lower, never higher. Measured 4.4405 against
    # 4.4485 without ids, and 4.5060 with multi-positive rows; float32 rounding is ~1e-6.
    assert loss["mask"] < loss["none"] - 1e-3, loss
    assert abs(loss["positive"] - loss["none"]) > 1e-3, loss
    held_out = ShapesDataset("val", size=16, image_size=16, duplicate_captions=1)  # as the runs draw it
    captions = torch.tensor([caption_id(text) for text in held_out.captions])
    assert len(set(captions.tolist())) < 16  # the held-out split repeats captions too
    chance = {f"val/{key}": value for key, value in recall_by_chance(captions, (1, 5)).items()}
    for mode, result in results.items():
        summary = check_summary(result)
        for key, value in chance.items():  # the summary's chance is that of the repeated captions
            assert re.search(rf"{key}\s+\S+\s+\(chance {value:.3f},", summary), (key, value, summary)
        recalls = [float(row[key]) for row in metrics(tmp_path / mode) for key in chance if row.get(key)]
        assert len(recalls) == 4 * 3 and all(0 <= value <= 1 for value in recalls), mode  # after each step


@pytest.mark.timeout(480)  # three runs of at most 150 s each (see test_recipes.run)
def test_caption_ids_without_repeated_captions_train_to_the_weights_of_none(tmp_path: Path) -> None:
    # Seed 7 draws 33 distinct training captions: no pair has another's id, so the ids change nothing.
    # 33 pairs, global batch 16: steps of 16, 16, 1, the last split [1, 0] (an empty rank; 32-pixel images
    # keep a 2×2 last feature map, so BatchNorm has 4 values per channel then).
    assert len(set(ShapesDataset("train", size=33, seed=7).captions)) == 33
    flags = [*COMMON, "--image-size", "32", "--seed", "7", "--train-size", "33", "--val-size", "8", "--max-steps", "6",
             "--val-every", "100", "--precision", "64-true"]
    for mode in MODES:
        run("clip.py", *flags, "--caption-ids", mode, "--output-dir", mode, cwd=tmp_path)
    none = weights(tmp_path / "none/checkpoints/last.ckpt")
    assert none["logit_scale"].dtype == torch.float64
    assert float(none["logit_scale"]) != pytest.approx(math.log(1 / 0.07), abs=1e-6)  # it trained
    # The recipe's loss runs in float32 (64-true towers). Masking nothing leaves every sum as it was:
    # measured identical. A multi-positive row of one positive forms its gradient in another order (one
    # float32 ulp, 6e-8, in a step's gradients): measured 2.1e-6 relative after 6 steps at lr 0.5.
    floating_weights_close(none, weights(tmp_path / "mask/checkpoints/last.ckpt"), 1e-12)
    floating_weights_close(none, weights(tmp_path / "positive/checkpoints/last.ckpt"), 1e-5)


def test_recall_by_caption_is_recall_for_distinct_captions_and_counts_any_copy_otherwise() -> None:
    generator = torch.Generator().manual_seed(0)
    image, noise = torch.randn(2, 12, 6, generator=generator, dtype=torch.float64)
    text = image + noise  # related, not equal: some queries hit, some miss
    distinct = recall_by_caption(image, text, torch.arange(12), top_k=(1, 3))
    expected = retrieval_accuracy(image, text, top_k=(1, 3))
    assert distinct.keys() == expected.keys()
    assert {key: float(value) for key, value in distinct.items()} == pytest.approx(
        {key: float(value) for key, value in expected.items()}, abs=1e-12)
    assert 0 < float(expected["image_to_text_r1"]) < float(expected["image_to_text_r3"]) < 1  # neither all nor none
    captions = torch.tensor([0, 1, 0, 2, 2, 2, 3, 4, 1, 5, 6, 0])
    recall = recall_by_caption(image, text, captions, top_k=(1, 3))
    for name, scores in (("image_to_text", image @ text.T), ("text_to_image", text @ image.T)):
        for k in (1, 3):  # a plain reference: sort each query's answers, look for its caption among the k best
            best = scores.argsort(dim=1, descending=True)[:, :k]
            hits = [bool((captions[best[i]] == captions[i]).any()) for i in range(12)]
            assert float(recall[f"{name}_r{k}"]) == pytest.approx(sum(hits) / 12, abs=1e-12), (name, k)
    # Chance: over every set of k answers drawn at random, the fraction that holds one with the query's caption.
    chance = recall_by_chance(captions, (1, 3))
    for k in (1, 3):
        draws = list(itertools.combinations(range(12), k))
        by_query = [sum(any(captions[j] == captions[i] for j in draw) for draw in draws) / len(draws)
                    for i in range(12)]
        for direction in ("image_to_text", "text_to_image"):
            assert chance[f"{direction}_r{k}"] == pytest.approx(sum(by_query) / 12, abs=1e-12)
    assert recall_by_chance(torch.arange(8), (1, 5)) == pytest.approx(
        {f"{direction}_r{k}": k / 8 for direction in ("image_to_text", "text_to_image") for k in (1, 5)})


def test_caption_ids_ignore_case_and_punctuation_and_agree_between_processes() -> None:
    texts = ["a red circle", "A red circle.", "a  red circle!", "a red square", "a small red circle in the center"]
    ids = [caption_id(text) for text in texts]
    assert ids[0] == ids[1] == ids[2] and len(set(ids)) == 3
    assert all(0 <= value < 2**63 for value in ids)  # int64, as the loss's ids= takes them
    # Every rank computes its pairs' ids itself: they must not depend on the process (str hash() would).
    code = f"import sys; from contrastive_dist.lightning.image_text import caption_id; " \
           f"print([caption_id(text) for text in {texts!r}])"
    for seed in ("1", "2"):
        output = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                                capture_output=True, text=True, timeout=120, check=True).stdout
        assert output.strip() == str(ids)


def words(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def coarse_kinds(plain: ShapesDataset, duplicated: ShapesDataset) -> set[str]:
    """The kinds captioned by kind alone; checks that all images of a kind are captioned alike."""
    coarse: dict[str, bool] = {}
    for full, text in zip(plain.captions, duplicated.captions, strict=True):
        _, _, colour, shape = full.split()[:4]  # "a small red circle in the ..."
        kind = f"a {colour} {shape}"
        assert coarse.setdefault(kind, text != full) == (text != full), kind
        assert text == full or words(text) == kind, (full, text)
    return {kind for kind, is_coarse in coarse.items() if is_coarse}


def test_duplicate_captions_name_the_kind_of_a_fraction_of_kinds_in_both_splits() -> None:
    splits = {split: [ShapesDataset(split, size=size, image_size=16, seed=3, duplicate_captions=fraction)
                      for fraction in (0.0, 0.5)] for split, size in (("train", 600), ("val", 200))}
    for plain, half in splits.values():
        assert torch.equal(plain.images, half.images)  # only captions change
    kinds = coarse_kinds(*splits["train"])
    assert len(kinds) == round(0.5 * KINDS) == 15 and coarse_kinds(*splits["val"]) == kinds
    forms = {text for text in splits["train"][1].captions if " in the " not in text}
    # Each kind written in its 4 forms ("a red circle", "A red circle", "a red circle.", "A red circle."):
    every_form = {kind_caption(shape, colour, form) for shape in range(len(SHAPES)) for colour in range(len(COLOURS))
                  for form in range(4)}
    assert forms <= every_form and {words(text) for text in forms} == kinds and len(forms) > 3 * len(kinds)
    with pytest.raises(ValueError, match="duplicate_captions"):
        ShapesDataset("train", size=4, duplicate_captions=1.5)


def test_duplicate_captions_on_other_data_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "pairs.csv").write_text("filepath,title\na.png,one\nb.png,two\nc.png,three\n")
    for flags, cause in ((["--data", f"csv:{tmp_path / 'pairs.csv'}", "--duplicate-captions", "0.5"],
                          "--duplicate-captions changes the generated shapes' captions"),
                         (["--duplicate-captions", "2"], "expected a fraction in [0, 1], got 2.0")):
        result = run("clip.py", *flags, cwd=tmp_path, check=False, timeout=120)
        assert result.returncode != 0 and "Traceback" not in result.stderr
        assert cause in result.stderr.strip().splitlines()[-1], result.stderr
