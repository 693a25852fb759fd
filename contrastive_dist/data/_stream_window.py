"""What :class:`~contrastive_dist.DistributedStreamingBatches` exchanges per window, how, and the state it saves.

The row each rank sends per window is ``[held, then per batch slot of the window: rows, slot, shard,
consumed]`` (int64): how many batches it holds and, per batch, its row count and where its last
sample was read (-1 where a batch carries no position, or is not held). A field is one more name in
:data:`BATCH_FIELDS` (or a head field before ``held``): both ends read rows through :class:`WindowRow`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import is_distributed
from contrastive_dist.engine._wire import all_gather_single

__all__ = ["BATCH_FIELDS", "WindowRow", "control_device", "count_rows", "decode_state", "encode_state", "gather_rows",
           "progress_digest"]

BATCH_FIELDS = ("rows", "slot", "shard", "consumed")
NO_POSITION = (-1, -1, -1)
FORMAT = "contrastive_dist.DistributedStreamingBatches"
VERSION = 1


class WindowRow:
    """One rank's row of a window: encode what this rank holds, read what another rank sent."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values = list(values)

    @staticmethod
    def encode(held: Sequence[tuple[int, tuple[int, int, int]]], lookahead: int) -> list[int]:
        """``held``: per batch ``(rows, (slot, shard, consumed))``, at most ``lookahead`` of them."""
        row = [len(held)]
        for rows, position in held:
            row += [rows, *position]
        return row + [0, *NO_POSITION] * (lookahead - len(held))

    @property
    def held(self) -> int:
        return self.values[0]

    def rows(self, offset: int) -> int:
        """Rows of the batch at ``offset`` in the window (0 once this rank is out)."""
        return self.values[1 + len(BATCH_FIELDS) * offset] if offset < self.held else 0

    def position(self, offset: int) -> tuple[int, int, int] | None:
        """``(slot, shard, consumed)`` of the batch at ``offset``; None if it carries none or is not held."""
        if offset >= self.held:
            return None
        start = 2 + len(BATCH_FIELDS) * offset
        slot, shard, consumed = self.values[start : start + 3]
        return None if slot < 0 else (slot, shard, consumed)


def gather_rows(row: list[int], world_size: int, device: torch.device, group: ProcessGroup | None) -> list[list[int]]:
    """Every rank's ``row`` (the same length on every rank), in rank order: one small all-gather."""
    local = torch.tensor([row], dtype=torch.int64, device=device)
    if world_size == 1:
        return local.tolist()
    table = local.new_empty((world_size, len(row)))
    all_gather_single(table, local, group=group)
    return table.tolist()


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


def encode_state(*, epoch: int, step: int, finished: bool, shards: dict[str, Any] | None) -> dict[str, Any]:
    """The wrapper's state: the epoch, its steps consumed, whether it is over, and the shard list's progress."""
    return {"format": FORMAT, "version": VERSION, "epoch": epoch, "step": step, "finished": finished, "shards": shards}


def decode_state(state: object) -> tuple[int, int, bool, Any]:
    """``(epoch, step, finished, shard state)`` of a state :func:`encode_state` made; ``ValueError`` otherwise."""
    keys = ("format", "version", "epoch", "step", "finished", "shards")
    if not isinstance(state, Mapping) or any(key not in state for key in keys):
        found = sorted(map(str, state)) if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"cannot resume: expected a dict made by DistributedStreamingBatches.state_dict() with the "
                         f"keys {list(keys)}, got {found}")
    if state["format"] != FORMAT or state["version"] != VERSION:
        raise ValueError(f"cannot resume: expected a stream state of format {FORMAT!r} version {VERSION}, got "
                         f"{state['format']!r} version {state['version']!r}")
    epoch, step, finished = state["epoch"], state["step"], state["finished"]
    for name, value in (("epoch", epoch), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise ValueError(f"cannot resume: the stream state's {name!r} must be an int in [0, 2**63), got {value!r}")
    if not isinstance(finished, bool):
        raise ValueError(f"cannot resume: the stream state's 'finished' must be a bool, got {finished!r}")
    return epoch, step, finished, state["shards"]
