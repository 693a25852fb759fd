"""Supervised contrastive loss over the global batch of every rank (Khosla et al., 2020)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from einops import rearrange
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import get_world_size
from contrastive_dist.gather import all_gather_many
from contrastive_dist.losses._checks import (
    check_chunk_size,
    check_features,
    check_temperature,
    resolve_scale,
    validated_on_all_ranks,
)
from contrastive_dist.losses._chunked import full_precision, local_cross_entropy_sum, upcast
from contrastive_dist.losses._module import TemperatureLoss

__all__ = ["SupConLoss", "supcon"]


def supcon(
    features: Tensor,
    labels: Tensor,
    logit_scale: Tensor | float | None = None,
    *,
    temperature: float = 0.1,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
) -> Tensor:
    """SupCon (``L_out``, all views as anchors) over the global batch; exact under data parallelism.

    Every embedding of the global batch (``N`` samples × ``V`` views) is an anchor ``a``. Its
    positives ``P(a)`` are the other embeddings with the same label (other views of the same
    sample included), its candidates every embedding but itself::

        ℓ_a = logsumexp_{j ≠ a}(f_a·f_j / τ) − (1/|P(a)|) Σ_{p ∈ P(a)} f_a·f_p / τ

    **Normalisation.** Anchors without positives (a label seen once, single view) contribute
    nothing; the loss is the mean of ``ℓ_a`` over the ``A`` anchors of the global batch that
    have positives, and 0 (still in the graph) when ``A = 0`` — never NaN. ``A`` comes from the
    gathered labels, so each rank returns ``(W / A) · Σ_{its anchors with positives} ℓ_a`` and
    the mean over ranks is the single-process loss, for any per-rank batch sizes (including 0).

    Features are used as given: L2-normalise them in the model, as in the paper. Labels are
    gathered with the features (no gradient); the positive sums use per-class sums of the
    gathered embeddings, so no ``N × N`` mask is built.

    Args:
        features: this rank's embeddings, one view ``(n_r, D)`` or several ``(n_r, V, D)``.
        labels: integer class of each sample (shared by its views).
        logit_scale: multiplies the similarities, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``); receives gradients. Default ``1 / temperature``.
        temperature: divides the similarities when ``logit_scale`` is ``None``; > 0.
        chunk_size: anchors per block (at most ``chunk_size × N·V`` logits at once); same result.
        group: the process group (default: the world).
        sizes: every rank's batch size ``n_r``, if known (skips the size exchange).

    Returns:
        A scalar tensor: this rank's share of the global loss, float32 (float64 for float64
        features): the core runs in float32 with autocast off; gradients come back in the
        features' dtype.

    Shape:
        features: ``(n_r, D)`` or ``(n_r, V, D)``; labels: ``(n_r,)``; logit_scale: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import supcon
        >>> features = F.normalize(torch.randn(6, 2, 8), dim=-1).requires_grad_()
        >>> labels = torch.tensor([0, 1, 0, 2, 1, 3])
        >>> supcon(features, labels, temperature=0.1).backward()
        >>> features.grad.shape
        torch.Size([6, 2, 8])

    """
    with validated_on_all_ranks((features, labels), group=group, sizes=sizes):
        features = check_features("features", features, ndims=(2, 3))
        _check_labels(labels, features.shape[0])
        scale = resolve_scale(logit_scale, check_temperature(temperature), features)
        chunk_size = check_chunk_size(chunk_size)
    gathered = all_gather_many((features, labels), group=group, sizes=sizes)
    all_features, all_labels = gathered.tensors
    views = 1 if features.ndim == 2 else features.shape[1]
    dim = features.shape[-1]
    classes, key_class = torch.unique(all_labels.repeat_interleave(views), return_inverse=True)
    class_counts = torch.bincount(key_class, minlength=classes.numel())
    positives_per_key = class_counts[key_class] - 1
    anchors_with_positives = (positives_per_key > 0).sum()
    first_local_key = gathered.offset * views
    with full_precision(features.device):
        # One row per embedding, sample-major: the embedding (sample s, view v) is row s·V + v.
        # In the core's dtype from here on: the class sums add up many embeddings.
        keys = upcast(rearrange(all_features, "n ... d -> (n ...) d"))
        queries = upcast(rearrange(features, "n ... d -> (n ...) d"))
        local_positives = positives_per_key[first_local_key : first_local_key + queries.shape[0]]
        if torch.compiler.is_compiling():
            anchor_rows, queries, without_positives = _every_row_an_anchor(queries, local_positives, keys.shape[0])
        else:
            anchor_rows, without_positives = torch.nonzero(local_positives > 0).flatten(), None
        anchor_keys = anchor_rows + first_local_key
        class_sums = keys.new_zeros(classes.numel(), dim).index_add(0, key_class, keys)
        # Σ_{p ∈ P(a)} f_p = (sum of the anchor's class) − f_a; dividing by |P(a)| makes it a mean.
        positive_sums = class_sums[key_class[anchor_keys]] - keys[anchor_keys]
        positive_means = positive_sums / local_positives[anchor_rows, None].clamp(min=1).to(keys.dtype)
        loss_sum = local_cross_entropy_sum(
            queries[anchor_rows], keys, scale, positive_means, excluded=anchor_keys, chunk_size=chunk_size
        )
        if without_positives is not None:
            loss_sum = loss_sum - without_positives
        # W / A as a tensor (no host sync), in the core's dtype (A is exact there, unlike in
        # bf16 above 256); A = 0 means no rank has an anchor and loss_sum is 0.
        return loss_sum * (get_world_size(group) / anchors_with_positives.clamp(min=1).to(loss_sum.dtype))


def _every_row_an_anchor(queries: Tensor, local_positives: Tensor, keys: int) -> tuple[Tensor, Tensor, Tensor]:
    """Anchors for ``torch.compile``: every local row, so no shape depends on the labels.

    A row without positives gets a zero query: its term is ``log(K − 1)`` (``K − 1`` equal logits)
    with zero gradient everywhere, and that constant is returned to be taken off the sum. With
    ``K ≤ 1`` no row has a candidate (nor a positive) and there are no anchors.
    """
    has_positives = local_positives > 0
    rows = queries.shape[0] if keys > 1 else 0
    # In the queries' dtype before multiplying: an integer count times a float would round to float32.
    constant = (~has_positives[:rows]).sum().to(queries.dtype) * math.log(max(keys - 1, 1))
    return torch.arange(rows, device=queries.device), queries * has_positives[:, None], constant


def _check_labels(labels: object, batch_size: int) -> None:
    if not isinstance(labels, Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.ndim != 1 or labels.shape[0] != batch_size:
        raise ValueError(f"labels must have shape ({batch_size},) to match features, got {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")


class SupConLoss(TemperatureLoss):
    """Supervised contrastive loss over the global batch; holds the options of :func:`supcon`.

    Args:
        temperature: divides the similarities when ``forward`` gets no ``logit_scale``; > 0.
        chunk_size: anchors per block (bounded memory, same result); ``None``: all at once.
        group: the process group (default: the world).

    Shape:
        features: ``(n_r, D)`` or ``(n_r, V, D)``; labels: ``(n_r,)``; logit_scale: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import SupConLoss
        >>> criterion = SupConLoss(temperature=0.1)
        >>> features = F.normalize(torch.randn(4, 8), dim=-1).requires_grad_()
        >>> criterion(features, torch.tensor([0, 0, 1, 1])).backward()

    """

    def __init__(
        self, *, temperature: float = 0.1, chunk_size: int | None = None, group: ProcessGroup | None = None
    ) -> None:
        super().__init__(temperature=temperature, chunk_size=chunk_size, group=group)

    def forward(
        self,
        features: Tensor,
        labels: Tensor,
        logit_scale: Tensor | float | None = None,
        *,
        sizes: Sequence[int] | None = None,
    ) -> Tensor:
        """Return this rank's share of the loss; see :func:`supcon`."""
        return supcon(
            features,
            labels,
            logit_scale,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            group=self.group,
            sizes=sizes,
        )
