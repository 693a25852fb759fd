"""A ``DataLoader`` over a :class:`~contrastive_dist.DistributedBatchSampler` whose state is what it yielded.

Worker processes ask the sampler for batches ahead of the loop, so the sampler's own count runs
ahead of the batches the loop received. This loader counts the batches it *yielded* in the current
iteration and saves the sampler's position after them: ``state_dict()`` at a step boundary is the
exact point to resume from, with or without workers, and being the sampler's layout-free state it
loads into a loader on another number of ranks or workers. The workers themselves hold no state
for a map-style dataset, so there is nothing else to save. Checkpoints of the loader this one
replaces (torchdata's ``StatefulDataLoader`` around the sampler) load too: the sampler's state is
read out of them and moved to the batches they had yielded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

from torch.utils.data import DataLoader

from contrastive_dist.data._worker_watch import exit_with_rank
from contrastive_dist.data.sampler import DistributedBatchSampler

__all__ = ["ResumableLoader"]


class ResumableLoader(DataLoader):
    """``DataLoader(dataset, batch_sampler=sampler, ...)`` with ``state_dict`` / ``load_state_dict``.

    Args:
        *args: ``DataLoader`` arguments; ``batch_sampler`` must be a ``DistributedBatchSampler``.
        fixed_epoch_length: the caller keeps the number of steps of the first epoch for every epoch
            (Lightning does, for a whole ``fit``): refuse a state whose epoch would have another
            number of steps here (one saved mid-epoch with another global batch size).
        **kwargs: more ``DataLoader`` arguments.

    Example:
        >>> from contrastive_dist import DistributedBatchSampler
        >>> data = list(range(10))
        >>> loader = ResumableLoader(data, batch_sampler=DistributedBatchSampler(10, 4, seed=0), num_workers=0)
        >>> batches = iter(loader)
        >>> first = next(batches)
        >>> resumed = ResumableLoader(data, batch_sampler=DistributedBatchSampler(10, 2, seed=0))
        >>> resumed.load_state_dict(loader.state_dict())   # 4 samples consumed; the rest, 2 at a time
        >>> sorted(first.tolist() + [index for batch in resumed for index in batch.tolist()]) == data
        True

    """

    def __init__(self, *args: Any, fixed_epoch_length: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.batch_sampler, DistributedBatchSampler):
            raise TypeError(f"batch_sampler must be a DistributedBatchSampler, got {type(self.batch_sampler).__name__}")
        self.fixed_epoch_length = fixed_epoch_length
        exit_with_rank(self)  # its workers end with this process, even one killed
        self._yielded: int | None = None  # batches yielded by the current iteration; None before the first

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator around the DataLoader's iterator
        return self._counted(super().__iter__())

    def _counted(self, batches: Iterator[Any]) -> Iterator[Any]:
        self._yielded = 0
        for batch in batches:
            # Counted before the yield: once the loop holds a batch, state_dict() at its end counts it done.
            self._yielded += 1
            yield batch

    @property
    def current_step(self) -> int | None:
        """The epoch's step of the batch yielded last (None before the first), for a caller to check its count."""
        return None if not self._yielded else self._sampler().first_step + self._yielded - 1

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the batches yielded so far in this epoch (see ``DistributedBatchSampler``)."""
        sampler = self._sampler()
        if self._yielded is None:  # nothing iterated since construction or a load: the sampler's own position
            return sampler.state_dict()
        return sampler.state_dict(step=sampler.first_step + self._yielded)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved epoch at the next ``iter()``, on this loader's layout.

        Raises:
            ValueError: the sampler refuses the state, or ``fixed_epoch_length`` is set and the
                saved epoch would end after another number of steps than a fresh one here.
        """
        sampler = self._sampler()
        sampler.load_state_dict(_from_stateful_dataloader(state_dict) or state_dict)
        self._yielded = None
        fresh = -(-sampler.length // sampler.global_batch_size)
        if self.fixed_epoch_length and len(sampler) != fresh:
            done = sampler.state_dict()["consumed"]
            raise ValueError(
                f"cannot resume this epoch here: {done} of its {sampler.length} samples were consumed in "
                f"{sampler.first_step} step(s) of another global batch size (saved: {state_dict['batch_size']} × "
                f"{state_dict['num_replicas']}), so at {sampler.global_batch_size} a step "
                f"({sampler.batch_size} × {sampler.num_replicas}) it would end after {len(sampler)} steps, but the "
                f"trainer keeps every epoch at the {fresh} steps of a fresh one; resume with the saved global "
                "batch size (batch_size × devices), or from a checkpoint saved at the end of an epoch"
            )

    def _sampler(self) -> DistributedBatchSampler:
        return cast(DistributedBatchSampler, self.batch_sampler)  # checked in __init__


def _from_stateful_dataloader(state: object) -> dict[str, Any] | None:
    """The sampler state in a torchdata ``StatefulDataLoader`` state, after the batches it yielded; else None.

    Its sampler state (version 1: ``step`` is what the sampler handed out, ahead of the loop with
    workers) was saved with ``_sampler_iter_yielded``, the batches handed out by that iteration, so
    their difference is the step the iteration started at; plus the batches yielded, the steps done.
    """
    if not isinstance(state, Mapping):
        return None
    try:
        if "_snapshot" in state and "_steps_since_snapshot" in state:  # with workers
            snapshot = state["_snapshot"]
            main, yielded = snapshot["_main_snapshot"], snapshot["_snapshot_step"] + state["_steps_since_snapshot"]
        elif "_num_yielded" in state and "_index_sampler_state" in state:  # without
            main, yielded = state, state["_num_yielded"]
        else:
            return None
        sampler = dict(main["_index_sampler_state"])
        sampler["step"] = sampler["step"] - main["_sampler_iter_yielded"] + yielded
    except (KeyError, TypeError) as error:
        raise ValueError(f"cannot resume: the state looks like torchdata's StatefulDataLoader's, but its sampler "
                         f"state could not be read ({type(error).__name__}: {error})") from error
    return sampler
