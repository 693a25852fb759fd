"""Wait for a piece of work in slices, so that the waiting rank can look around between them.

A gloo collective's ``Work.wait(timeout)`` returns after the timeout with the work still running
(torch's "Operation timed out!"), so it can be waited on again: :func:`in_slices`. A gloo
point-to-point transfer cannot: a timeout on its wait aborts every transfer of the process group
("Application timeout caused pair closure"). So a transfer is waited on by a helper thread, whole,
and the caller waits in slices for that thread to finish (:func:`in_thread`); a helper costs a
hand-over per wait and is reused. If the caller stops waiting (a rank elsewhere is gone), its
helper stays blocked until the transfer fails, and a new helper serves the next wait.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["SLICE_S", "in_slices", "in_thread"]

SLICE_S = 0.1
"""How long one slice of a wait lasts."""
_SLICE_OVER = "Operation timed out!"  # torch's words when Work.wait(timeout) returns before the work is done


def in_slices(work: dist.Work) -> Callable[[], bool]:
    """``finished()``: wait up to a slice; ``True`` once the work is done (its error raised, if any)."""
    slice_length = datetime.timedelta(seconds=SLICE_S)

    def finished() -> bool:
        try:
            work.wait(slice_length)
        except RuntimeError as error:
            if str(error) != _SLICE_OVER:
                raise
            return False
        return True

    return finished


class _Helper:
    """A daemon thread that waits for the works handed to it, one at a time."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[tuple[dist.Work, threading.Event, list[BaseException]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="contrastive_dist-wait").start()

    def _run(self) -> None:
        while True:
            work, done, failure = self.tasks.get()
            try:
                work.wait()
            except BaseException as error:  # noqa: BLE001 - handed back to the caller, raised there
                failure.append(error)
            del work  # dropped before the caller goes on: nothing of the transfer is freed here later
            done.set()


_idle: list[_Helper] = []


def in_thread(work: dist.Work) -> Callable[[], bool]:
    """Like :func:`in_slices`, for a work whose wait must not time out: waited on whole by a helper thread."""
    helper = _idle.pop() if _idle else _Helper()
    done, failure = threading.Event(), []  # type: tuple[threading.Event, list[BaseException]]
    helper.tasks.put((work, done, failure))

    def finished() -> bool:
        if not done.wait(SLICE_S):
            return False
        _idle.append(helper)  # done with this work: free for the next
        if failure:
            raise failure[0]
        return True

    return finished
