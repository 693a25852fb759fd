"""What a visit's product goes through: the epilogue's interface, its eager reference and the one choice.

A visit's epilogue is everything between its product and its gradient's products: the logits' scale and
bias, the rows' state, the logit gradient ``G``. :class:`Eager` runs the family's functions on the
logits, in place, and stays the reference; the fused Triton epilogue (:class:`._fused.Fused`, CUDA)
computes the same numbers from the raw product, one launch per direction. :func:`epilogue_for` chooses
between them, once per call: the only place the fast or eager choice is made.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from contrastive_dist.losses._targets import Indices
from contrastive_dist.losses._visit import half, product

if TYPE_CHECKING:
    from contrastive_dist.losses._families import Family

__all__ = ["EPILOGUE_VARIABLE", "Eager", "Epilogue", "epilogue_for"]

EPILOGUE_VARIABLE = "CONTRASTIVE_DIST_EPILOGUE"
"""``auto`` / unset: the fused epilogue on CUDA tensors, the eager one elsewhere; ``eager``: never fused;
``triton``: fused wherever Triton runs, CPU tensors included under ``TRITON_INTERPRET=1``."""


class Epilogue:
    """What a visit's product goes through: :class:`Eager`'s interface, and the fused epilogue's."""

    def product(self, queries: Tensor, keys: Tensor) -> Tensor:
        """The visit's one product ``(c, m)``."""
        raise NotImplementedError

    def transposed(self, product: Tensor, width: int) -> Tensor:
        """The first ``width`` columns of ``product`` seen as rows ``(width, c)``: a column side's values."""
        raise NotImplementedError

    def state(self, values: Tensor, indices: Indices) -> Tensor:
        """The rows' state over this visit alone ``(c, width)`` (eager: ``values`` become numerators)."""
        raise NotImplementedError

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float, *, keep: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        """The state of rows complete after this visit, their ``G`` and (fused sigmoid) ``Σ_j G_ij``.

        ``keep``: ``values`` are read again afterwards (a column side).
        """
        raise NotImplementedError

    def gradient(self, values: Tensor, indices: Indices, state: Tensor, weights: Tensor | float,
                 partial: Tensor | None, *, keep: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """``G`` from the rows' final ``state``, and ``Σ_j G_ij`` or ``None``.

        ``partial``: ``values`` are pass 1's numerators against it; ``keep``: ``values`` are read again.
        """
        raise NotImplementedError

    def add_column_gradient(self, logit_grad: Tensor, values: Tensor, indices: Indices, state: Tensor,
                            weights: Tensor | float, partial: Tensor | None) -> None:  # fmt: skip
        """``G[:, :width] += G_columnsᵀ``: a column side's gradient from its final ``state``."""
        raise NotImplementedError

    def slice_rows(self, rows: int, columns: int, *, keep: bool) -> int:
        """Rows of a visit whose ``G`` is formed at once in pass 2 (``keep``: the product is read again)."""
        return rows


class Eager(Epilogue):
    """The reference epilogue: the family's functions on the logits ``s · Q Kᵀ (+ b)``, in place."""

    def __init__(self, family: Family, scale: Tensor, bias: Tensor | None) -> None:
        self.family, self.scale, self.bias = family, scale, bias

    def product(self, queries: Tensor, keys: Tensor) -> Tensor:
        if half(queries, keys) or queries.dtype != keys.dtype:
            logits = product(queries, keys.T).mul_(self.scale)  # the scale in float32, after the product
            return logits if self.bias is None else logits.add_(self.bias)
        if self.bias is None:  # the scale folded into the smaller operand: no pass over the logits
            return (queries * self.scale) @ keys.T
        return torch.addmm(self.bias.expand(1, 1), queries * self.scale, keys.T)

    def transposed(self, product: Tensor, width: int) -> Tensor:
        # A copy laid out like the logits: its gradient adds back onto theirs in one plain pass.
        return product[:, :width].clone().T

    def state(self, values: Tensor, indices: Indices) -> Tensor:
        targets = indices.targets()
        return self.family.block_state_(values, targets, targets.positive_mask(values))

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float, *, keep: bool = False
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        targets = indices.targets()
        mask = targets.positive_mask(values)
        state = self.family.block_state_(values, targets, mask)
        return state, self.family.gradient_(values, state, targets, mask, weights), None

    def gradient(self, values: Tensor, indices: Indices, state: Tensor, weights: Tensor | float,
                 partial: Tensor | None, *, keep: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        targets = indices.targets()
        mask = targets.positive_mask(values)
        if partial is None:
            self.family.numerators_(values, state, targets, mask)
        else:
            self.family.rebase_(values, partial, state)
        return self.family.gradient_(values, state, targets, mask, weights), None

    def add_column_gradient(self, logit_grad: Tensor, values: Tensor, indices: Indices, state: Tensor,
                            weights: Tensor | float, partial: Tensor | None) -> None:  # fmt: skip
        column_grad, _ = self.gradient(values, indices, state, weights, partial, keep=False)
        logit_grad[:, : column_grad.shape[0]] += column_grad.T


def epilogue_for(family: Family, queries: Tensor, keys: Tensor, scale: Tensor, bias: Tensor | None) -> Epilogue:
    """The epilogue of a call: the fused Triton ops where they serve (:func:`._fused.fused`), else :class:`Eager`.

    CPU tensors take Triton's interpreter only when asked (:data:`EPILOGUE_VARIABLE`): a CPU run never
    imports Triton otherwise.
    """
    if queries.is_cuda or os.environ.get(EPILOGUE_VARIABLE) == "triton":
        from contrastive_dist.losses import _fused

        if _fused.fused(family, queries, keys):
            return _fused.Fused(family, scale, bias, queries.dtype)
    return Eager(family, scale, bias)
