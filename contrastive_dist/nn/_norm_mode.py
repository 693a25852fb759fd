"""Every rank's SyncBatchNorm in the same mode, or the same error on every rank: one agreement per step.

A layer in eval mode makes no exchange, so a rank whose model is in eval mode while the others train
goes on to its next collective (the loss's agreement, say) while the others wait in the layer's
exchange of statistics: the transport sees two collectives of different sizes and aborts the
process (gloo: SIGABRT), or pairs the statistics with unrelated data. So the first training forward
of a step (the first SyncBatchNorm exchange after any other collective of the package on the group)
is preceded by an agreement: the same fixed-size row as a loss's, so that a rank in eval mode meets
it with its loss's agreement, and every rank raises the same ``ValueError`` naming both operations.
The later layers of the step follow without one: one small exchange more per step, not per layer.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist.engine._agreement import agree
from contrastive_dist.engine._progress import kind, progress

__all__ = ["STATISTICS", "agree_on_training"]

STATISTICS = "SyncBatchNorm forward (exchange of the batch statistics)"
"""The layer's exchange in training, named in errors."""


def agree_on_training(input: Tensor, num_features: int, group: ProcessGroup | None) -> None:
    """Before the step's first exchange of statistics on ``group``: agree that every rank trains this layer now."""
    if progress(group).last_kind == kind(STATISTICS):
        return  # a layer before this one in the same forward agreed already
    agree([input], problem=None, group=group, operation="SyncBatchNorm (training)", rows=0, compare_inputs=False,
          options={"num_features": num_features})
