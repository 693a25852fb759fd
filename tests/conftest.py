"""Shared fixtures: long-lived gloo worker pools, one per world size, reused by every test; the background commands."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Iterator

import background
import pytest

from contrastive_dist.testing import WorkerPool


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "background(key): the test waits for the outcome of the background command key (tests/background.py)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that wait for a background command come last: their commands get the whole session."""
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)  # stable: order kept


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
