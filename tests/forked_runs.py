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
process group, which a timeout kills), then ``{"returncode"}``.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

SERVER = Path(__file__).resolve()


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
        self.ready = bool(self.replies.get(timeout=120)["ready"])

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
                code = subprocess.run([sys.executable, str(SERVER), "--run", json.dumps(request)], env=env,
                                      timeout=timeout).returncode
                return subprocess.CompletedProcess(request, code, out.read_text(), err.read_text())
            assert self.server.stdin is not None
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            pid = self.replies.get(timeout=60)["pid"]
            try:
                code = self.replies.get(timeout=timeout)["returncode"]
            except queue.Empty:
                os.killpg(pid, signal.SIGKILL)  # the run, its ranks and their workers
                self.replies.get(timeout=60)
                raise subprocess.TimeoutExpired(request, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(request, code, out.read_text(), err.read_text())


@functools.cache
def forked_runs() -> ForkedRuns:
    """The one client of this test session (its server is started at the first call)."""
    return ForkedRuns()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        run(json.loads(sys.argv[2]))
    serve()
