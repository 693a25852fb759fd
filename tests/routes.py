"""Run a worker function under one transport route of ``contrastive_dist.engine._wire``, or another setting.

``auto`` is what CPU tensors get (broadcasts forward, all-to-all backward); ``collective``
forces the accelerator routes (``all_gather_single`` / ``reduce_scatter_single`` on equal
sizes, ``all_to_all_single`` on uneven ones, the framed status gather) through
``CONTRASTIVE_DIST_ROUTE``, which the transport reads at every collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from contrastive_dist.engine._wire import ROUTE_VARIABLE

ROUTES = ("auto", "collective")


def with_variable(rank: int, world_size: int, name: str, value: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(rank, world_size, *args)`` with the environment variable ``name=value`` in this process, then restore it."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(rank, world_size, *args)
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


def on_route(rank: int, world_size: int, route: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(rank, world_size, *args)`` with ``CONTRASTIVE_DIST_ROUTE=route``."""
    return with_variable(rank, world_size, ROUTE_VARIABLE, route, fn, *args)
