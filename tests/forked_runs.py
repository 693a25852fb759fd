"""Runs of a script, or of a test module's function, each a fork of one process that imported torch,
Lightning and torchvision once.

    python tests/forked_runs.py              the server: a JSON request per line on stdin, JSON replies
    python tests/forked_runs.py --run JSON   one request, in this fresh process (no fork)

A recipe command spends ~5 s importing torch, Lightning and torchvision before its first line runs,
and the tests run the recipes and Lightning fits dozens of times. Here each run is a fork of the
server taken after those imports and before anything else. A script runs as ``python <script>
args`` would run it: as ``__main__``, its folder first on ``sys.path``, with its arguments, working
folder and environment, stdout and stderr written to files, and the interpreter's exit code (an
uncaught exception prints its traceback and exits 1; ``atexit`` handlers run). A call imports a
module from a folder and calls one of its functions with JSON arguments, the same way.

A fork copies only the thread that calls it, so the server serves only while it has one thread
(``OMP_NUM_THREADS=1``); otherwise it says so and every run starts as ``--run``, a fresh process.

Request: ``{"script", "args"}`` or ``{"call": "module.function", "path", "args"}``, with ``"cwd"``,
``"env"``, ``"stdout"``, ``"stderr"``. Replies: ``{"pid"}`` at the start (the run leads its own
session, which a timeout kills), then ``{"returncode"}``.

A run's ``timeout`` follows its work, not the clock (:class:`~contrastive_dist._cpu_clock.Patience`,
over the run's process and every process descended from it, its ranks and their workers included): it
ends the run when they have used ``timeout`` seconds of CPU time, or none for :data:`STALL_S` seconds (a hang), or at
:data:`CLOCK_FACTOR` times ``timeout`` seconds of the clock. On a busy machine a run gets less of the
CPU and takes longer; it is waited for. :func:`run_command` waits on any command the same way.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import queue
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contrastive_dist._cpu_clock import Patience, cpu_seconds, process_tree

SERVER = Path(__file__).resolve()
STALL_S = 180.0
"""A run whose processes use no CPU time for this long is taken for hung."""
CLOCK_FACTOR = 8.0
"""A run is stopped at this many times its ``timeout`` in seconds of the clock, whatever it does."""


def run(request: dict[str, Any]) -> None:
    """Become the request's process, run it and exit as the interpreter would (never returns)."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    if "multiprocessing.process" in sys.modules:  # as if imported here: it resolves __main__'s file from this
        sys.modules["multiprocessing.process"].ORIGINAL_DIR = os.path.abspath(os.getcwd())  # type: ignore[attr-defined]
    if "script" in request:
        script = os.path.abspath(request["script"])  # __main__.__file__, absolute as Python makes it
        sys.argv = [request["script"], *request["args"]]
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.path.insert(0, request["path"])
        module, _, function = request["call"].rpartition(".")
        getattr(importlib.import_module(module), function)(*request["args"])
    sys.exit(0)  # a SystemExit, raised or returned, ends the process through the interpreter's exit


def serve() -> None:
    """Import, then fork a run per request while this process has one thread."""
    import matplotlib

    matplotlib.use("Agg")  # what the recipes' plots select
    import lightning.pytorch  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
    import torchvision.transforms.v2  # noqa: F401

    import contrastive_dist.lightning.report  # noqa: F401
    import contrastive_dist.lightning.towers  # noqa: F401

    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 0  # 0: not known
    print(json.dumps({"ready": threads == 1, "threads": threads}), flush=True)
    if threads != 1:
        return
    for line in sys.stdin:
        request = json.loads(line)
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


class ForkedRuns:
    """The client: starts the server once and sends it runs (or starts each as ``--run``)."""

    def __init__(self, *, server: bool = True) -> None:
        self.ready = False
        if not server:  # every run as `--run`
            return
        self.server = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=lambda: [self.replies.put(json.loads(line)) for line in self.server.stdout or []],
                         daemon=True).start()
        # Its imports take seconds, minutes on a busy machine: waited for as long as it works.
        patience = Patience(lambda: cpu_seconds(pids=[self.server.pid]), stall_s=STALL_S)
        while self.replies.empty() and self.server.poll() is None and patience.over() is None:
            time.sleep(0.2)
        self.ready = not self.replies.empty() and bool(self.replies.get()["ready"])

    def script(self, command: list[str], *, cwd: Path, env: dict[str, str],
               timeout: float) -> subprocess.CompletedProcess[str]:
        """Like ``subprocess.run([sys.executable, *command], capture_output=True, text=True, ...)``."""
        return self._run({"script": command[0], "args": command[1:]}, cwd, env, timeout)

    def call(self, function: str, *args: Any, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        """``module.function(*args)`` of a module in tests/, in a run of its own: its exit code and output."""
        request = {"call": function, "path": str(SERVER.parent), "args": list(args)}
        return self._run(request, cwd, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout)

    def _run(self, request: dict[str, Any], cwd: Path, env: dict[str, str],
             timeout: float) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {**request, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
            if not self.ready:
                process = subprocess.Popen([sys.executable, str(SERVER), "--run", json.dumps(request)], env=env)
                code = wait_working(process.poll, process.pid, timeout, request, out, err)
                return subprocess.CompletedProcess(request, code, out.read_text(), err.read_text())
            assert self.server.stdin is not None
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            pid = self.replies.get(timeout=STALL_S)["pid"]
            code = wait_working(lambda: self._returncode(), pid, timeout, request, out, err)
            return subprocess.CompletedProcess(request, code, out.read_text(), err.read_text())

    def _returncode(self) -> int | None:
        try:
            return int(self.replies.get_nowait()["returncode"])
        except queue.Empty:
            return None


def wait_working(poll: Callable[[], int | None], pid: int, timeout: float, command: object, out: Path,
                 err: Path) -> int:  # fmt: skip
    """The exit code of the run ``pid``, waited for as long as it works (see the module docstring).

    Raises:
        subprocess.TimeoutExpired: the run hung or ran on too long; it is killed with every process it
            started, and its output so far, with the reason, is in the exception.
    """
    patience = Patience(lambda: cpu_seconds(pids=process_tree(pid)), stall_s=STALL_S, budget_s=timeout,
                        cap_s=CLOCK_FACTOR * timeout)
    while (code := poll()) is None:
        why = patience.over()
        if why is not None:
            for process in process_tree(pid):  # the run, its ranks (torchrun's in sessions of their own), workers
                with contextlib.suppress(ProcessLookupError):  # it may have ended since
                    os.kill(process, signal.SIGKILL)
            while poll() is None:
                time.sleep(0.1)
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), f"{err.read_text()}\nstopped: {why}")
        time.sleep(0.5)
    return code


def run_command(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None,
                timeout: float) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``subprocess.run(argv, capture_output=True, text=True)`` in a session of its own, bounded by its work."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        with open(out, "w") as stdout, open(err, "w") as stderr:
            process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
            code = wait_working(process.poll, process.pid, timeout, argv, out, err)
        return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())


@functools.cache
def forked_runs() -> ForkedRuns:
    """The one client of this test session (its server is started at the first call)."""
    return ForkedRuns()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        run(json.loads(sys.argv[2]))
    serve()
