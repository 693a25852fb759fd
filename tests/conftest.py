"""Shared fixtures: long-lived gloo worker pools, one per world size, reused by every test; the background commands."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import background
import pytest

from contrastive_dist.testing import WorkerPool


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "background(key): the test waits for the outcome of the background command key (tests/background.py)"
    )


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
            pools[world_size] = WorkerPool(world_size, timeout=60)
        return pools[world_size]

    yield get
    for worker_pool in pools.values():
        worker_pool.close()
