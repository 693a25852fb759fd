"""Shared fixtures: long-lived gloo worker pools, one per world size, reused by every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from contrastive_dist.testing import WorkerPool


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
