"""Ring kernel of SigLIP: per-row sums of the pairwise sigmoid terms, text blocks travelling.

Image rows ``x_i`` stay on their rank; text blocks ``Y_b`` travel round the ring (see
:mod:`._ring`), as in big_vision's chunked SigLIP. Every image–text pair is an independent
binary term, so each image row's loss is a plain sum over the blocks::

    ℓ_i = Σ_j softplus(−z_ij · (s · x_i·y_j + b)),   z_ij = +1 for the matching pair, −1 otherwise

The matching pairs sit on the diagonal of a rank's own block. Logits are formed ``chunk_size``
rows at a time (at most ``chunk_size × max_b n_b`` at once); per-rank memory is
``O(n_r·D + chunk·max_b n_b)``, independent of the number of ranks.

Backward recomputes each block's logits while the text block travels round again with a
text-gradient accumulator that comes home to its owner; image, scale and bias gradients stay
local (their sum over ranks is the total). One product per block forward, three backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from contrastive_dist.engine._ring import Block, Ring, circulate
from contrastive_dist.losses._chunked import first_order_only

__all__ = ["ring_sigmoid_rows"]


def ring_sigmoid_rows(
    images: Tensor, texts: Tensor, scale: Tensor, bias: Tensor, ring: Ring, *, chunk_size: int | None = None
) -> Tensor:
    """Per-image-row SigLIP loss ``ℓ_i`` over every text of the global batch; see the module docstring.

    Args:
        images: this rank's image rows (stay here).
        texts: this rank's text rows (travel), row ``i`` paired with image row ``i``.
        scale: the logit multiplier ``s``, a 0-d tensor in the images' dtype.
        bias: the logit bias ``b``, a 0-d tensor in the images' dtype.
        ring: this rank's place in the ring.
        chunk_size: image rows per logit block (``None``: all at once).

    Shape:
        images, texts: ``(n_r, D)``; scale, bias: ``()``; output: ``(n_r,)``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist.engine._ring import Ring
        >>> images, texts = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
        >>> scale, bias = torch.tensor(3.0).double(), torch.tensor(-1.0).double()
        >>> rows = ring_sigmoid_rows(images, texts, scale, bias, Ring(0, 1, (4,)), chunk_size=3)
        >>> signs = 2 * torch.eye(4, dtype=torch.float64) - 1
        >>> torch.allclose(rows, -F.logsigmoid(signs * (scale * images @ texts.T + bias)).sum(1))
        True
    """
    chunk = chunk_size or max(images.shape[0], 1)
    wanted = tuple(torch.is_grad_enabled() and t.requires_grad for t in (images, texts, scale, bias))
    return _RingSigmoid.apply(images, texts, scale, bias, (ring, chunk, wanted))  # type: ignore[no-any-return]


def _margins(images: Tensor, texts: Tensor, scale: Tensor, bias: Tensor, start: int, own: bool) -> Tensor:
    """``−z · logit`` for one chunk of image rows (from ``start``) against one text block."""
    margins = torch.addmm(bias.expand(1, 1), images * scale, texts.T)
    if own:
        rows = torch.arange(images.shape[0], device=margins.device)
        margins[rows, rows + start] = -margins[rows, rows + start]
    return margins


class _RingSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, images: Tensor, texts: Tensor, scale: Tensor, bias: Tensor, options: tuple[Any, ...]
    ) -> Tensor:
        ring, chunk, _ = options
        row_loss = images.new_zeros(images.shape[0])

        def visit(owner: int, block: Block, _: Tensor | None) -> None:
            for start in range(0, images.shape[0], chunk):
                stop = min(start + chunk, images.shape[0])
                margins = _margins(images[start:stop], block[0], scale, bias, start, owner == ring.rank)
                row_loss[start:stop] += F.softplus(margins).sum(dim=1)

        new_block = lambda owner: (texts.new_empty(ring.sizes[owner], texts.shape[1]),)  # noqa: E731
        circulate(ring, (texts.contiguous(),), new_block, visit)
        ctx.save_for_backward(images, texts, scale, bias)
        ctx.options = options
        return row_loss

    @staticmethod
    @first_order_only
    def backward(ctx: Any, row_grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        images, texts, scale, bias = ctx.saved_tensors
        ring, chunk, (want_image, want_text, want_scale, want_bias) = ctx.options
        image_grad = torch.zeros_like(images)
        scale_grad, bias_grad = images.new_zeros(()), images.new_zeros(())

        def visit(owner: int, block: Block, text_grad: Tensor | None) -> None:
            block_texts, own = block[0], owner == ring.rank
            for start in range(0, images.shape[0], chunk):
                stop = min(start + chunk, images.shape[0])
                chunk_images = images[start:stop]
                # d softplus(−z·l)/dl = −z·σ(−z·l): σ(margin) off the diagonal, −σ(margin) on it.
                logit_grad = _margins(chunk_images, block_texts, scale, bias, start, own).sigmoid_()
                if own:
                    rows = torch.arange(stop - start, device=logit_grad.device)
                    logit_grad[rows, rows + start] = -logit_grad[rows, rows + start]
                logit_grad.mul_(row_grad[start:stop, None])
                bias_grad.add_(logit_grad.sum())
                if want_image or want_scale:
                    weighted_texts = logit_grad @ block_texts
                    image_grad[start:stop] += weighted_texts * scale
                    scale_grad.add_((chunk_images * weighted_texts).sum())
                if text_grad is not None:
                    text_grad.addmm_(logit_grad.T, chunk_images * scale)

        text_grad = circulate(
            ring,
            (texts.contiguous(),),
            lambda owner: (texts.new_empty(ring.sizes[owner], texts.shape[1]),),
            visit,
            # Frozen texts (the same on every rank, as the size exchange checked): no accumulator.
            new_accumulator=(lambda owner: texts.new_zeros(ring.sizes[owner], texts.shape[1])) if want_text else None,
        )
        return (
            image_grad if want_image else None,
            text_grad if want_text else None,
            scale_grad if want_scale else None,
            bias_grad if want_bias else None,
            None,
        )
