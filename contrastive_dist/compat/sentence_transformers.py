"""sentence-transformers' ``MultipleNegativesRankingLoss`` and its cached form, with the 6.3 signatures.

In a training script written for sentence-transformers, change one line::

    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss   # before
    from contrastive_dist.compat.sentence_transformers import MultipleNegativesRankingLoss  # after

(or ``CachedMultipleNegativesRankingLoss``, the same way). With ``gather_across_devices=True``
sentence-transformers offsets its labels by ``rank * batch_size`` and averages over the local
rows: it needs the same batch size on every rank (uneven ones pick wrong positives and raise or
hang in its gather), and DDP's average is the global gradient only for equal sizes. Here the loss
follows the [gradient contract][gradient-contract] for any per-rank sizes, 0 included, and the
cached form is [`grad_cache`][contrastive_dist.grad_cache]: one re-encode per mini-batch in the
ordinary backward, so DDP syncs each parameter once, with ``find_unused_parameters=True`` too (the
trainer's default), and a rank with fewer rows never calls the model on an empty mini-batch. Both
carry the originals' attributes (the options, ``temperature``, ``get_config_dict()``, ``citation``;
the cached one ``uses_gradient_cache``, ``calculate_loss`` and ``embed_minibatch``), so the model
card names the options and ``MatryoshkaLoss`` takes the cached drop-in as it takes the original.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from contrastive_dist.compat._groups import loss_group
from contrastive_dist.compat._ranking import RankingOptions, cos_sim, dot_score, ranking_loss
from contrastive_dist.compat._ranking_attributes import GRADIENT_CACHE_CITATION, RankingAttributes
from contrastive_dist.nn._ddp_forward import inside_forward
from contrastive_dist.nn.grad_cache import grad_cache

__all__ = ["CachedMultipleNegativesRankingLoss", "MultipleNegativesRankingLoss", "cos_sim", "dot_score"]


class _SentenceEmbedding(nn.Module):
    """The model's ``"sentence_embedding"`` for a batch of features: what the cached loss encodes."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: dict[str, Any]) -> Tensor:
        return self.model(features)["sentence_embedding"]


class MultipleNegativesRankingLoss(RankingAttributes):
    """Each anchor must rank its positive first among every candidate; sentence-transformers' signature.

    Same as sentence-transformers 6.3: the arguments (``directions``, ``partition_mode``,
    ``hardness_mode``, ``hardness_strength`` and their checks), ``forward(sentence_features, labels)``
    with columns (anchors, positives, any number of hard-negative columns), the value and gradients
    on one process, the attributes (``scale``, ``similarity_fct``, ... assignable; ``temperature``,
    ``get_config_dict()``, ``citation``). Each column is encoded by its own ``model(features)`` call
    (sentence-transformers merges the candidate columns into one call: the same result for a model
    without dropout).

    Different: ``gather_across_devices=True`` gives the loss of the global batch for any per-rank
    batch sizes, and every rank returns that loss (the one a trainer logs); ``False`` keeps each
    rank's batch alone, as the original does.

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
        >>> loss.get_config_dict()["directions"], loss.temperature
        (('query_to_doc', 'doc_to_query'), 0.05)
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
        self.options = RankingOptions(scale, similarity_fct, gather_across_devices, directions, partition_mode,
                                      hardness_mode, hardness_strength)

    def _ranking_options(self) -> RankingOptions:
        return self.options

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """The global loss of every rank's anchors against every rank's candidates; ``labels`` is unused."""
        return self.compute_loss_from_embeddings(
            [self.model(features)["sentence_embedding"] for features in sentence_features], labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None = None) -> Tensor:
        """The loss of the columns' embeddings ``(n_r, D)`` each (anchors, positives, hard negatives)."""
        return ranking_loss(embeddings, self.options, loss_group(self.options.gather_across_devices))


