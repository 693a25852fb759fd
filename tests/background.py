"""Commands that tests only wait for, run beside the suite on the CPU time it leaves idle.

Some checks are one command and its outcome: a notebook executed in a fresh kernel, the Triton
interpreter's checks in a process of their own. The rest of the suite keeps about one of the
machine's cores busy on average (its processes start, import and wait on each other), so such a
command can run beside it instead of after it. A test module declares the command
(:func:`command`) and marks the test that reads its outcome ``@pytest.mark.background(key)``; right
after collection the conftest queues the commands of the tests selected to run (:func:`queue`), in
the order their tests come, and starts the next after each test (:func:`advance`), at most
:data:`AT_ONCE` at a time. Each runs in a session of its own whose CPU share is the smallest there
is: its scheduler group (Linux gives each session one) at ``nice 19`` against the suite's other
processes, its threads in ``SCHED_IDLE`` within it. The suite's other tests, some of which bound
their own waits in seconds, run as if nothing ran beside them. The test then waits for the outcome
(:func:`outcome`, which starts a command still queued): by then the command has usually finished,
and if not, it has the CPU the waiting test leaves. A command whose test was not selected never
starts; when the session ends every command's session is killed, children included.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "AT_ONCE", "POOL_TIMEOUT_VARIABLE", "Command", "advance", "command", "outcome", "queue", "start", "stop_all",
    "workspace",
]  # fmt: skip

AT_ONCE = 2
"""Commands running at once: enough that one finishing during a long test leaves the core busy."""


@dataclass
class Command:
    """One command's arguments, working folder, environment and preparation; its process once started."""

    argv: Sequence[str]
    cwd: Path
    env: dict[str, str]
    before: Callable[[], None] | None = None
    process: subprocess.Popen[bytes] | None = None


POOL_TIMEOUT_VARIABLE = "CONTRASTIVE_DIST_TEST_POOL_TIMEOUT"
"""Seconds the conftest's worker pools wait in a collective (default 60): a background command that runs
pytest sets it higher, since its ranks may get no CPU time for a while when the suite is busy."""

_COMMANDS: dict[str, Command] = {}
_QUEUED: list[str] = []
def workspace(key: str) -> Path:
    """The folder of ``key``'s own for the session (its output lands there too), made when the command starts
    and removed when the session ends. Only a path until then: the worker processes that import a test
    module to run its functions compute it too, and make nothing."""
    session = Path(tempfile.gettempdir()) / f"contrastive_dist_background_{os.getpid()}"
    return session / re.sub(r"[^\w.-]+", "_", key)


def command(
    key: str, argv: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None,
    before: Callable[[], None] | None = None,
) -> str:  # fmt: skip
    """Declare the command whose outcome the tests marked ``background(key)`` read; returns ``key``.

    ``before``: what to prepare (files the command reads) right before it starts.
    """
    _COMMANDS[key] = Command(list(argv), cwd, dict(os.environ if env is None else env), before)
    return key


def _idle() -> None:
    """In the child (a new session), before it runs the command: the least CPU share Linux gives.

    The session's scheduler group at ``nice 19`` (without it, each session would get as much CPU as
    the suite's processes together), its threads in ``SCHED_IDLE`` (``nice 19`` where refused).
    """
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:  # no autogroups here: the policy below is the whole story
        pass
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or refused: the lowest priority instead
        os.nice(19)


def queue(key: str) -> None:
    """Queue ``key``'s command to start when fewer than :data:`AT_ONCE` run (see :func:`advance`)."""
    if key not in _QUEUED and _COMMANDS[key].process is None:
        _QUEUED.append(key)
    advance()


def advance() -> None:
    """Start queued commands, in order, while fewer than :data:`AT_ONCE` are running."""
    running = sum(1 for declared in _COMMANDS.values() if declared.process and declared.process.poll() is None)
    while _QUEUED and running < AT_ONCE:
        start(_QUEUED.pop(0))
        running += 1


def start(key: str) -> None:
    """Start ``key``'s command (once): in a session of its own, at idle priority, its output to files."""
    declared = _COMMANDS[key]
    if key in _QUEUED:
        _QUEUED.remove(key)
    if declared.process is not None:
        return
    folder = workspace(key)
    shutil.rmtree(folder, ignore_errors=True)  # (a folder left by an earlier process of the same number)
    folder.mkdir(parents=True)
    if declared.before is not None:
        declared.before()
    with open(folder / "stdout", "wb") as stdout, open(folder / "stderr", "wb") as stderr:
        declared.process = subprocess.Popen(
            declared.argv, cwd=declared.cwd, env=declared.env, stdout=stdout, stderr=stderr,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_idle,
        )  # fmt: skip


def outcome(key: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for ``key``'s command (started now if it was still queued) and return its exit code and output.

    Raises:
        TimeoutError: it ran past ``timeout`` seconds from now (it is killed, with its children).
    """
    start(key)
    declared, folder = _COMMANDS[key], workspace(key)
    assert declared.process is not None
    try:
        returncode = declared.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(declared.process)
        raise TimeoutError(f"{' '.join(declared.argv)} was still running after {timeout:.0f} s") from None
    output, errors = ((folder / name).read_text(errors="replace") for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess(declared.argv, returncode, output, errors)


def assert_every_check_passed(key: str, passed: int | None = None, timeout: float = 900) -> None:
    """``key``'s command is a pytest run (a test file's checks in a process of their own): it exited 0 and
    every check it collected ran and passed (``passed`` of them, when given), none skipped."""
    done = outcome(key, timeout)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert f"{'' if passed is None else passed} passed" in summary, done.stdout[-3000:]
    assert "skipped" not in summary, done.stdout[-3000:]


def _kill(process: subprocess.Popen[bytes]) -> None:
    """The command's whole session: its own children (ranks, kernels) too."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def stop_all() -> None:
    """Kill every command's session (the suite ends: nothing it started stays behind) and remove their files."""
    _QUEUED.clear()
    for declared in _COMMANDS.values():
        if declared.process is not None:
            _kill(declared.process)
    shutil.rmtree(workspace("-").parent, ignore_errors=True)
