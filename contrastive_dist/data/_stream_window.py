"""What :class:`~contrastive_dist.DistributedStreamingBatches` exchanges per window, how, and the state it saves.

The row each rank sends per window is ``[status, held, then per batch slot of the window: rows, slot,
shard, consumed, skipped]`` (int64): whether its loader failed, how many batches it holds and, per
batch, its row count, where its last sample was read (-1 where a batch carries no position, or is not
held) and the unreadable shards and samples skipped before it. A field is one more name in
:data:`BATCH_FIELDS` or :data:`HEAD_FIELDS`: both ends read rows through :class:`WindowRow`. A
window in which a rank failed is followed by one more exchange, of the error texts
(:mod:`~contrastive_dist.data._stream_failure`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import is_distributed
from contrastive_dist.data._shard_pipeline import PositionedBatch
from contrastive_dist.data._shard_reader import ON_ERROR
from contrastive_dist.engine._wire import all_gather_single

__all__ = ["BATCH_FIELDS", "HEAD_FIELDS", "NO_POSITION", "StartRow", "WindowRow", "check_shard_state", "check_start",
           "control_device", "count_rows", "decode_state", "encode_state", "gather_rows", "held_fields",
           "progress_digest"]

HEAD_FIELDS = ("status", "held")
BATCH_FIELDS = ("rows", "slot", "shard", "consumed", "skipped")
NO_POSITION = (-1, -1, -1)
OK, FAILED = 0, 1
FORMAT = "contrastive_dist.DistributedStreamingBatches"
VERSION = 1


class WindowRow:
    """One rank's row of a window: encode what this rank holds, read what another rank sent."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values = list(values)

    @staticmethod
    def encode(held: Sequence[Sequence[int]], lookahead: int, *, failed: bool = False) -> list[int]:
        """``held``: per batch its :data:`BATCH_FIELDS`, at most ``lookahead`` of them; ``failed``: it raised."""
        row = [FAILED if failed else OK, len(held)]
        for fields in held:
            row += fields
        return row + [0, *NO_POSITION, 0] * (lookahead - len(held))

    @property
    def failed(self) -> bool:
        return self.values[HEAD_FIELDS.index("status")] == FAILED

    @property
    def held(self) -> int:
        return self.values[HEAD_FIELDS.index("held")]

    def field(self, offset: int, name: str) -> int:
        """Field ``name`` of the batch at ``offset`` in the window (its empty value once this rank is out)."""
        if offset >= self.held:
            return -1 if name in ("slot", "shard", "consumed") else 0
        return self.values[len(HEAD_FIELDS) + len(BATCH_FIELDS) * offset + BATCH_FIELDS.index(name)]

    def rows(self, offset: int) -> int:
        """Rows of the batch at ``offset`` in the window (0 once this rank is out)."""
        return self.field(offset, "rows")

    def position(self, offset: int) -> tuple[int, int, int] | None:
        """``(slot, shard, consumed)`` of the batch at ``offset``; None if it carries none or is not held."""
        slot, shard, consumed = (self.field(offset, name) for name in ("slot", "shard", "consumed"))
        return None if slot < 0 else (slot, shard, consumed)


def held_fields(item: Any, empty_batch: Callable[[], Any], count_rows: Callable[[Any], int]) -> tuple[Any, list[int]]:
    """A batch from the loader and its :data:`BATCH_FIELDS`; a :class:`PositionedBatch` of skips only is empty."""
    if isinstance(item, PositionedBatch):
        batch = empty_batch() if item.batch is None else item.batch
        return batch, [count_rows(batch), item.slot, item.shard, item.consumed, item.skipped]
    return item, [count_rows(item), *NO_POSITION, 0]


def gather_rows(row: list[int], world_size: int, device: torch.device, group: ProcessGroup | None) -> list[list[int]]:
    """Every rank's ``row`` (the same length on every rank), in rank order: one small all-gather."""
    local = torch.tensor([row], dtype=torch.int64, device=device)
    if world_size == 1:
        return local.tolist()
    table = local.new_empty((world_size, len(row)))
    all_gather_single(table, local, group=group, operation="stream lookahead exchange")
    return table.tolist()


class StartRow(NamedTuple):
    """What every rank must agree on as an iteration starts (``on_error``: its index in ``ON_ERROR``).

    The last four are the shard list's :func:`~contrastive_dist.data._shard_progress.list_digests` (zeros
    without a shard list).
    """

    lookahead: int
    epoch: int
    workers: int
    on_error: int
    first_step: int
    progress: int
    shards: int = 0
    order: int = 0
    files: int = 0
    sizes: int = 0


