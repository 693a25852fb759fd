"""A shard list and its stages as one dataset whose samples can say where in the stream they come from.

:class:`ShardPipeline` runs, in each DataLoader worker, the shards of that worker's slot through
the stages, like ``webdataset.DataPipeline``, with one stage of its own after the first (the one
that turns shards into samples): it follows each sample's shard (``__url__``) through the slot's
plan, counts the samples of every shard, and drops the ones a resumed state says were consumed
already. They were read from the tar file, but no later stage (decoding, augmenting) sees them.

When :class:`~contrastive_dist.DistributedStreamingBatches` wraps the loader it turns
``positions`` on: every sample then leaves the pipeline as a :class:`Positioned` (its slot, its
shard, the samples of that shard read so far), and :class:`PositionedCollate` makes each batch a
:class:`PositionedBatch` carrying the position of its last sample. Stages that keep samples back
(a shuffle buffer) or turn one into several make those positions run ahead of what a batch holds:
resumed from them, the samples they held would be lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

if TYPE_CHECKING:
    from contrastive_dist.data.shards import DistributedShardList

__all__ = ["Positioned", "PositionedBatch", "PositionedCollate", "ShardPipeline", "track_positions"]

Stage = Callable[[Iterator[Any]], Iterator[Any]]


class Positioned(NamedTuple):
    """A sample and where it was read: the slot, the shard, and the samples of that shard read with it."""

    sample: Any
    slot: int
    shard: int
    consumed: int


class PositionedBatch(NamedTuple):
    """A collated batch and the position of its last sample (see :class:`Positioned`)."""

    batch: Any
    slot: int
    shard: int
    consumed: int


class PositionedCollate:
    """``collate(samples)`` as before; samples that carry positions give a :class:`PositionedBatch`."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        """Collate ``samples``; positioned ones become a batch with its last sample's position."""
        if isinstance(samples, Positioned):  # DataLoader(batch_size=None): one sample at a time
            return PositionedBatch(self.collate(samples.sample), *samples[1:])
        if samples and isinstance(samples[0], Positioned):
            return PositionedBatch(self.collate([item.sample for item in samples]), *samples[-1][1:])
        return self.collate(samples)


class _PlanReader:
    """Follows the samples of one slot through its plan: which shard, how many of its samples, what to skip."""

    def __init__(self, shards: Sequence[Any], plan: list[tuple[int, int]], slot: int) -> None:
        self.shards, self.plan, self.slot = shards, plan, slot
        self.item = 0  # the plan's item being read
        self.shard, self.consumed = (plan[0][0] if plan else -1), 0

    def sources(self) -> Iterator[dict[str, Any]]:
        for index, skip in self.plan:
            yield {"url": self.shards[index], **({"skip": skip} if skip else {})}

    def skip_consumed(self, samples: Iterator[Any]) -> Iterator[Any]:
        read = 0  # samples of the current shard read so far, skipped ones included
        for sample in samples:
            url = sample.get("__url__") if isinstance(sample, dict) else None
            if url is None:
                raise TypeError("the first stage after the shard list must yield samples that name their shard in "
                                f"'__url__' (webdataset.tarfile_to_samples() does), got {type(sample).__name__} "
                                f"{str(sample)[:100]}")
            if url != self.shards[self.plan[self.item][0]]:
                self.item, read = self._find(url), 0  # a new shard (any in between held no sample)
            read += 1
            if read <= self.plan[self.item][1]:
                continue  # consumed before the resume: read past it, never decoded
            self.shard, self.consumed = self.plan[self.item][0], read
            yield sample

    def _find(self, url: Any) -> int:
        for item in range(self.item + 1, len(self.plan)):
            if self.shards[self.plan[item][0]] == url:
                return item
        raise ValueError(f"a sample of {url!r} came after shard {self.shards[self.plan[self.item][0]]!r}, but it is "
                         f"not one of this slot's next shards: the first stage must read the shards it is given, in "
                         f"order, and name each sample's shard in '__url__' as it was given")


class ShardPipeline(IterableDataset):
    """``shard_list`` followed by ``stages``, in each worker; see the module docstring.

    Args:
        shard_list: the :class:`~contrastive_dist.DistributedShardList` of the dataset.
        stages: callables from an iterator to an iterator (webdataset stages); the first turns
            ``{"url": ...}`` dicts into samples with ``__url__``.

    """

    def __init__(self, shard_list: DistributedShardList, stages: Sequence[Stage]) -> None:
        super().__init__()
        if not stages or not all(callable(stage) for stage in stages):
            raise TypeError("pipeline() needs stages, callables from an iterator to an iterator, the first reading "
                            "each shard into samples (webdataset.tarfile_to_samples()); got "
                            f"{[type(stage).__name__ for stage in stages]}")
        self.shard_list, self.stages = shard_list, list(stages)
        self.positions = False  # turned on by DistributedStreamingBatches

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the shard list and of any stage that has one."""
        self.shard_list.set_epoch(epoch)
        for stage in self.stages:
            set_stage_epoch = getattr(stage, "set_epoch", None)
            if callable(set_stage_epoch):
                set_stage_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        plan = self.shard_list.plan_for(worker, num_workers)
        reader = _PlanReader(self.shard_list.shards, plan, worker * self.shard_list.num_replicas + self.shard_list.rank)
        samples = reader.skip_consumed(self.stages[0](reader.sources()))
        for stage in self.stages[1:]:
            samples = stage(samples)
        if not self.positions:
            yield from samples
            return
        for sample in samples:  # the reader's position is that of the sample the last stage just finished
            yield Positioned(sample, reader.slot, reader.shard, reader.consumed)


def track_positions(loader: object) -> ShardPipeline | None:
    """Make a ``DataLoader`` over a :class:`ShardPipeline` yield positioned batches; return the pipeline, or None."""
    dataset = getattr(loader, "dataset", None)
    collate = getattr(loader, "collate_fn", None)
    if not isinstance(dataset, ShardPipeline) or collate is None:
        return None
    if not isinstance(collate, PositionedCollate):  # the DataLoader reads collate_fn when an epoch starts
        dataset.positions = True
        loader.collate_fn = PositionedCollate(collate)  # type: ignore[attr-defined]
    return dataset
