"""sentence-transformers' ``MultipleNegativesRankingLoss`` and its cached form, with the 6.2 signatures.

In a training script written for sentence-transformers, change one line::

    from sentence_transformers.losses import MultipleNegativesRankingLoss   # before
    from contrastive_dist.compat.sentence_transformers import MultipleNegativesRankingLoss  # after

(or ``CachedMultipleNegativesRankingLoss``, the same way). With ``gather_across_devices=True``
sentence-transformers offsets its labels by ``rank * batch_size`` and averages over the local
rows: it needs the same batch size on every rank (uneven ones pick wrong positives and raise or
hang in its gather), and DDP's average is the global gradient only for equal sizes. Here the loss
follows the [gradient contract][gradient-contract] for any per-rank sizes, 0 included, and the
cached form is [`grad_cache`][contrastive_dist.grad_cache]: one re-encode per mini-batch in the
ordinary backward, so DDP syncs each parameter once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist.compat._groups import loss_group
from contrastive_dist.compat._ranking import RankingOptions, ranking_loss
from contrastive_dist.nn.grad_cache import grad_cache

__all__ = ["CachedMultipleNegativesRankingLoss", "MultipleNegativesRankingLoss", "cos_sim", "dot_score"]


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


class _SentenceEmbedding(nn.Module):
    """The model's ``"sentence_embedding"`` for a batch of features: what the cached loss encodes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: dict[str, Any]) -> Tensor:
        return self.model(features)["sentence_embedding"]


