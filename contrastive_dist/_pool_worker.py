"""The worker side of :class:`~contrastive_dist.testing.WorkerPool`: join the group, run tasks until told to stop.

Each worker is a spawned process. It joins the process group through the pool's ``FileStore``,
says it is ready, then runs each task it is sent (a pickled ``(fn, args)``) and sends back
``(rank, pickled outcome)``: ``(True, value)``, or ``(False, (error, traceback))``, where an error
that cannot be pickled travels as its text (``(False, (None, text, traceback))``, raised again as a
:class:`~contrastive_dist.testing.RemoteError` by the pool). It leaves its loop on ``STOP``,
destroys its process group and returns; it ends at once if the parent dies.
"""

from __future__ import annotations

import datetime
import os
import pickle
import threading
import time
import traceback
from typing import Any

__all__ = ["READY", "STOP", "worker_main"]

STOP = "stop"
READY = b"ready"


def worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    timeout_s: float,
    threads: int,
    tasks: Any,
    results: Any,
) -> None:
    """One worker: join the group, then run tasks until ``STOP`` (see the module docstring)."""
    import torch
    import torch.distributed as dist

    _exit_with_parent()
    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results.put((rank, READY))
    try:
        while True:
            task = tasks.get()
            if task == STOP:
                break
            fn, args = pickle.loads(task)
            try:
                outcome: tuple[bool, Any] = (True, fn(rank, world_size, *args))
            except BaseException as error:  # noqa: BLE001 - everything goes back to the parent
                text = traceback.format_exc()
                try:
                    pickle.dumps(error)
                    outcome = (False, (error, text))
                except Exception:  # noqa: BLE001 - unpicklable exception: send its text only
                    outcome = (False, (None, f"{type(error).__name__}: {error}", text))
            try:
                results.put((rank, pickle.dumps(outcome)))
            except Exception as error:  # noqa: BLE001 - e.g. an unpicklable return value
                failure = (False, (None, f"result of rank {rank} is not picklable: {error}", ""))
                results.put((rank, pickle.dumps(failure)))
    finally:
        dist.destroy_process_group()


def _exit_with_parent() -> None:
    """End this worker when the parent dies (e.g. killed by a test timeout): no orphans left behind."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()
