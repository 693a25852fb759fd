"""Commands that tests only wait for, started when the session starts, on the CPU time the suite leaves idle.

Some checks are one command and its outcome: a notebook executed in a fresh kernel, the Triton
interpreter's checks in a process of their own. The rest of the suite keeps about one of the
machine's cores busy on average (its processes start, import and wait on each other), so such a
command can run beside it instead of after it. A test module declares the command
(:func:`command`) and marks the test that reads its outcome ``@pytest.mark.background(key)``; right
after collection the conftest starts the commands of the tests selected to run (:func:`start`), each
in a session of its own under ``SCHED_IDLE``, the Linux scheduling class that only takes CPU time no
other process wants (``nice 19`` where it is refused): the suite's other tests, some of which bound
their own waits in seconds, run as if nothing ran beside them. The test then waits for the outcome
(:func:`outcome`) — by then the command has usually finished, and if not, it now has the CPU the
waiting test leaves. A command whose test was not selected never starts; one that is still running
when the session ends is killed with its children.
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

__all__ = ["Command", "command", "outcome", "start", "stop_all", "workspace"]


@dataclass
class Command:
    """One command's arguments, working folder, environment and preparation; its process once started."""

    argv: Sequence[str]
    cwd: Path
    env: dict[str, str]
    before: Callable[[], None] | None = None
    process: subprocess.Popen[bytes] | None = None


_COMMANDS: dict[str, Command] = {}
_ROOT: list[Path] = []  # the session's folder for the commands' files, made on first use


def workspace(key: str) -> Path:
    """A folder of ``key``'s own for the session (its output lands there too), removed when the session ends."""
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="contrastive_dist_background_")))
    folder = _ROOT[0] / re.sub(r"[^\w.-]+", "_", key)
    folder.mkdir(exist_ok=True)
    return folder


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
    """In the child, before it runs the command: only the CPU time nothing else wants."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or refused: the lowest priority instead
        os.nice(19)


def start(key: str) -> None:
    """Start ``key``'s command (once): in a session of its own, at idle priority, its output to files."""
    declared = _COMMANDS[key]
    if declared.process is not None:
        return
    if declared.before is not None:
        declared.before()
    folder = workspace(key)
    with open(folder / "stdout", "wb") as stdout, open(folder / "stderr", "wb") as stderr:
        declared.process = subprocess.Popen(
            declared.argv, cwd=declared.cwd, env=declared.env, stdout=stdout, stderr=stderr,
            stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_idle,
        )  # fmt: skip


def outcome(key: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Wait for ``key``'s command (started now if it was not) and return its exit code and output.

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


def _kill(process: subprocess.Popen[bytes]) -> None:
    """The command's whole session: its own children (ranks, kernels) too."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def stop_all() -> None:
    """Kill every command's session (the suite ends: nothing it started stays behind) and remove their files."""
    for declared in _COMMANDS.values():
        if declared.process is not None:
            _kill(declared.process)
    if _ROOT:
        shutil.rmtree(_ROOT.pop(), ignore_errors=True)
