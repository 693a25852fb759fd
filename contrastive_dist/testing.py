"""Run a function on several local processes that share an initialised process group.

Used by this package's test suite and meant for users' own tests of distributed code:

* :func:`run_distributed` spawns ``world_size`` processes, runs ``fn(rank, world_size, *args)``
  on each and returns the results in rank order;
* :class:`WorkerPool` keeps the processes (and their process group) alive between calls,
  because spawning a process that imports torch costs seconds.

The group is initialised through a ``FileStore`` in a private temporary directory, so
concurrent runs never race for a TCP port. Every call is bounded by ``timeout``: a hung
collective ends in :class:`TimeoutError` and the processes are killed. An exception in a
child is raised again in the parent with the same type and the child's traceback attached.

Functions and arguments cross a process boundary: the spawned processes import ``fn`` by its
qualified name, so it must be defined at module level in a module they can import — a ``.py``
file, or the script being run — not in ``python -c``, ``python -`` (stdin) or an interactive
session, and not a lambda or a nested function. Both entry points check this up front and
raise a ``ValueError`` that says so, instead of a worker dying with the cause in its stderr.
A script that starts processes must guard its entry point with ``if __name__ == "__main__":``.

Faults: when a worker dies in the middle of a call, :meth:`WorkerPool.run` waits up to 15 s for the
others, which usually fail with a :class:`~contrastive_dist.PeerFailureError` naming it, and reports
what every rank saw. Shutdown: :meth:`WorkerPool.close` tells each worker to leave its loop, destroy
its process group and return, so that it exits normally (and is killed only if it does not); the
package's collectives hold no tensor past their return, so that exit is safe (``engine/_settle``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.context import SpawnProcess
from typing import Any

from contrastive_dist._cpu_clock import Patience, cpu_seconds
from contrastive_dist._pool_outcomes import broken_call, decoded, result_of
from contrastive_dist._pool_worker import READY, STOP, worker_main

__all__ = ["RemoteError", "WorkerPool", "check_importable", "run_distributed"]

_SURVIVOR_GRACE_S = 15.0
"""After a worker died, how long the others may take to report (their errors usually name the dead rank)."""


class RemoteError(RuntimeError):
    """An exception raised in a worker whose type could not be sent back as it was."""


def _main_file_missing() -> str | None:
    """How ``__main__`` was run when spawned processes cannot re-run it (``python -``), else ``None``."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is not None and not os.path.isfile(path):
        return f"a script read from {path}"
    return None


