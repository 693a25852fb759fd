"""Collectives that can never meet, found within seconds: a rank that skipped one, or waits in another library's.

A rank that skips a collective the others make — a backward it never ran, a call it left early —
goes on to its next collective, and the others wait in the one it skipped: no transport error
comes, only the process group's timeout (30 minutes by default). Neither does a rank that calls
``torch.distributed.barrier`` where the others call a loss. So a rank whose wait in one of the
package's collectives lasts longer than :data:`ASK_AFTER_S` asks every rank of the group where it
stands (through the group's store, :mod:`~contrastive_dist.engine._rollcall`; again at growing
intervals while the wait lasts) and raises a :class:`~contrastive_dist.engine._faults.PeerFailureError`
when the answers prove that the wait can never end:

* two ranks wait in the package's collectives of the *same number* on the group
  (:mod:`~contrastive_dist.engine._progress`) but of different kinds: each made a collective the
  other did not. Every rank in them raises the same error, which names the ranks that went on to a
  later call;
* a rank blocks in a collective of ``torch.distributed`` itself, on a group this rank is in, and has
  not begun the package's collective this rank waits in: its own collective waits for this rank,
  which waits for it. This rank (and every rank waiting with it) raises; the other one stays in
  its collective until the process group's timeout (the package cannot end another library's wait).

A rank busy elsewhere (still computing, loading data) is never taken for a fault: it waits on no one.
The collectives posted before the error stay posted, so the group cannot be used again: a later
wait on it raises the same error at once. What the package cannot see is documented instead: a rank
blocked in a collective run by C++ code (DDP's gradient all-reduce), or in one it runs on its own.
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import torch.distributed as dist
from torch.distributed import ProcessGroup

from contrastive_dist.engine._progress import kind, progress
from contrastive_dist.engine._rollcall import POLL_S, PREFIX, ROLL_CALL_S, answer, watch

__all__ = ["ASK_AFTER_S", "crossed", "next_ask"]

ASK_AFTER_S = 1.0
"""How long a wait lasts before the waiting rank asks where the others stand (then at doubling intervals)."""
_ASK_EVERY_MAX_S = 30.0


def crossed(group: ProcessGroup | None, operation: str) -> tuple[str, tuple[int, ...]] | None:
    """Ask every rank of ``group`` where it stands; the message and the ranks at fault if the wait can never end."""
    record = progress(group)
    if record.out_of_step:
        return record.out_of_step, record.at_fault
    watched = watch(group)
    if watched is None:
        return None
    # The first verdict on the group stands (a group out of step stays so): every rank raises the same one, also
    # a rank that asks after the others raised and went elsewhere (their answers would tell another story).
    key = f"{PREFIX}crossed"
    try:
        if not watched.store.check([key]):
            found = _verdict(_ask(group), dist.get_rank(group), group)
            if found is None:
                return None
            watched.store.compare_set(key, "", json.dumps(found))
        text, suspects = json.loads(watched.store.get(key))
    except Exception:  # noqa: BLE001 - a store that went away: nothing to learn, the wait goes on as it would
        return None
    record.out_of_step, record.at_fault = text, tuple(suspects)
    return text, record.at_fault


def next_ask(waited_s: float) -> float:
    """How long after ``waited_s`` seconds of waiting to ask again."""
    return min(max(waited_s, ASK_AFTER_S), _ASK_EVERY_MAX_S)


def _ask(group: ProcessGroup | None) -> dict[int, dict[str, Any]]:
    """Ask every rank of ``group`` where it stands; the answers that came within ``ROLL_CALL_S`` seconds.

    Each answer is a rank's :func:`~contrastive_dist.engine._progress.standing`; a rank that does not
    watch the group (it never took part in the package's collectives on it) gives none.
    """
    record = watch(group)
    if record is None:
        return {}
    store = record.store
    try:
        question = store.add(f"{PREFIX}asks", 1)
        store.set(f"{PREFIX}asked/{question}", "1")
        answer(record)  # this rank's own answer, at once
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + ROLL_CALL_S
        while len(answers) < record.world_size and time.monotonic() < deadline:
            for rank in range(record.world_size):
                key = f"{PREFIX}standing/{rank}"
                if rank not in answers and store.check([key]):
                    number, text = store.get(key).decode().split("|", 1)
                    if int(number) >= question:
                        answers[rank] = cast(dict[str, Any], json.loads(text))
            time.sleep(POLL_S / 2)
    except Exception:  # noqa: BLE001 - a store that went away: no one to ask
        return {}
    return answers


def _verdict(answers: dict[int, dict[str, Any]], rank: int, group: ProcessGroup | None) -> tuple[str, list[int]] | None:
    mine = answers.get(rank)
    if mine is None or not mine["waiting"]:
        return None
    world_size = dist.get_world_size(group)
    same_number = {other: answer for other, answer in sorted(answers.items())
                   if answer["waiting"] and answer["operations"] == mine["operations"]}
    if len({kind(answer["waiting"]) for answer in same_number.values()}) > 1:
        most = max(answer["calls"] for answer in same_number.values())
        ahead = [other for other, answer in same_number.items() if answer["calls"] == most]
        suspects = ahead if len(ahead) < len(same_number) else list(same_number)
        return _describe(same_number, world_size, suspects), suspects
    me = rank if group is None else dist.get_global_rank(group, rank)
    blocked = {other: answer for other, answer in sorted(answers.items())
               if not answer["waiting"] and answer["foreign"] and me in answer["foreign"]["ranks"]
               and answer["operations"] < mine["operations"]}
    if blocked:
        waiting = {other: answer for other, answer in answers.items() if answer["waiting"]}
        return _describe({**waiting, **blocked}, world_size, list(blocked)), list(blocked)
    return None


def _describe(answers: dict[int, dict[str, Any]], world_size: int, suspects: list[int]) -> str:
    lines = [f"  rank {other}: {_standing(answer)}" for other, answer in sorted(answers.items())]
    calls = {answer["calls"] for answer in answers.values()}
    who = f"rank {suspects[0]}" if len(suspects) == 1 else f"ranks {suspects}"
    if any(answers[other]["foreign"] for other in suspects):
        most = max(calls)
        behind = min(answers[other]["calls"] for other in suspects)
        lag = f": {who} is {most - behind} call{'s' if most - behind > 1 else ''} behind" if most > behind else ""
        cause = (f"{who} waits in a collective of its own, which waits for the ranks that wait in the package's"
                 f"{lag}. Every rank must make the same calls in the same order")
    elif len(calls) > 1:
        cause = (f"{who} went on to a later call without the collective the others wait in (a backward it skipped, "
                 "a call it left early, a layer in another mode). Every rank must make the package's collectives, "
                 "forward and backward, in the same order")
    else:
        cause = ("each made a collective the others did not. Every rank must make the package's collectives, "
                 "forward and backward, in the same order")
    return (f"collectives out of step on a process group of {world_size} ranks, found by asking every rank where "
            f"it stands: the ranks wait in collectives that can never meet:\n" + "\n".join(lines) + f"\n{cause}. "
            "The collectives already posted stay posted, so this group cannot be used again: create a new "
            "process group, or restart")


def _standing(answer: dict[str, Any]) -> str:
    calls = f"{answer['calls']} call{'' if answer['calls'] == 1 else 's'} so far"
    if answer["waiting"]:
        return f"in {answer['waiting']}: collective {answer['operations']} of the package on this group; {calls}"
    foreign = answer["foreign"]
    return (f"in {foreign['name']}, called at {foreign['where']}; {answer['operations']} collectives of the package "
            f"on this group; {calls}")
