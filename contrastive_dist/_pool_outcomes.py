"""What :class:`~contrastive_dist.testing.WorkerPool` makes of its workers' outcomes: results, errors, a broken call.

A worker sends ``(True, value)`` or ``(False, (error, traceback))``, an error that cannot be pickled
as its text (``_pool_worker``). Here each becomes what the caller of ``WorkerPool.run`` gets: the
value, or the error with the rank's traceback as a note; and when a worker died or the call ran out
of time, every rank's outcome, or one error that says what every rank that answered saw.
"""

from __future__ import annotations

from typing import Any

__all__ = ["broken_call", "decoded", "result_of"]


def decoded(outcome: tuple[bool, Any], remote_error: type[Exception]) -> tuple[bool, Any]:
    """A worker's outcome as the pool reports it: an error sent as its text becomes a ``remote_error``."""
    ok, value = outcome
    return (ok, (remote_error(value[1]), value[2])) if not ok and value[0] is None else outcome


def result_of(rank: int, world_size: int, outcome: tuple[bool, Any]) -> Any:
    """What ``fn`` returned on ``rank``, or the exception it raised with the rank's traceback as a note."""
    ok, value = outcome
    if ok:
        return value
    error, text = value
    if text:
        error.add_note(f"--- raised on rank {rank} of {world_size} ---\n{text}")
    return error


def broken_call(
    outcomes: dict[int, tuple[bool, Any]],
    exit_codes: dict[int, int | None],
    deadline: float,
    world_size: int,
    *,
    return_exceptions: bool,
    remote_error: type[Exception],
) -> list[Any]:
    """A worker died (``exit_codes``: the dead ones') or the call timed out: every rank's outcome, or one error."""
    if return_exceptions:
        results: list[Any] = []
        for rank in range(world_size):
            if rank in outcomes:
                results.append(result_of(rank, world_size, outcomes[rank]))
            elif rank in exit_codes:
                results.append(remote_error(f"the worker of rank {rank} died (exit code {exit_codes[rank]})"))
            else:
                results.append(TimeoutError(f"rank {rank} gave no result within {deadline:.0f} s"))
        return results
    missing = sorted(set(range(world_size)) - set(outcomes))
    # The errors that did come back before a hang: usually the cause of it.
    reported = "".join(f"\n--- rank {rank} raised ---\n{value[1]}"
                       for rank, (ok, value) in sorted(outcomes.items()) if not ok)
    if exit_codes:
        raise RuntimeError(f"worker(s) of rank {sorted(exit_codes)} died, exit codes {exit_codes} (no result from "
                           f"ranks {missing}){reported}")
    raise TimeoutError(f"ranks {missing} gave no result within {deadline:.0f} s (hang?){reported}")