def check_importable(fn: Callable[..., Any]) -> None:
    """Raise ``ValueError`` when spawned processes could not import ``fn`` by its qualified name.

    Example:
        >>> from contrastive_dist.testing import check_importable
        >>> from contrastive_dist._dist import get_rank
        >>> check_importable(get_rank)
        >>> check_importable(lambda rank, world_size: rank)
        Traceback (most recent call last):
        ...
        ValueError: fn=<lambda> is a lambda or a nested function, ...
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module is None or qualname is None:
        return  # e.g. a callable object or a functools.partial: pickling decides
    hint = "define it at module level in a .py file and import it from there"
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(
            f"fn={qualname} is a lambda or a nested function, which spawned processes cannot import; {hint}"
        )
    if module == "__main__":
        main = sys.modules.get("__main__")
        missing = _main_file_missing()
        if getattr(main, "__file__", None) is None or missing is not None:
            how = missing or "python -c or an interactive session"
            raise ValueError(
                f"fn={qualname} is defined in __main__ of {how}, which spawned processes cannot import; {hint}"
            )


class WorkerPool:
    """``world_size`` spawned processes with an initialised process group, reused across calls.

    Args:
        world_size: number of processes (ranks).
        backend: ``torch.distributed`` backend, ``"gloo"`` for CPU tensors.
        timeout: seconds a single :meth:`run` may take; also the collectives' timeout.
        startup_timeout: seconds the workers may go without using CPU time while they start and join
            the group (a start slowed by a busy machine is not a stall; seconds of the clock where
            ``/proc`` cannot be read).
        threads_per_process: torch intra-op threads per worker (default: cores / world_size).

    Example:
        >>> from contrastive_dist.testing import WorkerPool
        >>> from contrastive_dist._dist import get_rank
        >>> def rank_of(rank, world_size):  # doctest: +SKIP
        ...     return get_rank()
        >>> with WorkerPool(2) as pool:  # doctest: +SKIP
        ...     pool.run(rank_of)
        [0, 1]
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout: float = 60.0,
        threads_per_process: int | None = None,
        startup_timeout: float = 180.0,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        missing = _main_file_missing()
        if missing is not None:
            # Spawned processes re-run the main script from its file before anything else.
            raise ValueError(
                f"WorkerPool cannot start processes from {missing}: spawned processes re-run the main "
                "script from its file; save the script as a .py file and run that"
            )
        self.world_size = world_size
        self.timeout = timeout
        threads = threads_per_process or max(1, (os.cpu_count() or 1) // world_size)
        context = mp.get_context("spawn")
        self._store_dir = tempfile.mkdtemp(prefix="contrastive_dist_")
        store_path = os.path.join(self._store_dir, "store")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._processes: list[SpawnProcess] = [
            context.Process(
                target=worker_main,
                args=(rank, world_size, backend, store_path, timeout, threads, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()
        self._broken = False
        self._startup_timeout = startup_timeout
        self._ready: set[int] = set()

    @property
    def alive(self) -> bool:
        """Whether every worker is running and no call has timed out or lost a worker."""
        return not self._broken and all(process.is_alive() for process in self._processes)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every worker; return the results in rank order.

        Args:
            fn: a picklable function.
            *args: picklable arguments, the same for every rank.
            timeout: seconds for this call (default: the pool's timeout).
            return_exceptions: put each failed rank's exception in the list instead of
                raising the first one (lowest rank). Also when a worker died or the call timed
                out: the dead rank's entry is a :class:`RemoteError` with its exit code, a silent
                rank's a ``TimeoutError``, the others' what they returned or raised (the pool is
                closed then), so that a test can check what every rank saw of a fault.

        Raises:
            TimeoutError: not every rank answered in time; the pool is closed.
            RuntimeError: a worker died (the others' errors, reported within a grace of
                15 s, are in the message); the pool is closed.
            Exception: the exception of the lowest failed rank, with its traceback as a note.
        """
        check_importable(fn)
        if not self.alive:
            raise RuntimeError("this WorkerPool is closed or lost a worker; create a new one")
        self._wait_until_ready()
        payload = pickle.dumps((fn, args))
        for task_queue in self._tasks:
            task_queue.put(payload)
        deadline = timeout if timeout is not None else self.timeout
        outcomes: dict[int, tuple[bool, Any]] = {}
        clock_end = time.monotonic() + deadline
        dead: list[int] = []
        while len(outcomes) < self.world_size:
            remaining = clock_end - time.monotonic()
            newly_dead = [r for r, p in enumerate(self._processes) if not p.is_alive() and r not in outcomes]
            if newly_dead and not dead:
                # The survivors usually fail soon after (a peer vanished): wait a little for their
                # errors, which say what happened, instead of killing them with the news.
                clock_end = min(clock_end, time.monotonic() + _SURVIVOR_GRACE_S)
            dead = sorted(set(dead) | set(newly_dead))
            if remaining <= 0 or len(outcomes) + len(dead) == self.world_size:
                return self._end_broken_call(outcomes, dead, deadline, return_exceptions)
            try:
                rank, blob = self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            outcomes[rank] = decoded(pickle.loads(blob), RemoteError)
        results: list[Any] = []
        for rank in range(self.world_size):
            result = result_of(rank, self.world_size, outcomes[rank])
            if isinstance(result, BaseException) and not outcomes[rank][0] and not return_exceptions:
                raise result
            results.append(result)
        return results

    def _end_broken_call(
        self, outcomes: dict[int, tuple[bool, Any]], dead: list[int], deadline: float, return_exceptions: bool
    ) -> list[Any]:
        """A worker died or the call timed out: close the pool; raise, or report every rank's outcome."""
        self._broken = True
        self.close()
        codes = {rank: self._processes[rank].exitcode for rank in dead}
        return broken_call(outcomes, codes, deadline, self.world_size, return_exceptions=return_exceptions,
                           remote_error=RemoteError)

    def _wait_until_ready(self) -> None:
        # Bounded by the work, not the clock: a start slowed by a busy machine goes on, a stalled one ends.
        pids = [process.pid for process in self._processes if process.pid is not None]
        patience = Patience(lambda: cpu_seconds(pids=pids), stall_s=self._startup_timeout,
                            budget_s=self.world_size * self._startup_timeout)
        while len(self._ready) < self.world_size:
            why = patience.over() or ("" if all(p.is_alive() for p in self._processes) else "a worker died")
            if why:
                self._broken = True
                self.close()
                missing = sorted(set(range(self.world_size)) - self._ready)
                raise RuntimeError(f"ranks {missing} did not start: {why}")
            try:
                rank, message = self._results.get(timeout=0.5)
            except queue.Empty:
                continue
            if message == READY:
                self._ready.add(rank)

    def close(self) -> None:
        """Stop the workers (politely, then by force) and remove the store directory."""
        for task_queue, process in zip(self._tasks, self._processes):
            if process.is_alive() and not self._broken:
                task_queue.put(STOP)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        shutil.rmtree(self._store_dir, ignore_errors=True)
        self._broken = True

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; results in rank order.

    A one-shot :class:`WorkerPool`: the processes are started, used once and stopped.
    The whole call, start-up included, is bounded by about ``timeout`` seconds plus start-up.
    ``fn`` must be importable by the spawned processes (see the module docstring); a ``ValueError``
    says so before any process starts.
    """
    check_importable(fn)
    with WorkerPool(world_size, backend=backend, timeout=timeout) as pool:
        return pool.run(fn, *args)
