"""The per-rank batch sizes of a training step, read from the loader that ``contrastive_dist.lightning`` built."""

from __future__ import annotations

from typing import Any

from contrastive_dist.data._resumable_loader import ResumableLoader
from contrastive_dist.data.sampler import DistributedBatchSampler
from contrastive_dist.data.streaming import DistributedStreamingBatches

__all__ = ["step_sizes"]

_NOT_RESTORED = (
    " (a run resumed from a checkpoint whose loader was never given its saved position: Lightning builds the "
    "train loader before it restores a checkpoint when configure_optimizers reads trainer.estimated_stepping_"
    "batches with max_epochs set, and then skips the loader's state, Lightning issue #20550; compute the "
    "schedule's length without it)"
)


def step_sizes(trainer: Any, batch_idx: int) -> tuple[int, ...]:
    """The per-rank batch sizes of training step ``batch_idx``; the same tuple on every rank.

    ``batch_idx`` is the one Lightning passes to ``training_step``; it counts steps within the
    epoch and continues where a resumed checkpoint left off, as the loader does. Pass the result to
    a loss as ``sizes=`` to skip its size exchange.

    Args:
        trainer: a ``lightning.Trainer`` whose training loader came from
            :func:`~contrastive_dist.lightning.distributed_loader` or
            :func:`~contrastive_dist.lightning.streaming_loader` (or is a
            :class:`~contrastive_dist.DistributedStreamingBatches`, or has a
            :class:`~contrastive_dist.DistributedBatchSampler` as ``batch_sampler``).
        batch_idx: the step within the current epoch.

    Raises:
        TypeError: the training loader is none of these.
        ValueError: ``batch_idx`` is not a step of the epoch (for a stream: not one of its recent steps), or
            not the step of the loader's batch (a resumed loader whose state Lightning did not restore).

    Example:
        In a ``LightningModule``: ``loss = self.loss(image, text, scale, sizes=step_sizes(self.trainer,
        batch_idx))``. Here with a stand-in for the trainer, which is only asked for its loader:

        >>> from types import SimpleNamespace
        >>> from contrastive_dist.lightning import distributed_loader
        >>> loader = distributed_loader(list(range(10)), None, batch_size=4)
        >>> step_sizes(SimpleNamespace(train_dataloader=loader), 2)
        (2,)

    """
    loader = trainer.train_dataloader
    if isinstance(loader, DistributedStreamingBatches):
        # Known once the ranks agreed on the step; Lightning fetches one batch ahead, kept too. A resumed
        # stream numbers its steps on from the checkpoint's, as Lightning's batch_idx does.
        try:
            return loader.sizes(batch_idx)
        except ValueError as error:
            raise ValueError(f"{error}{_NOT_RESTORED}") from error
    if isinstance(loader, ResumableLoader) and loader.current_step not in (None, batch_idx):
        raise ValueError(f"Lightning trains step {batch_idx} of the epoch, but the loader's batch is its step "
                         f"{loader.current_step}{_NOT_RESTORED}")
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, DistributedBatchSampler):
        raise TypeError(
            "step_sizes needs a training loader built by distributed_loader or streaming_loader (a "
            "DistributedBatchSampler as batch_sampler, or a DistributedStreamingBatches); the trainer's "
            f"train_dataloader is a {type(loader).__name__} with batch_sampler "
            f"{type(sampler).__name__}"
        )
    return sampler.sizes(batch_idx)
