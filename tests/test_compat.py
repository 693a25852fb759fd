"""Each drop-in of ``contrastive_dist.compat`` equals its original on one process, over the original's options.

Values and gradients (encoder weights, ``logit_scale``, ``logit_bias``) within 1e-6 in float32 and
1e-12 in float64, on the same inputs; the lightly memory bank over four steps (it wraps around).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from compat_cases import WIDTH, loss_and_grads, make, problem, squared_distance, tolerance

from contrastive_dist.compat.lightly import NTXentLoss
from contrastive_dist.compat.open_clip import ClipLoss, SigLipLoss
from contrastive_dist.compat.sentence_transformers import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

DTYPES = (torch.float32, torch.float64)
FLAGS = (False, True)
CLIP = [dict(local_loss=a, gather_with_grad=b, cache_labels=c) for a, b, c in itertools.product(FLAGS, repeat=3)]
SIGLIP = [dict(dist_impl=d, cache_labels=c) for d in (None, "bidir", "shift", "reduce", "gather") for c in FLAGS]
NTXENT = [dict(temperature=t, memory_bank_size=m, gather_distributed=g)
          for t in (0.1, 0.5) for m in (0, (16, WIDTH)) for g in (False, True)]
DCL = [("dcl", dict(temperature=t, weight_fn=w, gather_distributed=g))
       for t in (0.1, 0.5) for w in (None, squared_distance) for g in FLAGS]
DCL += [("dclw", dict(temperature=t, sigma=s, gather_distributed=g))
        for t in (0.1, 0.5) for s in (0.5, 1.0) for g in FLAGS]
DIRECTIONS = [("query_to_doc",), ("query_to_doc", "doc_to_query"), ("query_to_doc", "query_to_query"),
              ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")]
MNRL = [dict(directions=d, partition_mode=p, similarity_fct=s)
        for d in DIRECTIONS for p in ("joint", "per_direction") for s in ("cos_sim", "dot_score")
        if not (p == "per_direction" and set(d) & {"query_to_query", "doc_to_doc"})]
MNRL += [dict(hardness_mode=h, hardness_strength=0.5, gather_across_devices=True)
         for h in ("in_batch_negatives", "hard_negatives", "all_negatives")]
CASES = ([("clip", o) for o in CLIP] + [("siglip", o) for o in SIGLIP] + [("ntxent", o) for o in NTXENT] + DCL
         + [("mnrl", o) for o in MNRL] + [("cached_mnrl", {**o, "mini_batch_size": m})
                                           for o, m in zip(MNRL[::3], itertools.cycle((1, 3, 32)))])


def _id(case: tuple[str, dict[str, Any]]) -> str:
    return case[0] + "-" + "-".join(f"{k}={getattr(v, '__name__', v)}" for k, v in case[1].items())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_value_and_gradients_equal_the_original(case: tuple[str, dict[str, Any]], dtype: torch.dtype) -> None:
    kind, options = case
    columns = 3 if kind in ("mnrl", "cached_mnrl") else 2  # anchors, positives, one hard-negative column
    data = problem(8, dtype, columns=columns)
    steps = 4 if kind == "ntxent" else 1
    results = []
    for which in ("original", "compat"):
        torch.manual_seed(7)  # lightly draws its initial bank from the global stream; so does the drop-in
        loss = make(kind, which, options, data).to(dtype)
        results.append(loss_and_grads(kind, loss, data, 0, 8, steps=steps, output_dict=kind in ("clip", "siglip")))
    (expected_values, expected_grads), (values, grads) = results
    for actual, expected in zip(values, expected_values):
        torch.testing.assert_close(actual, expected, **tolerance(dtype, expected))
    assert expected_grads.keys() == grads.keys()
    for name in grads:
        expected = expected_grads[name]
        message = lambda text, name=name: f"{name}: {text}"  # noqa: E731
        torch.testing.assert_close(grads[name], expected, **tolerance(dtype, expected), msg=message)


def test_clip_output_dict_and_bias_are_open_clips() -> None:
    images, texts = torch.randn(3, 4), torch.randn(3, 4)
    bias = torch.tensor(2.0, requires_grad=True)
    out = ClipLoss()(images, texts, 5.0, bias, output_dict=True)
    assert list(out) == ["contrastive_loss"]
    out["contrastive_loss"].backward()
    assert bias.grad is not None and float(bias.grad) == 0.0  # a softmax ignores a constant shift


@pytest.mark.parametrize(("make_loss", "message"), [
    (lambda: ClipLoss(use_horovod=True), "use_horovod=True is not supported"),
    (lambda: SigLipLoss(dist_impl="ring"), "dist_impl must be one of"),
    (lambda: NTXentLoss(temperature=0.0), "temperature must be > 0, got 0.0"),
    (lambda: NTXentLoss(memory_bank_size=16), r"memory_bank_size must be 0 \(no bank\) or a \(num_features, dim\)"),
    (lambda: NTXentLoss(memory_bank_size=(-1, 4)), "non-negative entries"),
    (lambda: MultipleNegativesRankingLoss(torch.nn.Identity(), scale=0.0), "Scale must be a positive value, got 0.0"),
    (lambda: MultipleNegativesRankingLoss(torch.nn.Identity(), directions=("doc_to_query",)), "'query_to_doc'"),
    (lambda: MultipleNegativesRankingLoss(torch.nn.Identity(), directions=("query_to_doc", "doc_to_doc"),
                                          partition_mode="per_direction"), "needs every direction"),
    (lambda: MultipleNegativesRankingLoss(torch.nn.Identity(), hardness_mode="hard"), "hardness_mode must be"),
    (lambda: CachedMultipleNegativesRankingLoss(torch.nn.Identity(), mini_batch_num_tokens=100),
     "mini_batch_num_tokens is not supported"),
    (lambda: CachedMultipleNegativesRankingLoss(torch.nn.Identity(), mini_batch_num_tokens=0),
     "mini_batch_num_tokens must be a positive integer or None, got 0"),
])
def test_options_that_would_change_the_result_are_refused(make_loss: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_loss()


def test_lightly_negative_mises_fisher_weights_are_lightlys() -> None:
    from lightly.loss.dcl_loss import negative_mises_fisher_weights as original

    from contrastive_dist.compat.lightly import negative_mises_fisher_weights

    torch.manual_seed(0)
    out0, out1 = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    for sigma in (1e-7, 0.5, 1e4):
        torch.testing.assert_close(negative_mises_fisher_weights(out0, out1, sigma), original(out0, out1, sigma),
                                   rtol=1e-12, atol=1e-12)


def test_install_makes_open_clips_factory_build_the_drop_ins_and_refuses_coca_and_distillation() -> None:
    from argparse import Namespace

    import open_clip

    from contrastive_dist.compat import open_clip as drop_ins

    def args(**flags: object) -> Namespace:  # what open_clip_train's flags give create_loss
        defaults = {"distill": False, "model": "ViT-B-32", "siglip": False, "local_loss": False,
                    "gather_with_grad": False, "rank": 0, "world_size": 1, "horovod": False, "loss_dist_impl": None,
                    "coca_caption_loss_weight": 2.0, "coca_contrastive_loss_weight": 1.0}
        return Namespace(**{**defaults, **flags})

    originals = (open_clip.factory.ClipLoss, open_clip.factory.SigLipLoss)
    assert type(open_clip.create_loss(args())) is originals[0]  # the one-line import change does not reach it
    drop_ins.install()
    drop_ins.install()  # idempotent: uninstall still restores open_clip's own classes
    try:
        assert type(open_clip.create_loss(args(local_loss=True, gather_with_grad=True))) is drop_ins.ClipLoss
        assert type(open_clip.create_loss(args(siglip=True))) is drop_ins.SigLipLoss
        for flags, name in (({"model": "coca_ViT-B-32"}, "CoCaLoss"), ({"distill": True}, "DistillClipLoss")):
            with pytest.raises(ValueError, match=f"open_clip's {name} .* has no exact drop-in in contrastive_dist"):
                open_clip.create_loss(args(**flags))
    finally:
        drop_ins.uninstall()
    assert (open_clip.factory.ClipLoss, open_clip.factory.SigLipLoss) == originals
    assert type(open_clip.create_loss(args(model="coca_ViT-B-32"))).__name__ == "CoCaLoss"


def test_importing_the_drop_ins_and_the_launcher_imports_none_of_the_originals() -> None:
    import subprocess
    import sys

    code = ("import sys, contrastive_dist.compat, contrastive_dist.compat.open_clip_train, "
            "contrastive_dist.compat.siglip_kernel; print(sorted(m for m in ('open_clip', 'open_clip_train', "
            "'lightly', 'sentence_transformers', 'siglip_kernel') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
