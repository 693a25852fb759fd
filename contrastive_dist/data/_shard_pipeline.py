"""A shard list and its stages as one dataset whose samples can say where in the stream they come from.

:class:`ShardPipeline` runs, in each DataLoader worker, the shards of that worker's slot through
the stages, like ``webdataset.DataPipeline``, with one stage of its own after the first (the one
that turns shards into samples, :class:`~contrastive_dist.data._shard_reader.SlotReader`): it
follows each sample's shard through the slot's plan, drops the samples a resumed state says were
consumed already (read from the tar file, never decoded), and names the shard that cannot be read.

Errors: an exception out of the first stage makes its shard unreadable; one out of a later stage
(decoding, say) is blamed on the sample the reader let through last. ``on_error="raise"`` raises a
``RuntimeError`` naming the shard (and sample), the worker and the rank, chained to the original;
``"skip"`` warns once per skip and goes on: a shard from the next one (a damaged tar from its
intact files on), a sample by building the later stages again over the reader, which is still
where it was.

When :class:`~contrastive_dist.DistributedStreamingBatches` wraps the loader it turns
``positions`` on: every sample then leaves the pipeline as a :class:`Positioned` (its slot, its
shard, the samples of that shard read so far, the skips just before it), and
:class:`PositionedCollate` makes each batch a :class:`PositionedBatch` carrying the position of its
last sample and the skips of the batch; skips after a slot's last sample come in a last item that
holds no sample. Stages that keep samples back (a shuffle buffer) or turn one into several make
those positions run ahead of what a batch holds: resumed from them, the samples they held would be
lost; a stage error is then blamed on the sample read last.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from contrastive_dist.data._shard_reader import SlotReader, check_on_error

if TYPE_CHECKING:
    from contrastive_dist.data.shards import DistributedShardList

__all__ = ["NO_SAMPLE", "Positioned", "PositionedBatch", "PositionedCollate", "ShardPipeline", "track_positions"]

Stage = Callable[[Iterator[Any]], Iterator[Any]]


class _NoSample:
    def __repr__(self) -> str:
        return "NO_SAMPLE"


NO_SAMPLE = _NoSample()  # the sample of a slot's last item when it only reports skips (never leaves its worker)


class Positioned(NamedTuple):
    """A sample and where it was read: the slot, the shard, the samples of that shard read, the skips before it."""

    sample: Any
    slot: int
    shard: int
    consumed: int
    skipped: int


class PositionedBatch(NamedTuple):
    """A collated batch (None: no sample, only skips) with its last item's position and the skips it reports."""

    batch: Any
    slot: int
    shard: int
    consumed: int
    skipped: int


class PositionedCollate:
    """``collate(samples)`` as before; samples that carry positions give a :class:`PositionedBatch`."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        """Collate ``samples``; positioned ones become a batch with its last item's position."""
        if isinstance(samples, Positioned):  # DataLoader(batch_size=None): one sample at a time
            batch = None if samples.sample is NO_SAMPLE else self.collate(samples.sample)
            return PositionedBatch(batch, *samples[1:])
        if samples and isinstance(samples[0], Positioned):
            held = [item.sample for item in samples if item.sample is not NO_SAMPLE]
            last = samples[-1]
            return PositionedBatch(self.collate(held) if held else None, last.slot, last.shard, last.consumed,
                                   sum(item.skipped for item in samples))
        return self.collate(samples)


class ShardPipeline(IterableDataset):
    """``shard_list`` followed by ``stages``, in each worker; see the module docstring.

    Args:
        shard_list: the :class:`~contrastive_dist.DistributedShardList` of the dataset.
        stages: callables from an iterator to an iterator (webdataset stages); the first turns
            ``{"url": ...}`` dicts into samples with ``__url__``.
        on_error: ``"raise"`` (an error naming the shard, the worker and the rank) or ``"skip"``
            (one warning, then the next sample or shard) when a shard or sample cannot be read.

    """

    def __init__(self, shard_list: DistributedShardList, stages: Sequence[Stage], *, on_error: str = "raise") -> None:
        super().__init__()
        if not stages or not all(callable(stage) for stage in stages):
            raise TypeError("pipeline() needs stages, callables from an iterator to an iterator, the first reading "
                            "each shard into samples (webdataset.tarfile_to_samples()); got "
                            f"{[type(stage).__name__ for stage in stages]}")
        self.shard_list, self.stages = shard_list, list(stages)
        self.on_error = check_on_error(on_error)
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
        rank = self.shard_list.rank
        where = f"on rank {rank}" if info is None else f"in DataLoader worker {worker} of rank {rank}"
        reader = SlotReader(self.shard_list.shards, self.shard_list.plan_for(worker, num_workers),
                            worker * self.shard_list.num_replicas + rank, self.stages[0],
                            on_error=self.on_error, where=where, saved_sizes=self.shard_list.saved_sizes)
        source, blamed = reader.samples(), 0
        while True:
            samples: Iterator[Any] = source
            for stage in self.stages[1:]:
                samples = stage(samples)
            try:
                for sample in samples:  # the reader's position is that of the sample the last stage just finished
                    yield self._positioned(sample, reader) if self.positions else sample
                break
            except Exception as error:  # noqa: BLE001 - sorted out below: the reader's own, or a later stage's
                if inspect.getgeneratorstate(source) == inspect.GEN_CLOSED or reader.passed == blamed:
                    raise  # out of the reader (named there), or a stage that fails without taking a new sample
                blamed = reader.passed
                reader.unprocessable(error)  # raises, or the later stages start again on the reader's next sample
        if self.positions and reader.skipped:
            yield self._positioned(NO_SAMPLE, reader)

    @staticmethod
    def _positioned(sample: Any, reader: SlotReader) -> Positioned:
        return Positioned(sample, reader.slot, reader.shard, reader.consumed, reader.take_skipped())


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
