"""sentence-transformers' multiple-negatives ranking loss over every rank's columns, exact under data parallelism.

The formula of ``MultipleNegativesRankingLoss``: each anchor (query) must pick its positive among
every candidate of the global batch (every positive and hard negative of every rank), with the
optional extra directions (query→query, doc→query, doc→doc), one softmax over them (``"joint"``)
or one per direction averaged (``"per_direction"``), and the optional hardness penalty. The
columns come from the package's differentiable gather, whose backward returns each row's gradient
summed over every rank to its owner; each rank's gradient is that of ``(W / N) · Σ ℓ_i`` over its own
rows, the [gradient contract][gradient-contract], and its value the global loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._agreement import Layout
from contrastive_dist.engine.gather import all_gather_many
from contrastive_dist.losses._frame import global_mean

__all__ = ["RankingOptions", "check_ranking_options", "cos_sim", "dot_score", "ranking_loss"]

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
HARDNESS = (None, "in_batch_negatives", "hard_negatives", "all_negatives")


def cos_sim(a: Tensor, b: Tensor) -> Tensor:
    """Cosine similarity of every row of ``a`` with every row of ``b`` (sentence-transformers' default).

    Shape:
        a: ``(n, D)``; b: ``(m, D)``; output: ``(n, m)``.

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.sentence_transformers import cos_sim
        >>> cos_sim(torch.tensor([[1.0, 0.0]]), torch.tensor([[2.0, 0.0], [0.0, 3.0]]))
        tensor([[1., 0.]])
    """
    return F.normalize(a, p=2, dim=1) @ F.normalize(b, p=2, dim=1).T


def dot_score(a: Tensor, b: Tensor) -> Tensor:
    """Dot product of every row of ``a`` with every row of ``b``.

    Shape:
        a: ``(n, D)``; b: ``(m, D)``; output: ``(n, m)``.

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.sentence_transformers import dot_score
        >>> dot_score(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0]]))
        tensor([[11.]])
    """
    return a @ b.T


class RankingOptions:
    """The options of the loss, checked once (``ValueError`` naming what is allowed)."""

    def __init__(
        self,
        scale: float,
        similarity_fct: Callable[[Tensor, Tensor], Tensor],
        gather_across_devices: bool,
        directions: Sequence[str],
        partition_mode: str,
        hardness_mode: str | None,
        hardness_strength: float,
    ) -> None:
        check_ranking_options(scale, directions, partition_mode, hardness_mode, hardness_strength)
        self.scale, self.similarity_fct, self.directions = float(scale), similarity_fct, tuple(directions)
        self.gather_across_devices = gather_across_devices
        self.partition_mode, self.hardness_mode = partition_mode, hardness_mode
        self.hardness_strength = hardness_strength


def check_ranking_options(
    scale: float, directions: Sequence[str], partition_mode: str, hardness_mode: str | None, hardness_strength: float
) -> None:
    """Raise ``ValueError`` for an option sentence-transformers refuses, saying what is allowed."""
    if not scale > 0:
        raise ValueError(f"Scale must be a positive value, got {scale}")  # sentence-transformers' words
    if not directions or not set(directions) <= set(DIRECTIONS) or "query_to_doc" not in directions:
        raise ValueError(f"directions must be a non-empty tuple of {DIRECTIONS} holding 'query_to_doc', got "
                         f"{directions!r}")
    if partition_mode not in ("joint", "per_direction"):
        raise ValueError(f"partition_mode must be 'joint' or 'per_direction', got {partition_mode!r}")
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        raise ValueError("partition_mode='per_direction' needs every direction to hold the positive pair; "
                         f"'query_to_query' and 'doc_to_doc' do not, got directions={directions!r}")
    if hardness_mode not in HARDNESS:
        raise ValueError(f"hardness_mode must be one of {HARDNESS}, got {hardness_mode!r}")
    if not hardness_strength >= 0:
        raise ValueError(f"hardness_strength must be >= 0, got {hardness_strength}")


def ranking_loss(columns: Sequence[Tensor], options: RankingOptions, group: ProcessGroup | None = None) -> Tensor:
    """The global ranking loss of ``columns`` = (anchors, positives, *hard negatives); gradient: this rank's share.

    Shape:
        columns: ``(n_r, D)`` each (at least two); output: ``()``.
    """
    if len(columns) < 2:
        raise ValueError(f"expected at least 2 columns (anchors, positives), got {len(columns)}")
    gathered = all_gather_many(list(columns), group=group)
    queries, *docs = gathered.tensors
    total, start, rows = queries.shape[0], gathered.offset, gathered.sizes[gathered.rank]
    own = torch.arange(start, start + rows, device=queries.device)
    local = torch.arange(rows, device=queries.device)
    docs_all = torch.cat(docs)
    local_queries, local_docs = queries[own], docs[0][own]
    similarity = options.similarity_fct
    # own_column[i, j]: column j (of the first N) is row i's own sample; repeated over the doc columns.
    own_column = torch.zeros(rows, total, dtype=torch.bool, device=queries.device)
    own_column[local, own] = True
    own_docs = own_column.repeat(1, len(docs))
    scores = {"query_to_doc": similarity(local_queries, docs_all)}
    if "query_to_query" in options.directions:
        scores["query_to_query"] = similarity(local_queries, queries).masked_fill(own_column, -torch.inf)
    if "doc_to_query" in options.directions:
        scores["doc_to_query"] = similarity(queries, local_docs).T
    if "doc_to_doc" in options.directions:
        scores["doc_to_doc"] = similarity(docs_all, local_docs).T.masked_fill(own_docs, -torch.inf)
    penalty = _hardness_penalty(scores["query_to_doc"], own_docs, total, options)
    scores = {key: value * options.scale for key, value in scores.items()}
    if penalty is not None:
        scores["query_to_doc"] = scores["query_to_doc"] + penalty
    positive = scores["query_to_doc"][local, own]
    if options.partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(scores.values()), dim=1), dim=1)
    else:
        log_z = torch.stack([torch.logsumexp(value, dim=1) for value in scores.values()]).mean(0)
    layout = Layout(gathered.rank, len(gathered.sizes), gathered.sizes, (0,) * len(gathered.sizes), None, group)
    return global_mean((log_z - positive).sum(), layout, total)


def _hardness_penalty(query_to_doc: Tensor, own_docs: Tensor, total: int, options: RankingOptions) -> Tensor | None:
    """Lan et al. 2025's stop-gradient penalty ``α · sim`` on the negatives the mode names, else ``None``."""
    if options.hardness_mode is None or options.hardness_strength == 0:
        return None
    excluded = own_docs.clone()  # in_batch_negatives: a row's own positive and hard negatives are left out
    if options.hardness_mode == "hard_negatives":
        excluded = ~own_docs
        excluded[:, :total] = True
    elif options.hardness_mode == "all_negatives":
        excluded[:, total:] = False
    return (options.hardness_strength * query_to_doc.detach()).masked_fill(excluded, 0.0)
