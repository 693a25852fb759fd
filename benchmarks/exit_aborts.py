"""Count aborts at interpreter exit: run gloo programs many times on a CPU loaded by a parallel job.

Processes that used gloo could abort after all their work, at interpreter exit, with "terminate
called without an active exception" (SIGABRT), more often on a loaded machine. This runs each
program ``--runs`` times, one after the other, while ``--load`` busy processes keep every core
occupied, and counts the runs that aborted (exit status -6 / 134, or those words in the output)
apart from other failures::

    python benchmarks/exit_aborts.py --runs 50                  # both programs, 2 busy processes
    python benchmarks/exit_aborts.py --runs 5 --programs recipe # a quick look

Programs: ``recipe`` is ``recipes/clip_torchrun.py`` under ``torchrun`` on 2 processes (a short
run, ending as the recipe ends: barrier, ``destroy_process_group``, a normal exit); ``lightning``
is ``tests/test_streaming_lightning.py``, whose ``ddp_spawn`` children end as Lightning ends them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABORT_WORDS = "terminate called without an active exception"


def _programs(output_dir: str) -> dict[str, list[str]]:
    return {
        "recipe": [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "recipes" / "clip_torchrun.py"), "--max-steps", "6", "--batch-size", "16",
            "--train-size", "256", "--checkpoint-every", "3", "--output-dir", output_dir,
        ],
        "lightning": [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
            str(ROOT / "tests" / "test_streaming_lightning.py"),
        ],
    }


def _busy(stop_at: float) -> None:
    """One core's worth of load: plain arithmetic until ``stop_at`` (no torch: nothing shared)."""
    value = 0
    while time.time() < stop_at:
        for step in range(100_000):
            value = (value * 31 + step) % 1_000_003


def _run_once(command: list[str], timeout: float) -> tuple[str, float]:
    """``"ok"``, ``"abort"`` or ``"failed (…)"``, and the seconds the run took."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"failed (no end within {timeout:.0f} s)", time.perf_counter() - start
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    if ABORT_WORDS in output or done.returncode in (-6, 134):
        return "abort", seconds
    if done.returncode != 0:
        return f"failed (exit status {done.returncode}: {output.strip().splitlines()[-1:]})", seconds
    return "ok", seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50, help="runs of each program")
    parser.add_argument("--programs", nargs="+", default=["recipe", "lightning"], choices=["recipe", "lightning"])
    parser.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes beside the runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    args = parser.parse_args()

    context = multiprocessing.get_context("spawn")
    load = [context.Process(target=_busy, args=(time.time() + 7 * 24 * 3600,), daemon=True) for _ in range(args.load)]
    for process in load:
        process.start()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            commands = _programs(output_dir)
            for name in args.programs:
                outcomes, times = [], []
                for run in range(args.runs):
                    outcome, seconds = _run_once(commands[name], args.timeout)
                    outcomes.append(outcome)
                    times.append(seconds)
                    print(f"{name} run {run + 1}/{args.runs}: {outcome} ({seconds:.1f} s)", flush=True)
                failures = [outcome for outcome in outcomes if outcome.startswith("failed")]
                rows.append((name, args.runs, outcomes.count("abort"), len(failures), statistics.median(times)))
                for failure in sorted(set(failures)):
                    print(f"  {name}: {failure}")
    finally:
        for process in load:
            process.terminate()
    print(f"\n{args.load} busy processes beside the runs, {os.cpu_count()} cores\n")
    print("| program | runs | aborts at exit | other failures | median run (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, runs, aborts, failed, median in rows:
        print(f"| {name} | {runs} | {aborts} | {failed} | {median:.1f} |")


if __name__ == "__main__":
    main()
