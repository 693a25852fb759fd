"""pytest-timeout's bound on a test, made to follow the test's work instead of the clock.

A test's ``@pytest.mark.timeout(seconds)`` (or the default in pyproject.toml) is a wall-clock bound:
on a busy machine the test's processes get a small share of the CPU, take several times longer, and
fail although nothing is wrong. Here the bound is a :class:`~contrastive_dist._cpu_clock.Patience`
over the test's processes (the pytest process and every process descended from it, its worker pools
and command runs included, the background commands' left out, as they run beside the test): the
test fails when those processes used no CPU time at all for :data:`STALL_S` seconds (a hang), or at
:data:`CLOCK_FACTOR` times its declared seconds of the clock whatever it does. A test slowed by a busy
machine keeps using CPU time, so it is waited for.

The failure is pytest-timeout's: every thread's stack, then the test fails (the signal method, in the
main thread; a watcher thread checks every :data:`CHECK_EVERY_S` seconds and signals it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable

import pytest

from contrastive_dist._cpu_clock import Patience, cpu_seconds, process_tree

__all__ = ["CHECK_EVERY_S", "CLOCK_FACTOR", "STALL_S", "start"]

STALL_S = 180.0
"""A test whose processes use no CPU time for this long is taken for hung."""
CLOCK_FACTOR = 6.0
"""A test is stopped at this many times its declared timeout, in seconds of the clock, whatever it does."""
CHECK_EVERY_S = 2.0


def start(item: pytest.Item, seconds: float, left_out: Callable[[], Iterable[int]]) -> Callable[[], None] | None:
    """Watch ``item`` (declared ``seconds``); its cancel function, or None where the signal cannot be used.

    ``left_out``: the processes (roots of trees) that are not the test's, e.g. the background commands.
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return None
    main, stopped, why = threading.main_thread().ident, threading.Event(), []

    def used() -> float | None:
        others = {pid for root in left_out() for pid in process_tree(root)}
        total = cpu_seconds(pids=[pid for pid in process_tree(os.getpid()) if pid not in others])
        return None if total is None else total - time.thread_time()  # not the watcher's own checks

    def watch() -> None:
        patience = Patience(used, stall_s=STALL_S, cap_s=CLOCK_FACTOR * seconds)
        while not stopped.wait(CHECK_EVERY_S):
            over = patience.over()
            if over is not None:
                why.append(over)
                signal.pthread_kill(main, signal.SIGALRM)  # type: ignore[arg-type]
                return

    def fail(signum: int, frame: object) -> None:
        __tracebackhide__ = True
        from pytest_timeout import dump_stacks

        terminal = item.config.get_terminal_writer()
        terminal.sep("+", title="Timeout")
        dump_stacks(terminal)
        terminal.sep("+", title="Timeout")
        pytest.fail(f"Timeout: {why[0]} (declared {seconds:g} s; a bound that follows the work: tests/work_bounds.py)")

    watcher = threading.Thread(target=watch, name=f"work bound {item.nodeid}", daemon=True)

    def cancel() -> None:
        stopped.set()
        watcher.join()
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    signal.signal(signal.SIGALRM, fail)
    watcher.start()
    return cancel
