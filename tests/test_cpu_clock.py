"""A wait bounded by the work it waits for: a stalled process ends it, a busy one past its budget too.

Real processes: one that sleeps (uses no CPU time) and one that spins; each wait ends with the
reason it gives, and a process that works within its budget is waited for.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from contrastive_dist._cpu_clock import Patience, cpu_seconds

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from /proc")


def _wait(patience: Patience, process: subprocess.Popen[bytes]) -> str | None:
    while process.poll() is None:
        why = patience.over()
        if why is not None:
            return why
        time.sleep(0.1)
    return None


@pytest.mark.parametrize("kind", ["sleeps", "spins", "finishes"])
def test_a_wait_ends_on_a_stall_or_past_its_budget_and_not_while_the_work_goes_on(kind: str) -> None:
    code = {"sleeps": "import time; time.sleep(60)", "spins": "while True: pass",
            "finishes": "sum(range(3 * 10**6))"}[kind]
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        # Budget and stall far above what starting Python and the sum take, even on a busy machine.
        budget = 0.5 if kind == "spins" else 60.0
        why = _wait(Patience(lambda: cpu_seconds(session=process.pid), stall_s=3.0, budget_s=budget, cap_s=120),
                    process)
    finally:
        process.kill()
        process.wait()
    expected = {"sleeps": "no CPU time used for", "spins": "s of CPU time used, more than the 0.5 s allowed",
                "finishes": None}[kind]
    assert why == expected or (expected is not None and why is not None and expected in why), why


def test_cpu_seconds_counts_a_session_and_the_processes_given() -> None:
    mine = cpu_seconds(pids=[os.getpid()])
    assert mine is not None and mine > 0
    assert cpu_seconds(session=2**22 + 7) == 0.0  # no such session: nothing used


INNER_TESTS = '''
import time, pytest, work_bounds
work_bounds.STALL_S, work_bounds.CLOCK_FACTOR, work_bounds.CHECK_EVERY_S = 2.0, 1000.0, 0.2

@pytest.mark.timeout(1)
def test_slow_but_working():  # 3 s of the clock against a declared 1 s, using CPU time all along
    end = time.monotonic() + 3
    while time.monotonic() < end:
        pass

@pytest.mark.timeout(100)
def test_hung():
    time.sleep(60)
'''


def test_a_test_timeout_follows_the_work_a_slow_test_passes_and_a_hung_one_fails_early(tmp_path) -> None:
    # The suite's own conftest (tests/work_bounds.py through it) on two tests of a file of its own.
    tests = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "conftest.py").write_text(
        f"import importlib.util, sys\nsys.path.insert(0, {tests!r})\n"
        f"spec = importlib.util.spec_from_file_location('suite_conftest', {tests!r} + '/conftest.py')\n"
        "suite = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(suite)\n"
        "pytest_timeout_set_timer, pytest_timeout_cancel_timer = suite.pytest_timeout_set_timer, "
        "suite.pytest_timeout_cancel_timer\n")
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                             "--durations=0", str(tmp_path / "test_inner.py")], cwd=tmp_path, capture_output=True,
                            text=True, timeout=240)
    assert "1 failed, 1 passed" in result.stdout, result.stdout[-3000:]
    assert "test_hung - Failed: Timeout: no CPU time used for" in result.stdout, result.stdout[-3000:]
    hung = re.search(r"([0-9.]+)s call +test_inner.py::test_hung", result.stdout)
    assert hung and float(hung.group(1)) < 50, result.stdout[-3000:]  # found at its stall, not the sleep's end
