"""Waits bounded by the work they wait for, not by the clock: a busy machine slows them, never fails them.

A wait for other processes (workers starting, a command running beside a test suite) that ends at
a fixed number of seconds fails on a busy machine: the processes were given little CPU time, not
stuck. :class:`Patience` bounds such a wait by what the processes did instead (Linux, from
``/proc``): it ends when they have used no CPU time at all for ``stall_s`` seconds (they wait on
something that will not come: a hang), or when they have used ``budget_s`` seconds of it (a loop
that never ends). ``cap_s`` seconds of the clock end it whatever happens. Where ``/proc`` cannot be
read, the clock is all there is: the wait ends after ``stall_s`` seconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

__all__ = ["Patience", "cpu_seconds", "process_tree"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (its state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            text = file.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _used(fields: list[str]) -> float:
    """CPU seconds of a process and of its children it has waited for (those that ended)."""
    return sum(int(value) for value in fields[11:15]) / _TICKS


def process_tree(root: int) -> list[int]:
    """``root`` and every live process descended from it (also those in sessions of their own, as torchrun's)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc/self") else ():
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, waiting = [], [root]
    while waiting:
        pid = waiting.pop()
        tree.append(pid)
        waiting.extend(children.get(pid, ()))
    return tree


def cpu_seconds(*, pids: Iterable[int] = (), session: int | None = None) -> float | None:
    """CPU seconds used by the processes ``pids``, or by every process of ``session``; None without ``/proc``.

    Example:
        >>> seconds = cpu_seconds(pids=[os.getpid()])
        >>> seconds is None or seconds > 0
        True
    """
    if not os.path.isdir("/proc/self"):
        return None
    if session is None:
        return sum(_used(fields) for fields in map(_stat, pids) if fields is not None)
    total = 0.0
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[3]) == session:
            total += _used(fields)
    return total


class Patience:
    """How long to go on waiting for processes: as long as they work (see the module docstring).

    Args:
        used: the processes' CPU seconds so far (e.g. ``lambda: cpu_seconds(pids=...)``), None if unknown.
        stall_s: seconds without any CPU time used that end the wait.
        budget_s: CPU seconds that end the wait (None: no budget).
        cap_s: seconds of the clock that end the wait whatever happens (None: none).

    Example:
        >>> patience = Patience(lambda: cpu_seconds(pids=[os.getpid()]), stall_s=60.0)
        >>> patience.over() is None
        True
    """

    def __init__(self, used: Callable[[], float | None], *, stall_s: float, budget_s: float | None = None,
                 cap_s: float | None = None) -> None:
        self.used, self.stall_s, self.budget_s, self.cap_s = used, stall_s, budget_s, cap_s
        self.start = self.progressed = time.monotonic()
        self.first = self.last = used()

    def over(self) -> str | None:
        """Why the wait is over (in words, for the error), or None while it goes on."""
        now, used = time.monotonic(), self.used()
        if self.cap_s is not None and now - self.start > self.cap_s:
            return f"still running after {now - self.start:.0f} s"
        if used is None or self.last is None:  # no /proc: the clock
            return f"still running after {now - self.start:.0f} s" if now - self.start > self.stall_s else None
        if used > self.last:
            self.last, self.progressed = used, now
        if self.budget_s is not None and self.first is not None and used - self.first > self.budget_s:
            return f"{used - self.first:.1f} s of CPU time used, more than the {self.budget_s:g} s allowed"
        if now - self.progressed > self.stall_s:
            return (f"no CPU time used for {now - self.progressed:.0f} s (after {used - (self.first or 0):.0f} s of it "
                    f"in {now - self.start:.0f} s): waiting on something that does not come")
        return None
