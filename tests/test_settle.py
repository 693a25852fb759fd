"""The package's gloo collectives return only once gloo has let go of their tensors (safe at exit).

gloo frees a collective's tensors on its worker thread, shortly after ``wait()`` returns; a tensor
freed that way while the interpreter finalizes aborts the process ("terminate called without an
active exception"). Every tensor the package hands to a gloo collective must therefore be freed
before the call returns. Checked with a tensor subclass that records, when freed, on which thread
and whether a package call was still running: none may be freed by a gloo thread afterwards.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from contrastive_dist.engine import _settle
from contrastive_dist.engine._settle import settled
from contrastive_dist.engine._wire import (
    ROUTE_VARIABLE,
    all_gather_single,
    all_reduce,
    gather_rows,
    reduce_scatter_rows,
)
from contrastive_dist.engine._wire_status import gather_rows_with_status
from contrastive_dist.testing import WorkerPool

_FREED: list[tuple[str, bool]] = []  # (thread name, a package call was running)
_IN_CALL = [False]


class _Tracked(torch.Tensor):
    """Records where it is freed; views and results of tracked tensors are tracked too."""

    def __del__(self) -> None:
        _FREED.append((threading.current_thread().name, _IN_CALL[0]))


def _tracked(*shape: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(_Tracked, torch.randn(*shape))


def _calls(rank: int, world_size: int) -> dict[str, Callable[[], object]]:
    sizes = [3 + r for r in range(world_size)]  # uneven: the gather's broadcasts and all-to-all
    return {
        "all_reduce": lambda: all_reduce(_tracked(8)),
        "all_gather_single": lambda: all_gather_single(_tracked(world_size, 4), _tracked(1, 4)),
        "gather_rows": lambda: gather_rows(_tracked(sizes[rank], 4), sizes, rank, None),
        "gather_rows_with_status": lambda: gather_rows_with_status(_tracked(sizes[rank], 4), sizes, rank, None, 0),
        "reduce_scatter_rows": lambda: reduce_scatter_rows(_tracked(sum(sizes), 4), sizes, rank, None),
    }


def _late_frees_by_gloo_threads(rank: int, world_size: int, repeats: int) -> dict[str, int]:
    late: dict[str, int] = {}
    for route in ("auto", "collective"):
        os.environ[ROUTE_VARIABLE] = route
        for name, call in _calls(rank, world_size).items():
            _FREED.clear()
            for _ in range(repeats):
                _IN_CALL[0] = True
                result = call()
                _IN_CALL[0] = False
                del result  # the caller drops what it got: freed here, on the main thread
            time.sleep(0.05)  # a gloo thread still holding something would free it now
            gc.collect()
            after = [thread for thread, in_call in _FREED if not in_call and thread != "MainThread"]
            late[f"{name} ({route})"] = len(after)
            assert _FREED, f"{name}: no tracked tensor was freed at all: the check would check nothing"
    os.environ.pop(ROUTE_VARIABLE)
    return late


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_tensor_of_a_package_collective_is_freed_by_a_gloo_thread_after_the_call(
    pool: Callable[[int], WorkerPool], world_size: int
) -> None:
    for rank, late in enumerate(pool(world_size).run(_late_frees_by_gloo_threads, 60, timeout=120)):
        assert all(count == 0 for count in late.values()), (rank, late)


def test_settled_never_waits_for_long_on_a_reference_it_cannot_account_for() -> None:
    kept: list[torch.Tensor] = []
    buffer = torch.zeros(4)
    with mock.patch.object(_settle, "_GIVE_UP_S", 0.2):
        start = time.monotonic()
        settled(lambda views: kept.extend(views), [buffer])  # keeps a view: the count never drops
        assert 0.2 <= time.monotonic() - start < 2.0
    assert kept and kept[0].data_ptr() == buffer.data_ptr()
