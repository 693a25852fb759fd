"""Shared fixtures: long-lived gloo worker pools, one per world size, reused by every test; the background commands."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterator

import background
import pytest
import work_bounds

from contrastive_dist.testing import WorkerPool


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "background(key): the test waits for the outcome of the background command key (tests/background.py)"
    )
    config.addinivalue_line(
        "markers", "in_background(key): a check the background command key runs in its own pytest process; every "
        "other session leaves it out (deselected, and listed with its command at the end)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the checks of background commands (each runs them in its own process), and wait for those last.

    The tests that wait for a background command come last, so that their commands get the whole session;
    their own bound is the wait's (it follows the command's work, ``background.outcome``), so pytest-timeout's
    is raised above it.
    """
    here = os.environ.get(background.CHECKS_VARIABLE)
    elsewhere = [item for item in items if _runs_in(item) not in (None, here)]
    for item in elsewhere:
        background.left_out(_runs_in(item))
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = [item for item in items if _runs_in(item) in (None, here)]
    for item in items:
        if item.get_closest_marker("background") is not None:
            item.add_marker(pytest.mark.timeout(background.CAP_S + 300), append=False)
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)  # stable: order kept


def _runs_in(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("in_background")
    return None if marker is None else str(marker.args[0])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Queue the background commands of the tests that will run, in their order, to run beside the others."""
    if session.config.option.collectonly:
        return
    for item in session.items:
        marker = item.get_closest_marker("background")
        if marker is not None:
            background.queue(marker.args[0])


def pytest_runtest_logfinish() -> None:
    """After each test: the next queued background commands, if fewer than their limit run."""
    background.advance()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What the background commands did: the deselected entries above are their checks, run in their own processes."""
    lines = background.report()
    if lines and not terminalreporter.config.option.collectonly:
        terminalreporter.section("background commands")
        terminalreporter.line("Commands run beside the suite, each in a process of its own. The checks they run are "
                              "deselected in this session (their outcome is that of the test that waits for the "
                              "command):")
        for line in lines:
            terminalreporter.line(f"  {line}")


def pytest_timeout_set_timer(item: pytest.Item, settings: object) -> bool | None:
    """Each test's timeout follows its work, not the clock (tests/work_bounds.py); True: set here."""
    cancel = work_bounds.start(item, float(getattr(settings, "timeout", 0) or 0), background.running)
    if cancel is None:
        return None  # pytest-timeout's own timer
    item.cancel_work_bound = cancel  # type: ignore[attr-defined]
    return True


def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    cancel = getattr(item, "cancel_work_bound", None)
    if cancel is None:
        return None
    del item.cancel_work_bound  # type: ignore[attr-defined]
    cancel()
    return True


def pytest_unconfigure(config: pytest.Config) -> None:
    background.stop_all()


@pytest.fixture(scope="session")
def pool() -> Iterator[Callable[[int], WorkerPool]]:
    """``pool(world_size)`` returns a running :class:`WorkerPool`, started once per session.

    A pool that timed out or lost a worker is replaced, so one hang fails one test only.
    """
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        current = pools.get(world_size)
        if current is None or not current.alive:
            timeout = float(os.environ.get(background.POOL_TIMEOUT_VARIABLE, "60"))
            pools[world_size] = WorkerPool(world_size, timeout=timeout)
        return pools[world_size]

    yield get
    # Every pool's workers stop at once (each takes seconds to leave its process group and exit).
    with concurrent.futures.ThreadPoolExecutor(max(1, len(pools))) as closing:
        list(closing.map(WorkerPool.close, pools.values()))