class CachedMultipleNegativesRankingLoss(RankingAttributes):
    """The same loss over embeddings encoded ``mini_batch_size`` rows at a time (GradCache), exact.

    Same as sentence-transformers 6.3: the arguments, ``forward``, the value and the gradients of
    its ``CachedMultipleNegativesRankingLoss``; each mini-batch is cut to the width its attention
    mask keeps, as there; the attributes (the options, delegated to the plain loss it holds as
    ``loss``, ``temperature``, ``get_config_dict()``, ``citation``, ``uses_gradient_cache``), and
    ``calculate_loss(reps, labels, with_backward=...)``, which ``MatryoshkaLoss`` wraps to add its
    truncated dimensions. ``show_progress_bar`` is accepted and unused; ``mini_batch_num_tokens``
    (mini-batches by token count) is refused unless ``None``: every rank must encode the same number
    of mini-batches for a collective inside the model.

    Different: the gradient cache is :func:`~contrastive_dist.grad_cache`, an autograd function:
    ``loss.backward()`` re-encodes inside the ordinary backward and every parameter receives its
    gradient once, so DDP (with ``find_unused_parameters=True`` too: a ``DistributedDataParallel``
    model runs one forward around the encodes), gradient accumulation and mixed precision work
    unchanged; a rank with fewer rows never calls the model on an empty mini-batch; with
    ``gather_across_devices=True`` the loss is exact for any per-rank batch sizes, and every rank
    returns it. ``AdaptiveLayerLoss`` warns that it is not compatible, as for the original.

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
        >>> loss.get_config_dict()["mini_batch_size"], loss.uses_gradient_cache
        (2, True)
    """

    uses_gradient_cache = True

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
        if mini_batch_num_tokens is not None and not mini_batch_num_tokens > 0:  # sentence-transformers' check
            raise ValueError(f"mini_batch_num_tokens must be a positive integer or None, got {mini_batch_num_tokens}")
        if mini_batch_num_tokens is not None:
            raise ValueError("mini_batch_num_tokens is not supported: every rank encodes the same number of "
                             f"mini-batches of mini_batch_size rows; got mini_batch_num_tokens={mini_batch_num_tokens}")
        self.model = model
        self.loss = MultipleNegativesRankingLoss(model, scale, similarity_fct, gather_across_devices, directions,
                                                 partition_mode, hardness_mode, hardness_strength)
        self.mini_batch_size, self.mini_batch_num_tokens = mini_batch_size, mini_batch_num_tokens
        self.show_progress_bar = show_progress_bar

    def _ranking_options(self) -> RankingOptions:
        return cast(MultipleNegativesRankingLoss, self.loss).options

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """The global loss of every rank's anchors against every rank's candidates; ``labels`` is unused."""
        features = list(sentence_features)
        if len(features) < 2:
            raise ValueError(f"expected at least 2 columns (anchors, positives), got {len(features)}")
        columns = self._encoded(features)
        if not torch.is_grad_enabled():
            return self.calculate_loss([[column] for column in columns], labels)
        # The loss against detached columns, its gradient taken here (calculate_loss may be wrapped by
        # MatryoshkaLoss, which adds its truncated dimensions' gradients); the ordinary backward then
        # carries that gradient into grad_cache, which re-encodes.
        leaves = [[column.detach().requires_grad_()] for column in columns]
        value = self.calculate_loss(leaves, labels, with_backward=True)
        grads = [leaf.grad for (leaf,) in leaves]
        unused = [str(index) for index, grad in enumerate(grads) if grad is None]
        if unused:
            raise ValueError(f"the loss did not use input column(s) {', '.join(unused)}: remove them from the dataset")
        linked = torch.stack([(column * cast(Tensor, grad)).sum() for column, grad in zip(columns, grads)]).sum()
        return value.detach() + (linked - linked.detach())  # the value, and the columns' cached gradient

    def calculate_loss(self, reps: list[list[Tensor]], labels: Tensor | None = None, *,
                       with_backward: bool = False) -> Tensor:
        """The loss of the columns' embeddings, each given in mini-batches; back-propagated with ``with_backward``.

        Shape:
            reps: per column, mini-batches ``(m, D)`` whose rows make ``(n_r, D)``; output: ``()``.
        """
        loss = cast(MultipleNegativesRankingLoss, self.loss).compute_loss_from_embeddings(
            [torch.cat(mini_batches) for mini_batches in reps], labels)
        if with_backward:
            loss.backward()
            return loss.detach()
        return loss

    def embed_minibatch(self, sentence_feature: dict[str, Tensor], begin: int, end: int, with_grad: bool,
                        copy_random_state: bool, random_state: object = None) -> tuple[Tensor, None]:
        """Rows ``begin:end`` encoded, with or without gradient; no random state (grad_cache replays its own)."""
        rows = {key: value[begin:end] if isinstance(value, Tensor) and value.ndim else value
                for key, value in sentence_feature.items()}
        with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
            return self.model(rows)["sentence_embedding"], None

    def get_config_dict(self) -> dict[str, Any]:
        """The options and the mini-batching, as sentence-transformers' model card lists them."""
        return {**super().get_config_dict(), "mini_batch_size": self.mini_batch_size,
                "mini_batch_num_tokens": self.mini_batch_num_tokens}

    @property
    def citation(self) -> str:
        """GradCache's paper, as BibTeX."""
        return GRADIENT_CACHE_CITATION

    def _encoded(self, features: list[dict[str, Tensor]]) -> list[Tensor]:
        """Every column through grad_cache; a ``DistributedDataParallel`` model runs one forward around them."""
        group = loss_group(self.gather_across_devices)

        def encode(model: nn.Module) -> tuple[Tensor, ...]:
            encoder = _SentenceEmbedding(model)
            return tuple(cast(Tensor, grad_cache(encoder, dict(column), mini_batch_size=self.mini_batch_size,
                                                 group=group, trim_padding=True)) for column in features)

        model = self.model
        return list(inside_forward(model, encode) if isinstance(model, DistributedDataParallel) else encode(model))
