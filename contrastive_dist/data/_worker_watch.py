"""DataLoader workers that exit when the rank that started them dies, SIGKILL included.

A DataLoader worker watches its parent process, and only while it waits for work (torch checks
every 5 s). Under the ``forkserver`` context that this package recommends, the parent is the
forkserver, not the rank; and a forkserver exits only once every process it started has closed its
end of an "alive" pipe, which every worker holds. So a rank killed mid-epoch left its workers and
its forkserver running, each waiting for the other, until ended by hand.

:class:`ExitWithRank`, installed as the loader's ``worker_init_fn`` (around the user's own), starts a
thread in each worker that waits for the *rank* to exit (on a pidfd where the OS has them: woken the
moment the rank dies; else it polls twice a second) and then ends the worker. Once the workers are
gone the forkserver's pipe closes and it exits too. A worker stuck in C code that holds the GIL
cannot run the thread; such a worker is ended when that call returns.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ExitWithRank", "exit_with_rank", "stop_workers"]


class ExitWithRank:
    """A ``worker_init_fn`` that ends the worker when its rank exits, then runs ``init`` (the user's, or none).

    Args:
        init: the loader's own ``worker_init_fn``, called after the watch starts.

    Example:
        >>> from torch.utils.data import DataLoader
        >>> loader = DataLoader(range(4), num_workers=0)
        >>> exit_with_rank(loader)
        >>> isinstance(loader.worker_init_fn, ExitWithRank), loader.worker_init_fn.init is None
        (True, True)

    """

    def __init__(self, init: Callable[[int], Any] | None) -> None:
        self.init = init

    def __call__(self, worker_id: int) -> None:
        # The process that created the worker, in every start method (the forkserver is only its OS parent).
        rank = multiprocessing.parent_process()
        if rank is not None and rank.pid is not None:
            threading.Thread(target=_exit_when_gone, args=(rank.pid,), name="exit-with-rank", daemon=True).start()
        if self.init is not None:
            self.init(worker_id)


def exit_with_rank(loader: object) -> None:
    """Make the workers of ``loader`` (a ``DataLoader``; anything else is left alone) exit with this process."""
    if not hasattr(loader, "worker_init_fn") or not hasattr(loader, "num_workers"):
        return
    init = loader.worker_init_fn
    if not isinstance(init, ExitWithRank):  # the DataLoader reads worker_init_fn when an epoch starts
        loader.worker_init_fn = ExitWithRank(init)  # type: ignore[attr-defined]


def stop_workers(iterator: object) -> None:
    """Shut a DataLoader iterator's workers down now, not when the last reference to it goes.

    An exception raised through the iterator keeps it alive in its traceback's frames, for as long as
    the caller keeps the exception (or the process runs).
    """
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def _exit_when_gone(pid: int) -> None:
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)  # the rank is gone already
    except (AttributeError, OSError):  # no pidfd here (not Linux >= 5.3, or not allowed): poll
        while _exists(pid):
            time.sleep(0.5)
        os._exit(1)
    select.select([handle], [], [])  # a pidfd turns readable when its process exits
    os._exit(1)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number: ours is gone
        return False
    return True
