"""The cached drop-in against sentence-transformers' own CachedMultipleNegativesRankingLoss on a tiny BERT.

The model is built here, offline (``tests/tiny_bert.py``): a random-init one-layer ``BertModel`` and a
word-level tokenizer from a small vocabulary, loaded through sentence-transformers' ``Transformer`` and
``Pooling`` modules. Texts of different lengths, so that each mini-batch is cut
to its own width (as sentence-transformers does). Also ``grad_cache`` on the bare Hugging Face model:
keyword inputs, a dict output, equal to the plain full batch in float64.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")
pytest.importorskip("transformers")

from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses as st_losses  # noqa: E402
from tiny_bert import TEXTS, save_tiny_bert, sentence_model  # noqa: E402
from transformers import BertModel, PreTrainedTokenizerFast  # noqa: E402

from contrastive_dist import grad_cache  # noqa: E402
from contrastive_dist.compat.sentence_transformers import CachedMultipleNegativesRankingLoss  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="module", name="sentence_model")
def double_sentence_model(tiny_model_path: Path) -> SentenceTransformer:
    return sentence_model(tiny_model_path).double()  # type: ignore[attr-defined,no-any-return]


@pytest.mark.parametrize(("mini_batch_size", "directions"), [
    (1, ("query_to_doc",)), (3, ("query_to_doc", "doc_to_query", "query_to_query", "doc_to_doc")),
    (32, ("query_to_doc", "doc_to_query"))])
def test_cached_drop_in_equals_sentence_transformers_cached_loss(
    sentence_model: SentenceTransformer, mini_batch_size: int, directions: tuple[str, ...]
) -> None:
    assert_the_drop_in_gives_the_originals(
        sentence_model, lambda cls, model: cls(model, mini_batch_size=mini_batch_size, directions=directions))


def assert_the_drop_in_gives_the_originals(
    sentence_model: SentenceTransformer, make: Callable[[type, SentenceTransformer], torch.nn.Module]
) -> None:
    """``make(cls, model)`` with the original cached loss, then the drop-in: the same value and gradients."""
    results = []
    for cls in (st_losses.CachedMultipleNegativesRankingLoss, CachedMultipleNegativesRankingLoss):
        model = copy.deepcopy(sentence_model)
        loss = make(cls, model)
        columns = [model.preprocess(TEXTS), model.preprocess(TEXTS[::-1]), model.preprocess(TEXTS[1:] + TEXTS[:1])]
        value = loss(columns, torch.zeros(len(TEXTS)))
        value.backward()
        results.append((value.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                                          if p.grad is not None}))
    (expected, expected_grads), (actual, grads) = results
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    assert grads.keys() == expected_grads.keys() and len(grads) > 10
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_grad_cache_of_a_hugging_face_model_with_keywords_equals_the_full_batch(tiny_model_path: Path) -> None:
    bert = BertModel.from_pretrained(str(tiny_model_path)).double()
    batch = PreTrainedTokenizerFast.from_pretrained(str(tiny_model_path))(TEXTS, padding=True, return_tensors="pt")
    upstream = torch.randn(len(TEXTS), batch["input_ids"].shape[1], 16, dtype=torch.float64)
    cached = grad_cache(bert, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], mini_batch_size=3)
    assert isinstance(cached, dict) and "last_hidden_state" in cached
    cached_grads = torch.autograd.grad((cached["last_hidden_state"] * upstream).sum(), list(bert.parameters()),
                                       allow_unused=True)
    plain = bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    plain_grads = torch.autograd.grad((plain["last_hidden_state"] * upstream).sum(), list(bert.parameters()),
                                      allow_unused=True)
    torch.testing.assert_close(cached["last_hidden_state"], plain["last_hidden_state"], rtol=1e-12, atol=1e-12)
    for cached_grad, plain_grad, parameter in zip(cached_grads, plain_grads, bert.parameters()):
        # The pooler is unused by this objective: no gradient in the plain run, a zero one through the cache.
        zero = torch.zeros_like(parameter)
        torch.testing.assert_close(zero if cached_grad is None else cached_grad,
                                   zero if plain_grad is None else plain_grad, rtol=1e-10, atol=1e-12)


ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
CONFIGS = [{}, {"scale": 42.0, "directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction",
                "hardness_mode": "in_batch_negatives", "hardness_strength": 9.0},
           {"directions": ALL_DIRECTIONS, "gather_across_devices": True}]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("cached", [False, True])
def test_drop_ins_carry_the_originals_attributes(
    sentence_model: SentenceTransformer, config: dict, cached: bool
) -> None:
    from sentence_transformers.util import cos_sim

    from contrastive_dist.compat import sentence_transformers as drop_ins

    name = "CachedMultipleNegativesRankingLoss" if cached else "MultipleNegativesRankingLoss"
    more = {"mini_batch_size": 4} if cached else {}
    original = getattr(st_losses, name)(sentence_model, **config, **more)
    ours = getattr(drop_ins, name)(sentence_model, **config, **more)
    assert ours.get_config_dict() == original.get_config_dict()  # what the saved model card lists
    for field in ("title", "eprint", "primaryClass"):  # the same paper in the BibTeX entry
        pattern = field + r"=\{([^}]*)\}"
        assert re.findall(pattern, ours.citation) == re.findall(pattern, original.citation), field
    assert ours.temperature == pytest.approx(original.temperature)
    for attribute in ("scale", "gather_across_devices", "directions", "partition_mode", "hardness_mode",
                      "hardness_strength", "uses_gradient_cache", "mini_batch_size", "mini_batch_num_tokens"):
        assert getattr(ours, attribute, None) == getattr(original, attribute, None), attribute
    ours.scale, ours.similarity_fct = 5.0, torch.nn.CosineSimilarity(dim=-1)  # assignable, as there
    assert (ours.scale, ours.temperature, ours.get_config_dict()["similarity_fct"]) == (5.0, 0.2, "CosineSimilarity")
    assert "similarity_fct" not in ours._modules
    if cached:
        assert ours.loss.scale == 5.0 and callable(ours.calculate_loss) and callable(ours.embed_minibatch)
    ours.similarity_fct = cos_sim  # the original's own function: the same name in the config
    assert ours.get_config_dict()["similarity_fct"] == "cos_sim"


def test_matryoshka_takes_the_cached_drop_in_and_adaptive_layer_warns_as_for_the_original(
    sentence_model: SentenceTransformer,
) -> None:
    assert_the_drop_in_gives_the_originals(sentence_model, lambda cls, model: st_losses.MatryoshkaLoss(
        model, cls(model, mini_batch_size=3), matryoshka_dims=[16, 8, 4]))
    with pytest.warns(UserWarning, match="AdaptiveLayerLoss is not compatible with CachedMultipleNegativesRankingLoss"):
        st_losses.AdaptiveLayerLoss(sentence_model, CachedMultipleNegativesRankingLoss(sentence_model))
