"""Equal step counts for streamed data whose ranks hold different numbers of samples; resumable mid-epoch.

When each rank reads its own shards (see :class:`~contrastive_dist.DistributedShardList`), the
ranks' sample counts differ and a rank that runs out first stops calling DDP's collectives while
the others wait for it: the run hangs at the end of the epoch. Padding by repeating samples or
dropping the surplus breaks "every sample exactly once". :class:`DistributedStreamingBatches`
wraps the rank's loader instead: a rank that has run out yields *empty* batches until every rank
has, so all ranks run the same number of steps and every sample is used once.

Where the agreement runs: DataLoader workers have no process group, so the wrapper runs in the
main process, where the training loop calls ``next()``. As an iteration starts, one exchange checks
that every rank iterates alike: the same lookahead, epoch, workers, ``on_error`` and resumed state,
and over a shard list the same shards in the same order, with files of the same sizes (digests of
the names and of the local files' sizes): a list globbed in another order on one machine would
read some samples twice and others never. Every ``lookahead`` steps it takes up to
``lookahead`` batches from the loader and all-gathers one small int64 row per rank: whether its
loader failed, how many batches it holds, their row counts, and where in the stream each was read.
From that table every rank knows, identically, each step's per-rank sizes (``sizes(step)``, to pass
as ``sizes=`` to a loss, which then skips its own size exchange), whether the epoch is over (a
window in which every rank ran out), and whether a loader raised: then every rank raises the same
``RuntimeError``, naming the rank and its error (an unreadable shard: which one, read by which
worker), within the step; no rank is left waiting in a collective. ``benchmarks/streaming.py``
measures the cost.

Resuming mid-epoch: over a :meth:`DistributedShardList.pipeline`, each batch says where its last
sample was read (its worker's slot, shard and samples of that shard), that travels in the row, and
every rank follows every rank's and worker's progress: :meth:`~DistributedStreamingBatches.state_dict`
on any rank (Lightning saves rank 0's) describes the whole dataset. Only batches the caller
*consumed* count: not those the workers prefetched, the window holds, or the caller fetched ahead
(``caller_prefetch``; Lightning fetches one). Loaded on any number of ranks and workers, the rest
of the epoch is dealt to the new slots; steps keep their numbers, as Lightning's ``batch_idx`` does.

DataLoader workers forked from a process that has joined a gloo group were seen to hang at start
(in C code, some of them); ``multiprocessing_context="forkserver"`` starts them from a clean process.
The loader's workers end when this process does, even killed (``SIGKILL``), and its forkserver then.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from contrastive_dist._dist import GroupLike, get_world_size, is_distributed, process_group
from contrastive_dist.data._shard_pipeline import track_positions
from contrastive_dist.data._shard_progress import EpochShards, list_digests
from contrastive_dist.data._shard_reader import ON_ERROR
from contrastive_dist.data._stream_failure import raise_failure
from contrastive_dist.data._stream_window import (
    StartRow,
    WindowRow,
    check_shard_state,
    check_start,
    control_device,
    count_rows,
    decode_state,
    encode_state,
    gather_rows,
    held_fields,
    progress_digest,
)
from contrastive_dist.data._worker_watch import exit_with_rank, stop_workers

__all__ = ["DistributedStreamingBatches"]

_END = object()
_KEEP_SIZES = 64  # steps of sizes kept behind the newest known one (trainers fetch a batch or two ahead)


class DistributedStreamingBatches:
    """Iterate a rank's own batches so that every rank runs the same number of steps; resumable mid-epoch.

    Args:
        loader: this rank's batches, e.g. a ``DataLoader`` over an ``IterableDataset``; each
            ``iter()`` is one epoch. Its ``collate_fn`` must accept ``[]`` (use
            :class:`~contrastive_dist.EmptySafeCollate` built on one example sample), or pass
            ``empty_batch``. Over a :meth:`DistributedShardList.pipeline`, its ``collate_fn`` is
            wrapped so that batches carry their position in the stream, and the state resumes
            mid-epoch.
        empty_batch: a function returning this rank's batch for a step it has no data for.
        lookahead: batches fetched ahead per exchange; the same on every rank. 1 exchanges every
            step (in place of the loss's own size exchange when its sizes are passed on); ``k``
            exchanges once per ``k`` steps and keeps up to ``k`` batches in memory.
        count_rows: rows of a batch (default: the leading size of its first tensor).
        caller_prefetch: batches the caller fetches ahead of the step it is on (Lightning: 1);
            the state counts them as not consumed until the epoch is over.
        group: the data-parallel ranks of the training, a process group or a device mesh (default: the
            world; [group][option-group]).

    Shape:
        - ``sizes(step)``: a tuple of ``world_size`` ints, the rows each rank holds at ``step``.

    Example:
        >>> import torch
        >>> from torch.utils.data import DataLoader
        >>> from contrastive_dist import EmptySafeCollate
        >>> samples = [(torch.full((2,), float(i)), i) for i in range(5)]
        >>> loader = DataLoader(samples, batch_size=2, collate_fn=EmptySafeCollate(samples))
        >>> batches = DistributedStreamingBatches(loader)       # one process: the loader's own batches
        >>> [(ids.tolist(), batches.sizes(step)) for step, (_, ids) in enumerate(batches)]
        [([0, 1], (2,)), ([2, 3], (2,)), ([4], (1,))]
        >>> state = batches.state_dict()                        # the epoch is over
        >>> state["epoch"], state["step"], state["finished"]
        (0, 3, True)

    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        empty_batch: Callable[[], Any] | None = None,
        lookahead: int = 1,
        count_rows: Callable[[Any], int] = count_rows,
        caller_prefetch: int = 0,
        group: GroupLike = None,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"loader must be iterable (e.g. a DataLoader), got {type(loader).__name__}")
        for name, value, low in (("lookahead", lookahead, 1), ("caller_prefetch", caller_prefetch, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if getattr(loader, "persistent_workers", False):
            raise ValueError(
                "the loader has persistent_workers=True: its workers keep the dataset of the first epoch, "
                "so set_epoch() would never reach the shard assignment; use persistent_workers=False"
            )
        if empty_batch is None:
            collate = getattr(loader, "collate_fn", None)
            if collate is None:
                raise TypeError("the loader has no collate_fn to build an empty batch with; pass empty_batch=")
            empty_batch = _EmptyFromCollate(collate)
        try:
            empty_batch()  # built now, on every rank: a bad template fails at once, not at the epoch's end
        except Exception as error:
            raise TypeError(
                "cannot build an empty batch: the loader's collate_fn([]) (or empty_batch()) raised "
                f"{type(error).__name__}: {error}. Use collate_fn=EmptySafeCollate([example_sample])"
            ) from error
        self.pipeline = track_positions(loader)
        exit_with_rank(loader)  # its workers end with this process, even one killed
        self.loader = loader
        self.empty_batch = empty_batch
        self.lookahead = lookahead
        self.count_rows = count_rows
        self.caller_prefetch = caller_prefetch
        self.group = group
        self.epoch = 0
        self._sizes: dict[int, tuple[int, ...]] = {}
        self._restart()

    def _restart(self) -> None:
        self._first_step, self._steps_done, self._finished, self._skipped = 0, 0, False, 0
        self._pending = False  # a loaded state waits for the next iteration
        self._tracked = self.pipeline is not None  # every batch so far said where it was read

    @property
    def sampler(self) -> DistributedStreamingBatches:
        """Return ``self``: Lightning calls ``train_dataloader.sampler.set_epoch(epoch)``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch here and on the loader's dataset and its stages; another epoch drops a loaded state."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
            raise ValueError(f"epoch must be an int in [0, 2**63), got {epoch!r}")
        if epoch != self.epoch:
            self._restart()
        self.epoch = epoch
        dataset = getattr(self.loader, "dataset", None)
        for target in [dataset, *getattr(dataset, "pipeline", [])]:
            if target is not None and callable(getattr(target, "set_epoch", None)):
                target.set_epoch(epoch)

    def sizes(self, step: int) -> tuple[int, ...]:
        """Return the rows each rank holds at ``step`` of the current epoch (known once exchanged)."""
        if step not in self._sizes:
            known = f"[{min(self._sizes)}, {max(self._sizes)}]" if self._sizes else "none yet"
            raise ValueError(f"the sizes of step {step!r} are not known here; known steps: {known}")
        return self._sizes[step]

    def __iter__(self) -> Iterator[Any]:
        self._sizes = {}
        return self._steps()

    def _steps(self) -> Iterator[Any]:
        group = process_group(self.group)  # a mesh too: resolved once an epoch
        world_size, device = get_world_size(group), control_device(group)
        resume, finished = self._pending, self._pending and self._finished
        if not resume:
            self._restart()
        self._pending, self._finished, self._tracked = False, False, self.pipeline is not None
        workers = getattr(self.loader, "num_workers", 0)
        shards = self.pipeline.shard_list.begin_epoch(workers, resume=resume) if self.pipeline is not None else None
        start = self.pipeline.shard_list.state_dict() if self.pipeline is not None and resume else None
        on_error = self.pipeline.on_error if self.pipeline is not None else "raise"
        if is_distributed(group):
            listed = list_digests(self.pipeline.shard_list.shards) if self.pipeline is not None else ()
            check_start(StartRow(self.lookahead, self.epoch, max(1, workers), ON_ERROR.index(on_error),
                                 self._first_step, progress_digest(start), *listed), world_size, device, group)
        local: Iterator[Any] | None = iter(()) if finished else None  # started at the first fetch
        buffered: deque[tuple[Any, list[int]]] = deque()
        unapplied: deque[list[list[int]]] = deque()
        exhausted, step = False, self._first_step
        while True:
            failure = None
            try:  # whatever the loader raises is sent in the exchange: every rank then raises it
                local = iter(self.loader) if local is None else local  # after begin_epoch: workers take its plan
                while not exhausted and len(buffered) < self.lookahead:
                    item = next(local, _END)
                    if item is _END:
                        exhausted = True
                    else:
                        buffered.append(held_fields(item, self.empty_batch, self.count_rows))
            except Exception as error:  # noqa: BLE001 - any exception of the loader, to every rank below
                failure = error
            row = WindowRow.encode([fields for _, fields in buffered], self.lookahead, failed=failure is not None)
            table = [WindowRow(values) for values in gather_rows(row, world_size, device, group)]
            if any(rank_row.failed for rank_row in table):
                stop_workers(local)  # now: the error raised next holds the loader's frames, and its workers, alive
                local = None
                raise_failure(table, failure, step=step, epoch=self.epoch, world_size=world_size, device=device,
                              group=group)
            window = max(rank_row.held for rank_row in table)
            for offset in range(window):
                self._sizes[step] = tuple(rank_row.rows(offset) for rank_row in table)
                self._sizes.pop(step - _KEEP_SIZES - self.lookahead, None)
                # This rank holds exactly its table[rank].held batches of the window; then it is out.
                batch = buffered.popleft()[0] if buffered else self.empty_batch()
                step += 1
                unapplied.append([[rank_row.field(offset, name) for name in ("slot", "shard", "consumed", "skipped")]
                                  for rank_row in table if offset < rank_row.held])
                while len(unapplied) > self.caller_prefetch:  # what the caller holds ahead is not consumed yet
                    self._consume(shards, unapplied.popleft())
                yield batch
            if window < self.lookahead:  # every rank ran out inside this window: no exchange needed
                break
        while unapplied:
            self._consume(shards, unapplied.popleft())
        if shards is not None:
            shards.finish()
        self._finished = True

    def _consume(self, shards: EpochShards | None, batches: list[list[int]]) -> None:
        """One more step consumed: each rank's batch of it moves its worker's slot on, and counts its skips."""
        self._steps_done += 1
        for slot, shard, consumed, skipped in batches:
            self._skipped += skipped
            if slot < 0 or shards is None:
                self._tracked = False
            else:
                shards.record(slot, shard, consumed)

    def skipped(self) -> int:
        """Unreadable shards and samples skipped (``on_error="skip"``) in the steps consumed this epoch, on every rank.

        A shard that cannot be read counts one, and so does each damaged place of a tar shard whose
        intact rest was read on. The same number on every rank; a resumed epoch counts on from its state. Each skip was
        warned about where it happened (a ``RuntimeWarning`` naming the shard, in that rank's log).
        """
        return self._skipped

    def state_dict(self) -> dict[str, Any]:
        """Where the epoch stands: its steps consumed and, over a shard pipeline, every shard's progress.

        The same on every rank. From a loader whose batches do not say where they were read, the
        state resumes only at an epoch's start or end (``load_state_dict`` refuses it otherwise).
        """
        shards = self.pipeline.shard_list.state_dict() if self.pipeline is not None and self._tracked else None
        return encode_state(epoch=self.epoch, step=self._steps_done, finished=self._finished, skipped=self._skipped,
                            shards=shards)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved epoch at the next ``iter()``, on this layout; steps keep their numbers.

        Raises:
            ValueError: the state cannot be honoured here (another shard list, seed or ``shuffle``;
                a mid-epoch state without shard progress; not a state :meth:`state_dict` made).
        """
        epoch, step, finished, skipped, shards = decode_state(state_dict, tracked=self.pipeline is not None)
        self.set_epoch(epoch)
        if shards is not None:
            assert self.pipeline is not None  # checked by decode_state
            self.pipeline.shard_list.load_state_dict(shards)
            check_shard_state(epoch, step, self.pipeline.shard_list.state_dict())
        self._first_step, self._steps_done, self._finished, self._pending = step, step, finished, True
        self._skipped = skipped


class _EmptyFromCollate:
    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self) -> Any:
        return self.collate([])
