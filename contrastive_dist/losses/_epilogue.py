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
from contrastive_dist.losses._visit import Kept, Side, half, product

if TYPE_CHECKING:
    from contrastive_dist.losses._families import Family

__all__ = ["EPILOGUE_VARIABLE", "Eager", "Epilogue", "epilogue_for"]

EPILOGUE_VARIABLE = "CONTRASTIVE_DIST_EPILOGUE"
"""``auto`` / unset: the fused epilogue on CUDA tensors, the eager one elsewhere; ``eager``: never fused;
``triton``: fused wherever Triton runs, CPU tensors included under ``TRITON_INTERPRET=1``."""


class Epilogue:
    """What a visit's product goes through: :class:`Eager`'s interface, and the fused epilogue's.

    A visit's rows and, where it has one, its column side (the block's first columns seen as rows, from
    the same logits: :class:`~._visit.Side`) are one product's two directions: :meth:`states` and
    :meth:`gradients` take both at once.
    """

    def product(self, queries: Tensor, keys: Tensor) -> Tensor:
        """The visit's one product ``(c, m)``."""
        raise NotImplementedError

    def states(self, values: Tensor, rows: Indices, columns: Side | None) -> tuple[Tensor, Tensor | None, Kept]:
        """The rows' state over this visit alone ``(c, width)``, the column side's (or ``None``), what pass 2 keeps.

        What is kept (:class:`~._visit.Kept`) serves pass 2 where the driver keeps a visit instead of forming
        its product again.
        """
        raise NotImplementedError

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        """The state of rows complete after this visit (no column side), their ``G``, (fused sigmoid) ``Σ_j G_ij``."""
        raise NotImplementedError

    def gradients(self, values: Tensor, rows: Side, columns: Side | None, kept: Kept | None
                  ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        """``G`` from the final states, the rows' and (transposed, added) the column side's; ``Σ_j G_ij`` or ``None``.

        ``values``: the product, or :meth:`states`' ``kept.product`` with ``kept``.
        """
        raise NotImplementedError


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

    def states(self, values: Tensor, rows: Indices, columns: Side | None) -> tuple[Tensor, Tensor | None, Kept]:
        column_values = column_partial = None
        if columns is not None:  # (before the rows' state turns the logits into numerators)
            column_values = _transposed(values, len(columns.state))
            column_partial = self._state(column_values, columns.indices)
        partial = self._state(values, rows)
        return partial, column_partial, Kept(values, partial, column_values, column_partial)

    def state_and_gradient(self, values: Tensor, indices: Indices, weights: Tensor | float
                           ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        targets = indices.targets()
        mask = targets.positive_mask(values)
        state = self.family.block_state_(values, targets, mask)
        return state, self.family.gradient_(values, state, targets, mask, weights), None

    def gradients(self, values: Tensor, rows: Side, columns: Side | None, kept: Kept | None
                  ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        column_values = None
        if columns is not None:  # (before the rows' gradient is written over the logits)
            kept_values = None if kept is None else kept.column_values
            column_values = _transposed(values, len(columns.state)) if kept_values is None else kept_values
        logit_grad = self._gradient(values, rows, None if kept is None else kept.partial)
        if columns is not None and column_values is not None:
            column_grad = self._gradient(column_values, columns, None if kept is None else kept.column_partial)
            logit_grad[:, : column_grad.shape[0]] += column_grad.T
        return logit_grad, None

    def _state(self, values: Tensor, indices: Indices) -> Tensor:
        """The rows' state; ``values`` become their numerators."""
        targets = indices.targets()
        return self.family.block_state_(values, targets, targets.positive_mask(values))

    def _gradient(self, values: Tensor, side: Side, partial: Tensor | None) -> Tensor:
        """``G`` of one side from its final state, in place.

        ``values`` are its logits, or numerators against ``partial``.
        """
        targets = side.indices.targets()
        mask = targets.positive_mask(values)
        if partial is None:
            self.family.numerators_(values, side.state, targets, mask)
        else:
            self.family.rebase_(values, partial, side.state)
        return self.family.gradient_(values, side.state, targets, mask, side.weights)


def _transposed(values: Tensor, width: int) -> Tensor:
    """The first ``width`` columns of ``values`` seen as rows ``(width, c)``: a column side's values.

    A copy laid out like the logits: its gradient adds back onto theirs in one plain pass.
    """
    return values[:, :width].clone().T


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