class MultipleNegativesRankingLoss(nn.Module):
    """Each anchor must rank its positive first among every candidate; sentence-transformers' signature.

    Same as sentence-transformers 6.2: the arguments (``directions``, ``partition_mode``,
    ``hardness_mode``, ``hardness_strength`` and their checks), ``forward(sentence_features, labels)``
    with columns (anchors, positives, any number of hard-negative columns), the value and gradients
    on one process. Each column is encoded by its own ``model(features)`` call (sentence-transformers
    merges the candidate columns into one call: the same result for a model without dropout).

    Different: ``gather_across_devices=True`` gives the loss of the global batch for any per-rank
    batch sizes; ``False`` keeps each rank's batch alone, as the original does.

    One line to change: ``from contrastive_dist.compat.sentence_transformers import MultipleNegativesRankingLoss``.

    Args:
        model: the encoder: ``model(features)["sentence_embedding"]`` for a batch of features.
        scale: the logits' multiplier (1 / temperature), > 0.
        similarity_fct: ``(n, D), (m, D) -> (n, m)``; default :func:`cos_sim`.
        gather_across_devices: the global batch's candidates, or each rank's own.
        directions: ``"query_to_doc"`` plus any of ``"query_to_query"``, ``"doc_to_query"``, ``"doc_to_doc"``.
        partition_mode: ``"joint"`` (one softmax over every direction) or ``"per_direction"``.
        hardness_mode: ``None``, ``"in_batch_negatives"``, ``"hard_negatives"`` or ``"all_negatives"``.
        hardness_strength: the weight ``α`` of the hardness penalty, ≥ 0.

    Shape:
        each column's ``"sentence_embedding"``: ``(n_r, D)``; output: ``()``.

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.sentence_transformers import MultipleNegativesRankingLoss
        >>> embed = torch.nn.EmbeddingBag(50, 8)
        >>> class Encoder(torch.nn.Module):  # the model's interface: features in, a dict out
        ...     def forward(self, features):
        ...         return {"sentence_embedding": embed(features["input_ids"])}
        >>> model = Encoder()
        >>> anchors, positives = {"input_ids": torch.randint(50, (4, 6))}, {"input_ids": torch.randint(50, (4, 6))}
        >>> loss = MultipleNegativesRankingLoss(model, directions=("query_to_doc", "doc_to_query"))
        >>> loss([anchors, positives], torch.zeros(4)).backward()
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        gather_across_devices: bool = False,
        directions: Sequence[str] = ("query_to_doc",),
        partition_mode: str = "joint",
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
    ) -> None:
        super().__init__()
        self.model = model
        self.options = RankingOptions(scale, similarity_fct, directions, partition_mode, hardness_mode,
                                      hardness_strength)
        self.gather_across_devices = gather_across_devices

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """The loss of this rank's anchors against every rank's candidates; ``labels`` is unused."""
        columns = [self.model(features)["sentence_embedding"] for features in sentence_features]
        return ranking_loss(columns, self.options, loss_group(self.gather_across_devices))


class CachedMultipleNegativesRankingLoss(nn.Module):
    """The same loss over embeddings encoded ``mini_batch_size`` rows at a time (GradCache), exact.

    Same as sentence-transformers 6.2: the arguments, ``forward``, the value and the gradients of
    its ``CachedMultipleNegativesRankingLoss``; each mini-batch is cut to the width its attention
    mask keeps, as there. ``show_progress_bar`` is accepted and unused; ``mini_batch_num_tokens``
    (mini-batches by token count) is refused unless ``None``: every rank must encode the same number
    of mini-batches for a collective inside the model.

    Different: the gradient cache is :func:`~contrastive_dist.grad_cache`, an autograd function:
    ``loss.backward()`` re-encodes inside the ordinary backward and every parameter receives its
    gradient once, so DDP, gradient accumulation and mixed precision work unchanged; with
    ``gather_across_devices=True`` the loss is exact for any per-rank batch sizes.

    One line to change:
    ``from contrastive_dist.compat.sentence_transformers import CachedMultipleNegativesRankingLoss``.

    Args:
        model: the encoder, as for :class:`MultipleNegativesRankingLoss`.
        scale: as for :class:`MultipleNegativesRankingLoss`.
        similarity_fct: as for :class:`MultipleNegativesRankingLoss`.
        mini_batch_size: rows encoded at a time.
        mini_batch_num_tokens: must be ``None``.
        gather_across_devices: as for :class:`MultipleNegativesRankingLoss`.
        directions: as for :class:`MultipleNegativesRankingLoss`.
        partition_mode: as for :class:`MultipleNegativesRankingLoss`.
        show_progress_bar: accepted, unused.
        hardness_mode: as for :class:`MultipleNegativesRankingLoss`.
        hardness_strength: as for :class:`MultipleNegativesRankingLoss`.

    Shape:
        each column's ``"sentence_embedding"``: ``(n_r, D)``; output: ``()``.

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.sentence_transformers import CachedMultipleNegativesRankingLoss
        >>> class Encoder(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = torch.nn.EmbeddingBag(50, 8)
        ...     def forward(self, features):
        ...         return {"sentence_embedding": self.embed(features["input_ids"])}
        >>> loss = CachedMultipleNegativesRankingLoss(Encoder(), mini_batch_size=2)
        >>> columns = [{"input_ids": torch.randint(50, (5, 6))} for _ in range(3)]  # anchors, positives, negatives
        >>> loss(columns, torch.zeros(5)).backward()  # 3 encodes per column, none keeps activations
    """

    def __init__(
        self,
        model: nn.Module,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = cos_sim,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        gather_across_devices: bool = False,
        directions: Sequence[str] = ("query_to_doc",),
        partition_mode: str = "joint",
        show_progress_bar: bool = False,
        hardness_mode: str | None = None,
        hardness_strength: float = 0.0,
    ) -> None:
        super().__init__()
        if mini_batch_num_tokens is not None:
            raise ValueError("mini_batch_num_tokens is not supported: every rank encodes the same number of "
                             f"mini-batches of mini_batch_size rows; got mini_batch_num_tokens={mini_batch_num_tokens}")
        self.model = model
        self.options = RankingOptions(scale, similarity_fct, directions, partition_mode, hardness_mode,
                                      hardness_strength)
        self.mini_batch_size, self.gather_across_devices = mini_batch_size, gather_across_devices
        self.show_progress_bar = show_progress_bar

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """The loss of this rank's anchors against every rank's candidates; ``labels`` is unused."""
        group = loss_group(self.gather_across_devices)
        encoder = _SentenceEmbedding(self.model)
        columns = [grad_cache(encoder, dict(features), mini_batch_size=self.mini_batch_size, group=group,
                              trim_padding=True) for features in sentence_features]
        return ranking_loss([column for column in columns if isinstance(column, Tensor)], self.options, group)
