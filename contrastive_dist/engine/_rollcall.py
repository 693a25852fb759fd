"""Who is gone: a roll call through the store that every rank of a process group already shares.

A transport failure tells a rank only about the peer its own transfer talked to, and a rank waiting
on a live peer learns nothing at all: with four or more ranks, the rank that died is often not the
one a survivor waits for (a ring hop, gloo's ring all-gather), and a neighbour that stays alive
after its own error (to log or checkpoint) would leave the others waiting out the process group's
timeout. So on a failure the ranks ask one another, through the group's c10d store (the one
``init_process_group`` rendezvoused on, which every rank can reach without the broken transport):

1. A rank whose transfer failed raises the *alarm*: it sets ``alarm/<n>`` (``n`` numbers the
   incidents of the group, so a later one is told apart) and answers ``alive/<n>/<rank>``.
2. Every live rank answers within a fraction of a second: a rank waiting in one of the package's
   collectives checks the alarm between short slices of its wait, and a small thread answers
   for a rank that is elsewhere (still computing, or alive after its own error). The thread starts
   with the package's first collective on the group and only reads the store until an alarm.
3. After :data:`ROLL_CALL_S` seconds (or as soon as every rank answered), the ranks that did not
   answer are *gone*: their process exited or was killed. The first rank to know publishes the
   verdict, so every rank names the same ranks, and a waiting rank then raises instead of waiting.
4. A group that lost ranks stays broken, so a rank that fails on it again names the same ranks
   without a new roll call: survivors that have exited since, after their own error, are not the cause.

The same thread answers a second kind of question, asked by a rank whose wait drags on
(:mod:`~contrastive_dist.engine._crossed`): *where do you stand?* Each rank answers with its
standing on the group (:func:`~contrastive_dist.engine._progress.standing`: its calls, its
collectives, the one it waits in) under ``standing/<rank>``, overwritten at each question.

Nothing is written to the store unless something failed or a wait dragged on (the thread's reads
cost nothing on the wire of the collectives). Without a store (a backend or launcher that has none),
the roll call answers ``None`` and errors name the peers the transfer talked to, as before.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from contrastive_dist.engine._progress import standing

__all__ = ["POLL_S", "PREFIX", "ROLL_CALL_S", "alarm_seen", "answer", "gone_ranks", "watch"]

ROLL_CALL_S = 1.5
"""How long a live rank may take to answer; a rank silent for longer is taken for gone."""
POLL_S = 0.1
"""How often the answering thread (and a waiting rank) reads the alarm."""
PREFIX = "contrastive_dist/faults/"


class _Watched:
    """One group this process takes part in: its store, this rank, and the incidents answered so far."""

    def __init__(self, group: ProcessGroup, store: Any, rank: int, world_size: int) -> None:
        self.group, self.store, self.rank, self.world_size = group, store, rank, world_size
        self.answered = 0  # incidents 1..answered have this rank's answer
        self.asked = 0  # questions 1..asked about the ranks' standing have this rank's answer
        self.verdicts: dict[int, tuple[int, ...]] = {}
        self.lock = threading.Lock()
        self.broken = False  # the store failed once (it may have lived in a dead process): not asked again


_watched: dict[int, _Watched] = {}
_thread: threading.Thread | None = None
_stop = threading.Event()
_registry_lock = threading.Lock()


def _store_of(group: ProcessGroup) -> Any:
    """The group's c10d store (``None`` where torch keeps none for it)."""
    try:
        from torch.distributed import distributed_c10d as c10d

        return c10d._world.pg_map[group][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def _group_of(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else dist.group.WORLD  # type: ignore[return-value]


def watch(group: ProcessGroup | None) -> _Watched | None:
    """Take part in the roll calls of ``group`` from now on (cheap once done); its record, or ``None``."""
    pg = _group_of(group)
    record = _watched.get(id(pg))
    if record is not None and record.group is pg:
        return None if record.broken else record
    store = _store_of(pg)
    if store is None:
        return None
    record = _Watched(pg, store, dist.get_rank(pg), dist.get_world_size(pg))
    with _registry_lock:
        _watched[id(pg)] = record
        _start_thread()
    return record


def _start_thread() -> None:
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    _stop.clear()
    _thread = threading.Thread(target=_answer_alarms, daemon=True, name="contrastive_dist-roll-call")
    _thread.start()


@atexit.register
def _stop_thread() -> None:
    # Joined before the interpreter finalizes: a daemon thread inside a store call then would abort the exit.
    _stop.set()
    if _thread is not None:
        _thread.join(timeout=2.0)


def _answer_alarms() -> None:
    """The answering thread: for every watched group, answer each new alarm; drop destroyed groups."""
    while not _stop.wait(POLL_S):
        for key, record in list(_watched.items()):
            if not _still_exists(record.group):
                with _registry_lock:
                    _watched.pop(key, None)
                continue
            if record.broken:
                continue
            try:
                answer(record)
            except Exception:  # noqa: BLE001 - a store that went away: nothing to answer on any more
                record.broken = True


def _still_exists(group: ProcessGroup) -> bool:
    try:
        from torch.distributed import distributed_c10d as c10d

        return group in c10d._world.pg_map
    except (AttributeError, TypeError):
        return False


def answer(record: _Watched) -> int:
    """Answer every alarm raised on the group so far, and the latest question; the number of the latest alarm."""
    with record.lock:
        while record.store.check([f"{PREFIX}alarm/{record.answered + 1}"]):
            record.answered += 1
            record.store.set(f"{PREFIX}alive/{record.answered}/{record.rank}", "1")
        asked = record.asked
        while record.store.check([f"{PREFIX}asked/{record.asked + 1}"]):
            record.asked += 1
        if record.asked > asked:  # one answer, the standing now, for every question so far
            answer = f"{record.asked}|{json.dumps(standing(record.group))}"
            record.store.set(f"{PREFIX}standing/{record.rank}", answer)
        return record.answered


def alarm_seen(group: ProcessGroup | None, since: int) -> int:
    """The latest incident of ``group`` (answered by this rank), if newer than ``since``; else 0. Never raises."""
    record = watch(group)
    if record is None:
        return 0
    try:
        latest = answer(record)
    except Exception:  # noqa: BLE001 - no store to read: no alarm can be seen
        record.broken = True
        return 0
    return latest if latest > since else 0


def gone_ranks(group: ProcessGroup | None, *, incident: int = 0) -> tuple[int, ...] | None:
    """The group ranks that do not answer a roll call (gone), after at most :data:`ROLL_CALL_S` seconds.

    Args:
        group: the process group (``None``: the world).
        incident: an alarm another rank raised (from :func:`alarm_seen`); 0: this rank raises a new one.

    Returns:
        The ranks gone, in order (empty: every rank answered), or ``None`` without a usable store.
    """
    record = watch(group)
    if record is None:
        return None
    try:
        return _roll_call(record, incident)
    except Exception:  # noqa: BLE001 - the store is unreachable (it may have lived in the dead process)
        record.broken = True
        return None


def _parse(verdict: bytes) -> tuple[int, ...]:
    return tuple(int(rank) for rank in verdict.decode().removeprefix("gone:").split(",") if rank)


def _roll_call(record: _Watched, incident: int) -> tuple[int, ...]:
    store = record.store
    lost = next((gone for gone in record.verdicts.values() if gone), ())
    if incident == 0 and lost:
        # The group lost these ranks and stays broken: a later failure on it is the same one. A new roll
        # call would also name the survivors that have exited since, after their own error.
        return lost
    if incident == 0:
        latest = answer(record)
        if latest and latest not in record.verdicts:
            incident = latest  # a rank elsewhere already raised the alarm for this failure: the same roll call
        else:
            incident = latest + 1
            store.set(f"{PREFIX}alarm/{incident}", str(record.rank))
            answer(record)
    if incident in record.verdicts:
        return record.verdicts[incident]
    verdict_key = f"{PREFIX}verdict/{incident}"
    answered: set[int] = set()
    deadline = time.monotonic() + ROLL_CALL_S
    while True:
        if store.check([verdict_key]):  # another rank finished first: name what it named
            gone = _parse(store.get(verdict_key))
            break
        answered |= {r for r in range(record.world_size) if r not in answered
                     and store.check([f"{PREFIX}alive/{incident}/{r}"])}
        if len(answered) == record.world_size or time.monotonic() > deadline:
            found = ",".join(str(r) for r in range(record.world_size) if r not in answered)
            store.compare_set(verdict_key, "", f"gone:{found}")  # the first verdict stands (never empty)
            gone = _parse(store.get(verdict_key))
            break
        time.sleep(POLL_S / 2)
    record.verdicts[incident] = gone
    return gone
