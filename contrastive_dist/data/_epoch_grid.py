"""How a :class:`~contrastive_dist.DistributedBatchSampler` cuts an epoch's order into steps and ranks' shares.

Step ``s`` takes the ``G = batch_size × num_replicas`` positions of the order from ``position(s)`` on
(the last step fewer) and gives rank ``r`` its ``r``-th share, the shares as even as possible with the
first ranks taking the extra samples. A fresh epoch starts at step 0 and position 0; an epoch resumed
from a state saved on another global batch size continues at the saved ``(step, consumed)``, off the
fresh grid (:meth:`EpochGrid.resume`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from contrastive_dist._dist import start_offset
from contrastive_dist.data._sampler_state import EpochPosition

__all__ = ["EpochGrid"]

_WINDOW = 8192  # indices computed per call of the order: 64 KiB, a few milliseconds


@dataclass(frozen=True)
class EpochGrid:
    """The steps of one epoch: from ``first_step`` on, step by step, ``G`` positions of the order each.

    Example:
        >>> grid = EpochGrid(length=10, batch_size=2, num_replicas=3)
        >>> grid.steps(), grid.sizes(1)
        (2, (2, 1, 1))
        >>> grid.rows(None, 0, rank=1), grid.rows(None, 1, rank=1)  # the full steps, then the last one
        ([[2, 3]], [[8]])
    """

    length: int
    batch_size: int
    num_replicas: int
    first_step: int = 0
    first_position: int = 0

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_replicas

    def steps(self) -> int:
        """Steps of the epoch; a resumed epoch counts those done before the resume too."""
        return self.first_step - (-(self.length - self.first_position) // self.global_batch_size)

    def position(self, step: int) -> int:
        """Position in the epoch's order of the first sample of ``step``."""
        return self.first_position + (step - self.first_step) * self.global_batch_size

    def sizes(self, step: int) -> tuple[int, ...]:
        """Every rank's samples at ``step``; ``ValueError`` for a step outside ``[first_step, steps())``."""
        if isinstance(step, bool) or not isinstance(step, int) or not self.first_step <= step < self.steps():
            resumed = f" (this epoch resumed at step {self.first_step})" if self.first_step else ""
            raise ValueError(f"step must be an int in [{self.first_step}, {self.steps()}){resumed}, got {step!r}")
        global_size = min(self.global_batch_size, self.length - self.position(step))
        share, extra = divmod(global_size, self.num_replicas)
        return tuple(share + 1 if rank < extra else share for rank in range(self.num_replicas))

    def rows(self, order: Callable[[Tensor], Tensor] | None, step: int, rank: int) -> list[list[int]]:
        """``rank``'s batches from ``step`` on, as many as fill a window of about ``_WINDOW`` indices.

        One call of the order per window, not per batch: each call costs a few hundred small tensor
        operations whatever its size, which would dominate batches of a few samples.
        """
        sizes = self.sizes(step)
        first = self.position(step) + start_offset(sizes, rank)
        full_end = self.first_step + (self.length - self.first_position) // self.global_batch_size
        # Full steps give every rank batch_size samples at the same offset: a (steps, batch_size) grid.
        count = min(full_end - step, max(1, _WINDOW // self.batch_size)) if step < full_end else 1
        positions = first + torch.arange(sizes[rank], dtype=torch.int64)
        positions = positions + self.global_batch_size * torch.arange(count, dtype=torch.int64)[:, None]
        return (positions if order is None else order(positions)).tolist()

    def resume(self, position: EpochPosition) -> tuple[EpochGrid, int]:
        """The grid that continues a saved ``position`` (of any layout), and the step it continues at."""
        fresh = replace(self, first_step=0, first_position=0)
        if position.consumed == self.length:
            # Nothing is left of the epoch, whatever layout took it: the end of a plain epoch of this one.
            return fresh, fresh.steps()
        if position.consumed == position.step * self.global_batch_size:
            # On this grid (the same global batch size, say): a plain epoch at that step.
            return fresh, position.step
        return replace(self, first_step=position.step, first_position=position.consumed), position.step
