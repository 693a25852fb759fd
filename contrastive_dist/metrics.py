"""In-batch retrieval accuracy over the global batch of every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from contrastive_dist._dist import GroupLike
from contrastive_dist._validation import check_pair, collect
from contrastive_dist.engine._agreement import agree
from contrastive_dist.engine._wire import all_reduce
from contrastive_dist.engine.gather import gather_agreed

__all__ = ["retrieval_accuracy"]

_ROWS_PER_BLOCK = 1024  # bounds the similarity block held at once to 1024 × N


@torch.no_grad()
def retrieval_accuracy(
    image_features: Tensor,
    text_features: Tensor,
    *,
    top_k: Sequence[int] = (1, 5),
    group: GroupLike = None,
    sizes: Sequence[int] | None = None,
) -> dict[str, Tensor]:
    """Top-k image→text and text→image accuracy among all ``N`` pairs of the global batch.

    Image ``i`` counts as retrieved at ``k`` when fewer than ``k`` texts of the global batch
    score strictly higher than its own text ``i`` (dot product: pass normalised features for
    cosine similarity); ties are resolved in the query's favour. Each rank scores its local
    rows against the gathered columns and one all-reduce sums the hit counts, so every rank
    returns the same values. Call it on every rank (it is collective).

    Args:
        image_features: this rank's image embeddings.
        text_features: this rank's text embeddings, row ``i`` paired with image row ``i``.
        top_k: the ``k`` values to report, positive ints.
        group: a process group or a device mesh, default the world ([group][option-group]).
        sizes: every rank's batch size, if known: skips the size exchange ([sizes][option-sizes]).

    Returns:
        ``{"image_to_text_r{k}": ..., "text_to_image_r{k}": ...}``: 0-d float tensors in
        ``[0, 1]``, fractions of the global batch (NaN when the global batch is empty).

    Shape:
        image_features, text_features: ``(n_r, D)``.

    Example:
        >>> import torch
        >>> from contrastive_dist import retrieval_accuracy
        >>> features = torch.eye(4)
        >>> accuracy = retrieval_accuracy(features, features, top_k=(1,))
        >>> accuracy["image_to_text_r1"].item(), accuracy["text_to_image_r1"].item()
        (1.0, 1.0)

    """

    def arguments() -> tuple[Tensor, Tensor, tuple[int, ...]]:
        images, texts = check_pair("image_features", image_features, "text_features", text_features)
        return images.detach(), texts.detach(), _check_top_k(top_k)

    checked, problem = collect(arguments)
    layout = agree((image_features, text_features), problem=problem, group=group, operation="retrieval_accuracy",
                   options={"top_k": top_k if checked is None else checked[2]}, sizes=sizes)
    image_features, text_features, ks = cast(tuple[Tensor, Tensor, tuple[int, ...]], checked)
    gathered = gather_agreed((image_features, text_features), layout)
    all_images, all_texts = gathered.tensors
    hits = torch.cat(
        (
            _hits(image_features, all_texts, gathered.offset, ks),
            _hits(text_features, all_images, gathered.offset, ks),
        )
    )
    if layout.world_size > 1:
        all_reduce(hits, layout.group, operation="retrieval_accuracy (sum of the hits)")
    accuracy = hits.to(torch.float64) / sum(gathered.sizes)
    names = [f"image_to_text_r{k}" for k in ks] + [f"text_to_image_r{k}" for k in ks]
    return {name: value.to(image_features.dtype) for name, value in zip(names, accuracy, strict=True)}


def _hits(queries: Tensor, keys: Tensor, offset: int, ks: tuple[int, ...]) -> Tensor:
    """For each ``k``: how many local queries have fewer than ``k`` keys scoring above their match."""
    hits = torch.zeros(len(ks), dtype=torch.int64, device=queries.device)
    bounds = torch.tensor(ks, device=queries.device)
    for start in range(0, queries.shape[0], _ROWS_PER_BLOCK):
        block = queries[start : start + _ROWS_PER_BLOCK]
        scores = block @ keys.T
        rows = torch.arange(block.shape[0], device=queries.device)
        matched = scores[rows, rows + offset + start]
        better = (scores > matched[:, None]).sum(dim=1)
        hits += (better[:, None] < bounds).sum(dim=0)
    return hits


def _check_top_k(top_k: object) -> tuple[int, ...]:
    if isinstance(top_k, int) or not isinstance(top_k, Sequence) or len(top_k) == 0:
        raise TypeError(f"top_k must be a non-empty sequence of positive ints, got {top_k!r}")
    if not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in top_k):
        raise ValueError(f"top_k must hold positive ints, got {tuple(top_k)}")
    return tuple(top_k)