def check_start(row: StartRow, world_size: int, device: torch.device, group: ProcessGroup | None) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks start an iteration with different :class:`StartRow`."""
    table = [StartRow(*values) for values in gather_rows(list(row), world_size, device, group)]
    if len({start[:6] for start in table}) > 1:
        described = ", ".join(f"rank {rank}: lookahead={start.lookahead} epoch={start.epoch} workers={start.workers} "
                              f"on_error={ON_ERROR[start.on_error]!r} resumed at step {start.first_step} (progress "
                              f"{start.progress:x})" for rank, start in enumerate(table))
        raise ValueError(f"every rank must iterate with the same lookahead, epoch, number of workers, on_error and "
                         f"resumed state, got {described}")
    if len({start[6:] for start in table}) > 1:
        described = "\n".join(f"  rank {rank}: {start.shards} shards{_shard_difference(start, table[0])}"
                               for rank, start in enumerate(table))
        raise ValueError("every rank must stream the same list of shards, in the same order (sort a glob's result: "
                         "its order differs between machines), with files of the same sizes:\n" + described)


def _shard_difference(start: StartRow, first: StartRow) -> str:
    """How a rank's shard list differs from rank 0's, as far as the digests tell."""
    if start.files != first.files:
        return ", other files than rank 0's"
    if start.sizes != first.sizes:
        return ", the same file names as rank 0's, some of another size"
    if start.order != first.order:
        return ", the same files as rank 0's in another order"
    return ""


def control_device(group: ProcessGroup | None) -> torch.device:
    """Where the small exchanged rows live: beside the data the backend serves (CUDA under NCCL)."""
    if is_distributed(group) and "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def count_rows(batch: Any) -> int:
    """Rows of a collated batch: the leading size of its first tensor, else the length of a list."""
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, Iterable) and not isinstance(values, (str, bytes)):
        for value in values:
            if isinstance(value, (Tensor, Mapping)) or (isinstance(value, Sequence) and not isinstance(value, str)):
                return count_rows(value)
        if isinstance(batch, Sequence):
            return len(batch)
    raise TypeError(f"cannot count the rows of a {type(batch).__name__}; pass count_rows=")


def progress_digest(state: Mapping[str, Any] | None) -> int:
    """A 62-bit digest of a shard state's progress, for the ranks to check they resume the same one."""
    if state is None:
        return 0
    text = ",".join(map(str, state["progress"]))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


def encode_state(*, epoch: int, step: int, finished: bool, skipped: int,
                 shards: dict[str, Any] | None) -> dict[str, Any]:
    """The wrapper's state: the epoch, its steps consumed, whether it is over, the skips, the shard list's progress."""
    return {"format": FORMAT, "version": VERSION, "epoch": epoch, "step": step, "finished": finished,
            "skipped": skipped, "shards": shards}


def decode_state(state: object, *, tracked: bool) -> tuple[int, int, bool, int, Any]:
    """``(epoch, step, finished, skipped, shard state)`` of a state :func:`encode_state` made; else ``ValueError``.

    ``tracked``: the loader's batches say where they were read (a shard pipeline), so a state with
    shard progress can resume mid-epoch. A state saved before skips were counted loads with none.
    """
    keys = ("format", "version", "epoch", "step", "finished", "shards")
    if not isinstance(state, Mapping) or any(key not in state for key in keys):
        found = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"cannot resume: expected a dict made by DistributedStreamingBatches.state_dict() with the "
                         f"keys {list(keys)}, got {found}")
    if state["format"] != FORMAT or state["version"] != VERSION:
        raise ValueError(f"cannot resume: expected a stream state of format {FORMAT!r} version {VERSION}, got "
                         f"{state['format']!r} version {state['version']!r}")
    epoch, step, finished, skipped = state["epoch"], state["step"], state["finished"], state.get("skipped", 0)
    for name, value in (("epoch", epoch), ("step", step), ("skipped", skipped)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise ValueError(f"cannot resume: the stream state's {name!r} must be an int in [0, 2**63), got {value!r}")
    if not isinstance(finished, bool):
        raise ValueError(f"cannot resume: the stream state's 'finished' must be a bool, got {finished!r}")
    if state["shards"] is None and step and not finished:
        raise ValueError("cannot resume mid-epoch: the state was saved from a loader whose batches do not say "
                         "where in the stream they were read; build its dataset with "
                         "DistributedShardList.pipeline(...) (streaming_loader does), or resume at an epoch's end")
    if state["shards"] is not None and not tracked:
        raise ValueError("cannot resume mid-epoch: the state holds shard progress, but this loader's dataset is "
                         "not a DistributedShardList.pipeline(...) that could skip what was consumed")
    return epoch, step, finished, skipped, state["shards"]


def check_shard_state(epoch: int, step: int, shards: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if the loaded shard state does not go with the stream's ``epoch`` and ``step``."""
    if shards["epoch"] != epoch:
        raise ValueError(f"cannot resume: the stream state is of epoch {epoch}, its shard state of epoch "
                         f"{shards['epoch']}")
    if (step == 0) != all(value == 0 for value in shards["progress"]):
        raise ValueError(f"cannot resume: the stream state says {step} steps were consumed, its shard "
                         "progress says otherwise")
