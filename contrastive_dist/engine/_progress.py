"""Where this process stands on each process group: its calls, its collectives, and the one it waits in now.

Every rank makes the package's collectives on a group in the same order, so counting them numbers
them alike on every rank. Two counts are kept per group, in this process only (nothing travels):

* **calls**: the agreements entered (a loss call, an ``all_gather`` without ``sizes=``, a
  SyncBatchNorm step, ...). The agreement carries the count, so a rank whose call left before its
  exchange (it raised there, and the caller caught the error) is named a call behind at the next
  one, and every rank then takes the highest count: the ranks are in step again.
* **operations**: the package's collectives begun (one per waited collective; a ring hop counts once).
  Two ranks that wait in operations of the *same number* but of different kinds wait in collectives
  that can never meet: one of them skipped a collective the other made (a backward, a layer's
  forward). :mod:`~contrastive_dist.engine._crossed` asks the ranks for their standing
  (:func:`standing`) when a wait drags on, and finds exactly that.

A rank that waits in a collective of another library (``torch.distributed.barrier`` called where
the others call a loss) is found from its threads' Python frames (:func:`foreign_collective`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["GroupProgress", "begin_operation", "foreign_collective", "kind", "next_call", "progress",
           "resync_calls", "standing", "waiting"]


@dataclass
class GroupProgress:
    """The standing of this process on one group (see the module docstring)."""

    calls: int = 0
    operations: int = 0
    waiting: str = ""  # the collective this rank waits in now ("": none)
    last_kind: str = ""  # the kind of the last collective begun
    out_of_step: str = ""  # why the group's collectives can no longer meet, once found
    at_fault: tuple[int, ...] = ()  # the ranks named in it


_progress: dict[int, tuple[ProcessGroup, GroupProgress]] = {}
_lock = threading.Lock()


def _pg(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


def progress(group: ProcessGroup | None) -> GroupProgress:
    """The record of this process for ``group`` (made on first use)."""
    pg = _pg(group)
    entry = _progress.get(id(pg))
    if entry is None or entry[0] is not pg:
        with _lock:
            entry = (pg, GroupProgress())
            _progress[id(pg)] = entry
    return entry[1]


def kind(operation: str) -> str:
    """What every rank calls the same collective: its name without the part that differs by rank.

    Example:
        >>> kind("gather (broadcast of rank 2's rows)"), kind("ring step 2 of 3 (sending to rank 0)")
        ('gather', 'ring step 2 of 3')
    """
    return operation.split(" (", 1)[0]


def next_call(group: ProcessGroup | None) -> int:
    """Count one more agreement on ``group``; its number."""
    record = progress(group)
    record.calls += 1
    return record.calls


def resync_calls(group: ProcessGroup | None, calls: int) -> None:
    """Take ``calls`` (the highest count of the group's ranks) as this rank's count: the ranks are in step again."""
    progress(group).calls = calls


def begin_operation(group: ProcessGroup | None, operation: str) -> int:
    """Count one more collective on ``group``; its number."""
    record = progress(group)
    record.operations += 1
    record.last_kind = kind(operation)
    return record.operations


@contextmanager
def waiting(group: ProcessGroup | None, operation: str) -> Iterator[GroupProgress]:
    """Mark this rank as waiting in ``operation`` on ``group`` for the block; its record."""
    record = progress(group)
    record.waiting = operation
    try:
        yield record
    finally:
        record.waiting = ""


def standing(group: ProcessGroup | None) -> dict[str, Any]:
    """The standing of this rank on ``group``, as sent to a rank that asks (``_crossed``)."""
    record = progress(group)
    foreign = None if record.waiting else foreign_collective()
    return {"calls": record.calls, "operations": record.operations, "waiting": record.waiting,
            "foreign": foreign}


_TORCH_DISTRIBUTED = ("torch/distributed/", "torch\\distributed\\")
_PACKAGE = ("contrastive_dist/", "contrastive_dist\\")
_C10D = "distributed_c10d.py"


def _frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def foreign_collective() -> dict[str, Any] | None:
    """A collective of ``torch.distributed`` that a thread of this process blocks in, called from outside the package.

    Returns:
        ``{"name", "where", "ranks"}``: the function (``"barrier"``), the caller's ``file:line``, and the
        global ranks of its group; or ``None``.
    """
    this_thread = threading.get_ident()
    for thread, frame in sys._current_frames().items():
        if thread == this_thread:
            continue
        found = _blocking_call(frame)
        if found is not None:
            return found
    return None


def _blocking_call(innermost: FrameType) -> dict[str, Any] | None:
    calls = [frame for frame in _frames(innermost) if frame.f_code.co_filename.endswith(_C10D)]
    if not calls:
        return None
    outermost = calls[-1]  # the public function called (inner frames are its helpers)
    caller = next((frame for frame in _frames(outermost)
                   if not any(part in frame.f_code.co_filename for part in _TORCH_DISTRIBUTED)), None)
    if caller is None or any(part in caller.f_code.co_filename for part in _PACKAGE):
        return None  # the package's own use of torch's collectives (its error exchange): every rank makes it
    group = outermost.f_locals.get("group")
    try:
        ranks = dist.get_process_group_ranks(group if isinstance(group, ProcessGroup) else dist.group.WORLD)
    except (RuntimeError, ValueError, AttributeError):  # a group this rank is not in, or gone: unknown
        ranks = []
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
    return {"name": f"torch.distributed.{outermost.f_code.co_name}", "where": where, "ranks": list(ranks)}
