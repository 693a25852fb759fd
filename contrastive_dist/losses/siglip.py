"""SigLIP's pairwise sigmoid loss over the global batch of every rank (Zhai et al., 2023)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from contrastive_dist._dist import get_world_size
from contrastive_dist._validation import (
    check_chunk_size,
    check_pair,
    positive_scalar,
    scalar_tensor,
    validated_on_all_ranks,
)
from contrastive_dist.engine.gather import all_gather_many
from contrastive_dist.losses._chunked import first_order_only, full_precision, upcast
from contrastive_dist.losses._reduction import Reduction, check_reduction, check_weight, mean_factor
from contrastive_dist.losses._ring_losses import (
    Communication,
    check_communication,
    ring_checks,
    ring_siglip,
)

__all__ = ["SigLIPLoss", "siglip"]


def siglip(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor | float,
    logit_bias: Tensor | float,
    *,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    weight: Tensor | None = None,
    reduction: Reduction = "mean",
    communication: Communication = "gather",
) -> Tensor:
    """Sigmoid loss of this rank's images against every rank's texts; exact under data parallelism.

    The global loss is ``−(1/N) Σ_{i,j} log σ(z_ij · (logit_scale · x_i·y_j + logit_bias))``
    over all ``N × N`` image–text pairs of the global batch, with ``z_ij = +1`` for matching
    pairs (``i = j``) and ``−1`` otherwise. Every pair is one independent binary term, so only
    the texts are gathered: each rank sums its local image rows against all ``N`` texts and
    returns ``(W / N) ·`` that sum. The mean over ranks is the single-process loss; DDP's
    gradient averaging gives its gradient, for any per-rank batch sizes (including 0).

    Features are used as given (normalise them in the model). With ``chunk_size``, rows are
    processed ``chunk_size`` at a time against all texts and their gradients formed on the
    spot, so at most ``chunk_size × N`` logits exist at once, at no extra matrix product.

    **Weights and reduction.** An image row's loss is ``ℓ_i = Σ_j softplus(−z_ij · logit_ij)``,
    its pairs with all ``N`` texts, so the loss above is the mean of the ``ℓ_i``. With ``weight``
    (one weight per local image row, applied to all of its pairs) the loss is
    ``Σ_i w_i ℓ_i / Σ_global w_i`` (this rank returns ``W · Σ_local w_i ℓ_i / Σ_global w``, still
    exact under DDP). ``reduction="none"`` returns this rank's ``ℓ_i`` as they are: the caller
    owns the normalisation (``rows.sum() * W / N`` gives back the mean's share); with
    ``chunk_size`` that mode recomputes each block in backward (one more product per block).

    Args:
        image_features: this rank's image embeddings.
        text_features: this rank's text embeddings, row ``i`` paired with image row ``i``.
        logit_scale: similarity multiplier, already exponentiated (learnable, like SigLIP's
            ``t``); > 0 when given as a number.
        logit_bias: added to every logit (learnable ``b``; SigLIP initialises it at −10).
        chunk_size: image rows per block; same value and gradients.
        group: the process group (default: the world).
        sizes: every rank's batch size, if known (skips the size exchange).
        weight: one weight ≥ 0 per local image row (no gradient); see above.
        reduction: ``"mean"`` (this rank's share of the global mean) or ``"none"`` (per-row losses).
        communication: ``"gather"`` gathers every rank's texts onto every rank (memory
            ``O(N·D + chunk·N)``); ``"ring"`` keeps them local and passes text blocks round the
            ring instead (memory ``O(n_r·D + chunk·max_r n_r)``, independent of the number of
            ranks); same value and gradients, with ``weight`` (one more scalar all-reduce) and
            ``reduction="none"`` too.

    Returns:
        ``"mean"``: a scalar, this rank's share of the global loss (0 for an empty global batch or
        all-zero weights); ``"none"``: this rank's per-row losses.
        Float32 (float64 for float64 features): the core runs in float32 with autocast off;
        gradients come back in the inputs' dtypes.

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale, logit_bias: ``()``;
        weight: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_dist import siglip
        >>> images, texts = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        >>> scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        >>> siglip(images, texts, scale, bias, chunk_size=3).backward()
        >>> bias.grad.shape
        torch.Size([])
        >>> siglip(images, texts, scale, bias, reduction="none").shape
        torch.Size([4])

    """
    with validated_on_all_ranks((image_features, text_features), group=group, sizes=ring_checks(communication, sizes)):
        image_features, text_features = check_pair("image_features", image_features, "text_features", text_features)
        scale = positive_scalar("logit_scale", logit_scale, image_features)
        bias = scalar_tensor("logit_bias", logit_bias, image_features)
        chunk_size = check_chunk_size(chunk_size)
        reduction = check_reduction(reduction, weight)
        weights = check_weight(weight, image_features.shape[0], image_features)
        communication = check_communication(communication)
    if communication == "ring":
        return ring_siglip(
            image_features,
            text_features,
            scale,
            bias,
            chunk_size=chunk_size,
            group=group,
            sizes=sizes,
            weights=weights,
            reduction=reduction,
        )
    own = (text_features,) + (() if weights is None else (weights,))
    gathered = all_gather_many(own, group=group, sizes=sizes)
    factor = mean_factor(get_world_size(group), sum(gathered.sizes), None if weights is None else gathered.tensors[1])
    with full_precision(image_features.device):
        images, texts = upcast(image_features), upcast(gathered.tensors[0])
        if chunk_size is None or reduction == "none":
            block = functools.partial(_pair_rows, texts=texts, scale=scale, bias=bias, offset=gathered.offset)
            if chunk_size is None or images.shape[0] == 0:
                rows = block(images, start=0)
            else:
                # Per-row results need per-row upstream gradients: each block is recomputed in
                # backward (checkpointed), so memory stays at one block's logits.
                blocks = range(0, images.shape[0], chunk_size)
                rows = torch.cat(
                    [checkpoint(block, images[i : i + chunk_size], start=i, use_reentrant=False) for i in blocks]
                )
            if reduction == "none":
                return rows
            return (rows.sum() if weights is None else rows @ weights) * factor
        # One flag per input: a side without gradient skips its accumulator and product.
        wanted = tuple(torch.is_grad_enabled() and t.requires_grad for t in (images, texts, scale, bias))
        total = _SigmoidPairsSum.apply(images, texts, scale, bias, weights, gathered.offset, chunk_size, *wanted)
        return total * factor


def _pair_rows(images: Tensor, *, texts: Tensor, scale: Tensor, bias: Tensor, offset: int, start: int) -> Tensor:
    """``ℓ_i = Σ_j softplus(−z_ij · (s·x_i·y_j + b))`` for image rows ``start:start+len(images)``, by autograd."""
    logits = (images * scale) @ texts.T + bias
    rows = torch.arange(images.shape[0], device=logits.device)
    signs = -torch.ones_like(logits)
    signs[rows, rows + offset + start] = 1.0
    return F.softplus(-signs * logits).sum(dim=1)


class _SigmoidPairsSum(torch.autograd.Function):
    """``Σ_ij softplus(−z_ij · (s·x_i·y_j + b))`` in row blocks; gradients formed in forward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        images: Tensor,
        texts: Tensor,
        scale: Tensor,
        bias: Tensor,
        weights: Tensor | None,
        offset: int,
        chunk_size: int,
        want_image: bool,
        want_text: bool,
        want_scale: bool,
        want_bias: bool,
    ) -> Tensor:
        total = images.new_zeros(())
        image_grad = torch.empty_like(images) if want_image else None
        text_grad = torch.zeros_like(texts) if want_text else None
        scale_grad = images.new_zeros(()) if want_scale else None
        bias_grad = images.new_zeros(()) if want_bias else None
        for start in range(0, images.shape[0], chunk_size):
            stop = min(start + chunk_size, images.shape[0])
            scaled_images = images[start:stop] * scale
            margins = torch.addmm(bias.expand(1, 1), scaled_images, texts.T)  # becomes −z · logit
            rows = torch.arange(stop - start, device=images.device)
            matches = (rows, rows + offset + start)
            margins[matches] = -margins[matches]
            row_losses = F.softplus(margins).sum(dim=1)
            total += row_losses.sum() if weights is None else row_losses @ weights[start:stop]
            if not (want_image or want_text or want_scale or want_bias):
                continue
            # d softplus(−z·l)/dl = −z·σ(−z·l): σ(margin) off the diagonal, −σ(margin) on it.
            logit_grad = margins.sigmoid_()
            logit_grad[matches] = -logit_grad[matches]
            if weights is not None:
                logit_grad.mul_(weights[start:stop, None])
            if text_grad is not None:
                text_grad.addmm_(logit_grad.T, scaled_images)
            if bias_grad is not None:
                bias_grad += logit_grad.sum()
            if image_grad is None and scale_grad is None:
                continue
            weighted_texts = logit_grad @ texts
            if image_grad is not None:
                image_grad[start:stop] = weighted_texts * scale
            if scale_grad is not None:
                scale_grad += (images[start:stop] * weighted_texts).sum()
        ctx.save_for_backward(image_grad, text_grad, scale_grad, bias_grad)
        return total

    @staticmethod
    @first_order_only
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grads = tuple(None if grad is None else grad * grad_output for grad in ctx.saved_tensors)
        return (*grads, None, None, None, None, None, None, None)


