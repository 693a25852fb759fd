"""Shards assigned to ranks and DataLoader workers without overlap, in a new order each epoch; resumable.

Streaming datasets (webdataset, litdata, Mosaic streaming, your own tar or parquet reader) are
lists of *shards*, each holding many samples. Under data parallelism every (rank, worker) pair must
read its own shards, or samples repeat. :class:`DistributedShardList` is the first stage of such a
pipeline: in each DataLoader worker it yields the shards of that worker on that rank, as
``{"url": shard}`` dicts like ``webdataset.SimpleShardList``, so any webdataset stage can follow it.

Assignment: the ``num_replicas * num_workers`` (rank, worker) *slots* are numbered worker-major
(``slot = worker * num_replicas + rank``) and shard ``i`` of the epoch's order goes to slot
``i % slots``: consecutive shards go to different *ranks* first, which spreads a short shard list
over the ranks rather than over one rank's workers. Every shard is read exactly once per
epoch; with fewer shards than slots some slots read nothing (their rank then runs out early,
which :class:`~contrastive_dist.DistributedStreamingBatches` absorbs with empty batches). The epoch's
order of the shards is a seeded permutation of ``(seed, epoch)`` (the same as
:class:`~contrastive_dist.DistributedBatchSampler`'s), so every rank computes the same assignment
without communicating, and which shards land together changes every epoch.

Resuming mid-epoch: the state (:meth:`~DistributedShardList.state_dict`) says, per shard, whether
it is untouched, finished or in progress and how many of its samples were consumed: the whole
dataset's progress, the same on every rank, whatever the layout. Loaded into a shard list on any
number of ranks and workers, the rest of the epoch is dealt to its slots: the shards in progress
first, then the untouched ones. Its progress is kept by :class:`~contrastive_dist.DistributedStreamingBatches`,
which knows what was consumed, over a :meth:`~DistributedShardList.pipeline`, which skips the
consumed samples of a shard before they reach the decoding stages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from contrastive_dist._dist import GroupLike, get_rank, get_world_size
from contrastive_dist.data._permutation import Permutation
from contrastive_dist.data._shard_pipeline import ShardPipeline
from contrastive_dist.data._shard_progress import EpochShards, decode_progress, encode_progress

__all__ = ["DistributedShardList"]


class DistributedShardList(IterableDataset):
    """The shards one DataLoader worker of one rank reads this epoch, as ``{"url": shard}`` dicts.

    Rank and world size are read from the process group at construction, in the main process:
    DataLoader workers have no process group, and they receive a copy of this object. A fresh copy
    is sent at every epoch unless the loader keeps its workers (``persistent_workers=True``), in
    which case :meth:`set_epoch` could not reach them; :class:`~contrastive_dist.DistributedStreamingBatches`
    refuses such a loader.

    Args:
        shards: the shard names or URLs of the whole dataset, in the same order on every rank; distinct.
        shuffle: a new order of the shards each epoch (``False``: shard ``i`` to slot ``i % slots``).
        seed: seed of the shard order, any signed 64-bit int; the same on every rank.
        num_replicas: number of ranks (default: the size of ``group``, 1 without a process group).
        rank: this rank (default: the rank in ``group``, 0 without a process group).
        group: the data-parallel ranks, a process group or a device mesh, the defaults are read from
            ([group][option-group]).

    Example:
        >>> shards = DistributedShardList([f"data-{i:03d}.tar" for i in range(5)], shuffle=False,
        ...                               num_replicas=2, rank=1)
        >>> [item["url"] for item in shards]                    # no DataLoader worker: one slot per rank
        ['data-001.tar', 'data-003.tar']
        >>> shards.shards_for(worker=1, num_workers=2)          # rank 1, worker 1 of 2: slot 3 of 4
        ['data-003.tar']
        >>> shards.shards_for(worker=2, num_workers=3)          # 6 slots for 5 shards: slot 5 reads none
        []
        >>> state = shards.state_dict()                         # the epoch's progress, per shard
        >>> state["epoch"], state["progress"]
        (0, [0, 0, 0, 0, 0])

    """

    def __init__(
        self,
        shards: Sequence[Any],
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        group: GroupLike = None,
    ) -> None:
        super().__init__()
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence):
            raise TypeError(f"shards must be a sequence (list or tuple) of shard names, got {type(shards).__name__}")
        if len(shards) == 0:
            raise ValueError("shards must hold at least one shard, got an empty sequence")
        repeated = sorted(name for name, count in Counter(map(str, shards)).items() if count > 1)
        if repeated:
            raise ValueError(f"shards must be distinct (each is read once per epoch), got {repeated[:3]} twice or more")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        self.shards = list(shards)
        self.shuffle = shuffle
        self.num_replicas = _positive("num_replicas", get_world_size(group) if num_replicas is None else num_replicas)
        self.rank = get_rank(group) if rank is None else rank
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank must be an int in [0, num_replicas={self.num_replicas}), got {self.rank!r}")
        Permutation(len(self.shards), seed)  # validates the seed (type and 64-bit range) now, not in a worker
        self.seed = seed
        self.epoch = 0
        # The progress per shard the next iteration of this epoch starts from (None: a fresh epoch), and, in
        # the main process, the plan and progress of the iteration under way (kept by DistributedStreamingBatches).
        self._start: list[int] | None = None
        self._current: EpochShards | None = None
        self.saved_sizes: dict[int, int] = {}  # of the shards in progress in the loaded state, by index

    def set_epoch(self, epoch: int) -> None:
        """Use the shard order of ``epoch`` from the next ``iter()`` on; a state loaded for another epoch is dropped."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
            raise ValueError(f"epoch must be an int in [0, 2**63), got {epoch!r}")
        if epoch != self.epoch:
            self._start, self._current, self.saved_sizes = None, None, {}
        self.epoch = epoch

    def _epoch_shards(self, slots: int) -> EpochShards:
        positions = torch.arange(len(self.shards), dtype=torch.int64)
        order = Permutation(len(self.shards), self.seed, self.epoch)(positions) if self.shuffle else positions
        return EpochShards(order.tolist(), self._start or [0] * len(self.shards), slots)

    def _slot(self, worker: int, num_workers: int) -> int:
        _positive("num_workers", num_workers)
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < num_workers:
            raise ValueError(f"worker must be an int in [0, num_workers={num_workers}), got {worker!r}")
        return worker * self.num_replicas + self.rank

    def plan_for(self, worker: int = 0, num_workers: int = 1) -> list[tuple[int, int]]:
        """``(shard index, samples already consumed)`` of each shard ``worker`` (of ``num_workers``) reads here."""
        slot = self._slot(worker, num_workers)
        return self._epoch_shards(self.num_replicas * num_workers).plan(slot)

    def shards_for(self, worker: int = 0, num_workers: int = 1) -> list[Any]:
        """Return the shards of ``worker`` (of ``num_workers``) on this rank in the current epoch."""
        return [self.shards[index] for index, _ in self.plan_for(worker, num_workers)]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        for index, consumed in self.plan_for(worker, num_workers):
            # A shard in progress says how many samples to skip; pipeline() does, a reader of its own must.
            yield {"url": self.shards[index], **({"skip": consumed} if consumed else {})}

    def pipeline(self, *stages: Callable[[Iterator[Any]], Iterator[Any]], on_error: str = "raise") -> IterableDataset:
        """Return the shard list followed by ``stages``: a dataset whose mid-epoch progress can be saved and resumed.

        ``stages[0]`` turns ``{"url": shard}`` dicts into samples that name their shard in
        ``__url__`` (``webdataset.tarfile_to_samples()`` does); the consumed samples of a shard in
        progress are dropped right after it, before any later stage (decoding) sees them. Use it
        in place of ``webdataset.DataPipeline(shard_list, *stages)`` under a
        :class:`~contrastive_dist.DistributedStreamingBatches`, which then records what was consumed.

        ``on_error`` says what an unreadable shard (missing, empty, not a tar, cut short: anything
        ``stages[0]`` raises on it) or sample (a later stage raised on it) does: ``"raise"`` a
        ``RuntimeError`` naming the shard, the DataLoader worker and the rank, chained to the original
        (under a ``DistributedStreamingBatches``, every rank then raises the same error); ``"skip"``
        it with one ``RuntimeWarning`` naming it, the rest of a shard at once, and go on
        (``DistributedStreamingBatches.skipped()`` counts the skips over every rank). As ``tarfile``
        ends a tar silently at an invalid, zeroed or cut header, every ``.tar`` shard is checked to
        have been read to its end (a local file by its headers, a stream by what is left of it): a
        shortfall is damage at that byte, raised, or skipped with the shard's intact files read on
        from a temporary copy of them (local files).
        """
        return ShardPipeline(self, stages, on_error=on_error)

    def begin_epoch(self, num_workers: int, *, resume: bool) -> EpochShards:
        """Start an iteration in the main process: the loaded state's rest of the epoch, or a fresh epoch."""
        if not resume:
            self._start, self.saved_sizes = None, {}
        self._current = self._epoch_shards(self.num_replicas * max(1, num_workers))
        return self._current

    def state_dict(self) -> dict[str, Any]:
        """The epoch and each shard's progress: 0 untouched, -1 finished, ``k > 0`` samples consumed."""
        progress = self._current.progress if self._current is not None else self._start or [0] * len(self.shards)
        return encode_progress(progress, epoch=self.epoch, seed=self.seed, shuffle=self.shuffle, shards=self.shards)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved epoch from the next ``iter()``, dealt to this layout's slots.

        A shard in progress whose file has another size than when the state was saved was rewritten
        since: reading it raises an error naming it, or, with ``on_error="skip"``, skips it with a
        warning and counts it (:meth:`pipeline`).

        Raises:
            ValueError: another list of shards (by file name), seed or ``shuffle``, a state that
                :meth:`state_dict` did not make, or one that says more samples of a shard were
                consumed than its file could hold; the message says what differs.
        """
        self.epoch, self._start, self.saved_sizes = decode_progress(state_dict, seed=self.seed, shuffle=self.shuffle,
                                                                    shards=self.shards)
        self._current = None

    def __getstate__(self) -> dict[str, Any]:
        # Workers get the plan's start, not the main process's live progress (its size grows with the shards).
        return {**self.__dict__, "_current": None}


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value
