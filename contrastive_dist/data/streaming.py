"""Equal step counts for streamed data whose ranks hold different numbers of samples.

When each rank reads its own shards (see :class:`~contrastive_dist.DistributedShardList`), the
ranks' sample counts differ and a rank that runs out first stops calling DDP's collectives while
the others wait for it: the run hangs at the end of the epoch. Padding by repeating samples or
dropping the surplus breaks "every sample exactly once". :class:`DistributedStreamingBatches`
wraps the rank's loader instead: a rank that has run out yields *empty* batches until every rank
has, so all ranks run the same number of steps and every sample is used once.

Where the agreement runs, and what it costs: DataLoader workers have no process group, so the
ranks cannot agree inside the dataset or the collate function. The wrapper runs in the main
process, where the training loop calls ``next()``: every ``lookahead`` steps it takes up to
``lookahead`` batches from the loader and all-gathers one small int64 row per rank — how many
batches it holds and their row counts. From that table every rank knows, identically, how many
steps the window has, each step's per-rank sizes (``sizes(step)``, to pass as
``all_gather(..., sizes=...)`` or ``loss(..., sizes=...)``, which then skip their own size
exchange: with ``lookahead=1`` the wrapper's exchange takes the place of the loss's rather than
adding one; ``benchmarks/streaming.py`` measures both), and whether the epoch is over (a window
in which every rank ran out). Ranks call ``next()`` at the same point of the same loop, so the
exchange is ordered like every other collective.

DataLoader workers forked from a process that has joined a gloo group were seen to hang at start
(in C code, some of them); ``multiprocessing_context="forkserver"`` starts them from a clean process.

Resuming in the middle of an epoch is not supported (a stream cannot seek): a restored run starts
its epoch again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import get_world_size, is_distributed
from contrastive_dist.engine._wire import all_gather_single

__all__ = ["DistributedStreamingBatches"]

_KEEP_SIZES = 64  # steps of sizes kept behind the newest known one (trainers fetch a batch or two ahead)


def _count_rows(batch: Any) -> int:
    """Rows of a collated batch: the leading size of its first tensor, else the length of a list."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, Iterable) and not isinstance(values, (str, bytes)):
        for value in values:
            if isinstance(value, (Tensor, Mapping)) or (isinstance(value, Sequence) and not isinstance(value, str)):
                return _count_rows(value)
        if isinstance(batch, Sequence):
            return len(batch)
    raise TypeError(f"cannot count the rows of a {type(batch).__name__}; pass count_rows=")


class DistributedStreamingBatches:
    """Iterate a rank's own batches so that every rank runs the same number of steps.

    Args:
        loader: this rank's batches, e.g. a ``DataLoader`` over an ``IterableDataset``; each
            ``iter()`` is one epoch. Its ``collate_fn`` must accept ``[]`` (use
            :class:`~contrastive_dist.EmptySafeCollate` built on one example sample), or pass
            ``empty_batch``.
        empty_batch: a function returning this rank's batch for a step it has no data for.
        lookahead: batches fetched ahead per exchange; the same on every rank. 1 exchanges every
            step (in place of the loss's own size exchange when its sizes are passed on); ``k``
            exchanges once per ``k`` steps and keeps up to ``k`` batches in memory.
        count_rows: rows of a batch (default: the leading size of its first tensor).
        group: the process group of the training (default: the world).

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

    """

    def __init__(
        self,
        loader: Iterable[Any],
        *,
        empty_batch: Callable[[], Any] | None = None,
        lookahead: int = 1,
        count_rows: Callable[[Any], int] = _count_rows,
        group: ProcessGroup | None = None,
    ) -> None:
        if not isinstance(loader, Iterable):
            raise TypeError(f"loader must be iterable (e.g. a DataLoader), got {type(loader).__name__}")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"lookahead must be an int >= 1, got {lookahead!r}")
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
        self.loader = loader
        self.empty_batch = empty_batch
        self.lookahead = lookahead
        self.count_rows = count_rows
        self.group = group
        self.epoch = 0
        self._sizes: dict[int, tuple[int, ...]] = {}

    @property
    def sampler(self) -> DistributedStreamingBatches:
        """Return ``self``: Lightning calls ``train_dataloader.sampler.set_epoch(epoch)``."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch here and on the loader's dataset (and a webdataset pipeline's stages)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
            raise ValueError(f"epoch must be an int in [0, 2**63), got {epoch!r}")
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
        world_size = get_world_size(self.group)
        device = _control_device(self.group)
        self._check_agreement(world_size, device)
        local = iter(self.loader)
        buffered: deque[Any] = deque()
        exhausted = False
        step = 0
        while True:
            while not exhausted and len(buffered) < self.lookahead:
                try:
                    buffered.append(next(local))
                except StopIteration:
                    exhausted = True
            row = [len(buffered), *(self.count_rows(batch) for batch in buffered)]
            row += [0] * (self.lookahead + 1 - len(row))
            table = self._gather(row, world_size, device)
            held = [counts[0] for counts in table]
            if max(held) == 0:
                return
            for offset in range(max(held)):
                self._sizes[step] = tuple(counts[1 + offset] if offset < counts[0] else 0 for counts in table)
                self._sizes.pop(step - _KEEP_SIZES - self.lookahead, None)
                # This rank holds exactly its table[rank][0] batches of the window; then it is out.
                batch = buffered.popleft() if buffered else self.empty_batch()
                step += 1
                yield batch
            if max(held) < self.lookahead:  # every rank ran out inside this window: no exchange needed
                return

    def _gather(self, row: list[int], world_size: int, device: torch.device) -> list[list[int]]:
        local = torch.tensor([row], dtype=torch.int64, device=device)
        if world_size == 1:
            return local.tolist()
        table = local.new_empty((world_size, len(row)))
        all_gather_single(table, local, group=self.group, operation="streaming step sizes")
        return table.tolist()

    def _check_agreement(self, world_size: int, device: torch.device) -> None:
        """Raise on every rank if the ranks disagree on ``lookahead`` or the epoch (a fixed-size exchange)."""
        if not is_distributed(self.group):
            return
        table = self._gather([self.lookahead, self.epoch], world_size, device)
        if len({tuple(row) for row in table}) > 1:
            described = ", ".join(f"rank {rank}: lookahead={row[0]} epoch={row[1]}" for rank, row in enumerate(table))
            raise ValueError(f"every rank must iterate with the same lookahead and epoch, got {described}")


def _control_device(group: ProcessGroup | None) -> torch.device:
    """Where the small exchanged rows live: beside the data the backend serves (CUDA under NCCL)."""
    if is_distributed(group) and "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _EmptyFromCollate:
    def __init__(self, collate: Callable[[list[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self) -> Any:
        return self.collate([])