class SigLIPLoss(nn.Module):
    """SigLIP's sigmoid loss over the global batch; holds the options of :func:`siglip`.

    Args:
        chunk_size: image rows per block (bounded memory, same result); ``None``: all at once.
        group: the process group (default: the world).
        reduction: ``"mean"`` or ``"none"`` (per-row losses; the caller normalises).
        communication: ``"gather"`` or ``"ring"`` (per-rank memory independent of the number of
            ranks; takes ``weight`` and ``reduction`` too); see :func:`siglip`.

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale, logit_bias: ``()``;
        weight: ``(n_r,)``; output: ``()``, or ``(n_r,)`` with ``reduction="none"``.

    Example:
        >>> import torch
        >>> from contrastive_dist import SigLIPLoss
        >>> criterion = SigLIPLoss()
        >>> images, texts = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        >>> criterion(images, texts, torch.tensor(10.0), torch.tensor(-10.0)).backward()

    """

    def __init__(
        self,
        *,
        chunk_size: int | None = None,
        group: ProcessGroup | None = None,
        reduction: Reduction = "mean",
        communication: Communication = "gather",
    ) -> None:
        super().__init__()
        self.chunk_size = check_chunk_size(chunk_size)
        self.group = group
        self.reduction = check_reduction(reduction, None)
        self.communication = check_communication(communication)

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float,
        *,
        sizes: Sequence[int] | None = None,
        weight: Tensor | None = None,
    ) -> Tensor:
        """Return this rank's share of the loss (or its per-row losses); see :func:`siglip`."""
        return siglip(
            image_features,
            text_features,
            logit_scale,
            logit_bias,
            chunk_size=self.chunk_size,
            group=self.group,
            sizes=sizes,
            weight=weight,
            reduction=self.reduction,
            communication=self.communication,
        )

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return f"chunk_size={self.chunk_size}, reduction={self.reduction!r}, communication={self.communication!r}"
