"""A wait bounded by the work it waits for: a stalled process ends it, a busy one past its budget too.

Real processes: one that sleeps (uses no CPU time) and one that spins; each wait ends with the
reason it gives, and a process that works within its budget is waited for.
"""

from __future__ import annotations

import os
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
