"""Commands that tests only wait for, run beside the suite, each with a CPU share of its own.

Some checks are one command and its outcome: a notebook executed in a fresh kernel, the Triton
interpreter's checks in a process of their own. The rest of the suite keeps about one of the
machine's cores busy on average (its processes start, import and wait on each other), so such a
command can run beside it instead of after it. A test module declares the command
(:func:`command`) and marks the test that reads its outcome ``@pytest.mark.background(key)``; the
checks a command runs in its own pytest process are marked ``@pytest.mark.in_background(key)``, and
every other session leaves them out (the conftest reports them as deselected and lists them with their
command at the end). Right after collection the conftest queues the commands of the tests selected to
run (:func:`queue`), in the order their tests come, and starts the next after each test
(:func:`advance`), at most :data:`AT_ONCE` at a time.

Each command runs in a session of its own, whose scheduler group (Linux gives each session one) is
at ``nice`` :data:`NICE` against the suite's: when the machine is busy (the suite, and anything else
it runs beside) the command still gets a share of the CPU, smaller than the suite's, so it neither
starves nor crowds out the suite's own tests. The test then waits for the outcome (:func:`outcome`,
which starts a command still queued), bounded by the command's work, not by the clock
(:class:`~contrastive_dist._cpu_clock.Patience`, over every process of its session): it is stopped
when it has used no CPU time for :data:`STALL_S` seconds (a hang), or more CPU time than its budget,
or at :data:`CAP_S` seconds of the clock; a command slowed by a busy machine is waited for. A command
whose test was not selected never starts; when the session ends every command's session is killed,
children included.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contrastive_dist._cpu_clock import Patience, cpu_seconds

__all__ = [
    "AT_ONCE", "CAP_S", "CHECKS_VARIABLE", "NICE", "POOL_TIMEOUT_VARIABLE", "STALL_S", "Command", "advance",
    "command", "left_out", "outcome", "queue", "report", "running", "start", "stop_all", "workspace",
]  # fmt: skip

AT_ONCE = 2
"""Commands running at once: enough that one finishing during a long test leaves the core busy."""
NICE = 5
"""The ``nice`` of a command's scheduler group: a share of the CPU about a third of the suite's when both want it."""
STALL_S = 300.0
"""A command that uses no CPU time for this long is taken for hung."""
CAP_S = 3 * 3600.0
"""Seconds of the clock after which a command is stopped whatever it does."""
CHECKS_VARIABLE = "CONTRASTIVE_DIST_BACKGROUND_COMMAND"
"""Set to a command's key in its environment: its own pytest run keeps the checks marked ``in_background(key)``."""


@dataclass
class Command:
    """One command's arguments, working folder, environment and preparation; its process once started."""

    argv: Sequence[str]
    cwd: Path
    env: dict[str, str]
    before: Callable[[], None] | None = None
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0  # time.monotonic() at its start
    ended: float = 0.0  # and when its outcome was read
    cpu: float = 0.0  # CPU seconds its session used, as last seen
    checks: int = 0  # the checks it runs in its own pytest process (left out of this session)


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
    _COMMANDS[key] = Command(list(argv), cwd, {**(os.environ if env is None else env), CHECKS_VARIABLE: key}, before)
    return key


def _share() -> None:
    """In the child (a new session), before it runs the command: its scheduler group at ``nice`` :data:`NICE`.

    Without it, each session would get as much CPU as the suite's processes together; ``SCHED_IDLE``
    would give it none while anything else runs, so that on a busy machine it would never finish.
    """
    try:
        Path("/proc/self/autogroup").write_text(str(NICE))
    except OSError:  # no scheduler groups here: the process's own nice instead
        os.nice(NICE)


def queue(key: str) -> None:
    """Queue ``key``'s command to start when fewer than :data:`AT_ONCE` run (see :func:`advance`)."""
    if key not in _QUEUED and _COMMANDS[key].process is None:
        _QUEUED.append(key)
    advance()


def advance() -> None:
    """Start queued commands, in order, while fewer than :data:`AT_ONCE` are running."""
    running = sum(1 for declared in _COMMANDS.values() if declared.process and not _ended(declared))
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
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_share,
        )  # fmt: skip
    declared.started = time.monotonic()


def outcome(key: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for ``key``'s command (started now if it was still queued) and return its exit code and output.

    ``timeout``: the command may use the CPU time of ``timeout`` seconds of every core, over every
    process of its session (what the clock allowed on an idle machine); the wait also ends when it
    uses none for :data:`STALL_S` seconds, and at :data:`CAP_S` seconds of the clock.

    Raises:
        TimeoutError: it was stopped for one of those (it is killed, with its children); the message says which.
    """
    start(key)
    declared, folder = _COMMANDS[key], workspace(key)
    process = declared.process
    assert process is not None
    budget = timeout * (os.cpu_count() or 1)
    patience = Patience(lambda: cpu_seconds(session=process.pid), stall_s=STALL_S, budget_s=budget, cap_s=CAP_S)
    while not _ended(declared):
        why = patience.over()
        if why is not None:
            _kill(process)
            raise TimeoutError(f"{' '.join(declared.argv)} was stopped: {why}")
        time.sleep(0.5)
    output, errors = ((folder / name).read_text(errors="replace") for name in ("stdout", "stderr"))
    return subprocess.CompletedProcess(declared.argv, process.returncode, output, errors)


def _ended(declared: Command) -> bool:
    """Whether the command has exited; reaped here, with the CPU time of its whole tree (what it waited for)."""
    process = declared.process
    assert process is not None
    if process.returncode is not None:
        return True
    try:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere: no usage to read
        process.wait()
        pid, status, usage = process.pid, 0, None
    if pid == 0:
        return False
    if usage is not None:
        process.returncode = os.waitstatus_to_exitcode(status)
        declared.cpu = usage.ru_utime + usage.ru_stime
    declared.ended = time.monotonic()
    return True


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


def left_out(key: str) -> None:
    """Count one more check of ``key``'s command that this session leaves out (the command runs it)."""
    if key in _COMMANDS:
        _COMMANDS[key].checks += 1


def report() -> list[str]:
    """One line per command queued this session: its checks, how it ended, its time and CPU time, its own summary."""
    lines = []
    for key, declared in _COMMANDS.items():
        process = declared.process
        if process is None:
            if declared.checks:
                lines.append(f"{key}: not run here (its test was not selected); {declared.checks} checks left out")
            continue
        ended = f"exit code {process.returncode}" if _ended(declared) else "still running, stopped"
        seconds = (declared.ended or time.monotonic()) - declared.started
        last = _last_line(workspace(key) / "stdout")
        checks = f"{declared.checks} checks run in its own pytest process; " if declared.checks else ""
        lines.append(f"{key}: {checks}{ended} after {seconds:.0f} s ({declared.cpu:.0f} s of CPU time)"
                     f"{f' | {last}' if last else ''}")
    return lines


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip("= ") if lines else ""


def running() -> list[int]:
    """The process ids of the commands started (their processes, not the suite's)."""
    return [declared.process.pid for declared in _COMMANDS.values() if declared.process is not None]


def stop_all() -> None:
    """Kill every command's session (the suite ends: nothing it started stays behind) and remove their files."""
    _QUEUED.clear()
    for declared in _COMMANDS.values():
        if declared.process is not None:
            _kill(declared.process)
    shutil.rmtree(workspace("-").parent, ignore_errors=True)
