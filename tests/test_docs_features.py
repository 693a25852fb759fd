"""The guides' snippets (negatives, the queue, weights, sample ids, the gradient cache) do what they say.

``test_docs_snippets`` runs every block; here the claims in their comments are checked, in one process.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from doc_blocks import DOCS, Block, python_blocks, run_in_process

from contrastive_dist import info_nce

NEGATIVES = DOCS / "guides" / "negatives-weights-ids.md"
OPTIONS = DOCS / "guides" / "options.md"
GRAD_CACHE = DOCS / "guides" / "grad-cache.md"


def block_with(page, text: str) -> Block:
    (block,) = [block for block in python_blocks(page) if text in block.code]
    return block


def run(block: Block) -> dict[str, Any]:
    assert len(block.code.strip().splitlines()) <= 15, f"{block.where}: a guide's snippet stays short"
    namespace: dict[str, Any] = {}
    run_in_process(block, namespace)
    loss = namespace["loss"]
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.grad_fn is not None
    return namespace


@pytest.mark.parametrize("text", ["negatives=hard_negatives", "negative_ids=mined_ids", "queue.enqueue(keys)"])
def test_negatives_and_queue_snippets_run_and_end_in_backward(text: str) -> None:
    block = block_with(NEGATIVES, text)
    assert block.code.strip().splitlines()[-1].strip().startswith(("loss.backward()", "queue.enqueue"))
    namespace = run(block)
    if "queue" in namespace:
        assert len(namespace["queue"]) == 3 * 32


def test_weights_snippet_gives_the_weighted_mean_of_the_rows() -> None:
    namespace = run(block_with(OPTIONS, 'reduction="none"'))
    rows, weight = namespace["rows"], namespace["weight"]
    torch.testing.assert_close(namespace["loss"], (weight * rows).sum() / weight.sum())  # the snippet's comment


def test_ids_snippet_masks_and_counts_duplicates_as_positives() -> None:
    namespace = run(block_with(OPTIONS, 'same_id="positive"'))
    images, texts, captions = namespace["images"], namespace["texts"], namespace["captions"]
    assert not torch.equal(namespace["masked"], info_nce(images, texts, 10.0))  # the duplicates changed the loss
    torch.testing.assert_close(namespace["masked"], info_nce(images, texts, 10.0, ids=captions))


def test_grad_cache_snippet_matches_encoding_the_whole_batch() -> None:
    namespace = run(block_with(GRAD_CACHE, "grad_cache("))
    towers = namespace["image_tower"], namespace["text_tower"]
    cached = [p.grad.clone() for tower in towers for p in tower.parameters()]
    for tower in towers:
        tower.zero_grad()
    image, text = (F.normalize(tower(x), dim=-1) for tower, x in zip(towers, (namespace["images"], namespace["texts"])))
    info_nce(image, text, 10.0, chunk_size=256).backward()
    for got, parameter in zip(cached, (p for tower in towers for p in tower.parameters())):
        torch.testing.assert_close(got, parameter.grad, rtol=1e-5, atol=1e-6)
