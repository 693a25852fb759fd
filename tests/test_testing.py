"""``run_distributed`` / ``WorkerPool`` say why a function cannot reach the spawned processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from contrastive_dist.testing import WorkerPool, check_importable, run_distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
from contrastive_dist.testing import run_distributed

def rank_of(rank, world_size):
    return rank

print(run_distributed(rank_of, 2))
"""


def module_level(rank: int, world_size: int) -> int:
    return rank


def _python(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], input=stdin, capture_output=True, text=True, timeout=120, env=environment, cwd=ROOT
    )


def test_python_dash_c_names_the_cause() -> None:
    result = _python("-c", SCRIPT)
    assert result.returncode != 0
    assert "ValueError: fn=rank_of is defined in __main__ of python -c" in result.stderr, result.stderr
    assert "did not start" not in result.stderr and "died" not in result.stderr


def test_script_from_stdin_names_the_cause() -> None:
    script = (
        "from contrastive_dist.testing import WorkerPool, run_distributed\n"
        "def rank_of(rank, world_size):\n    return rank\n"
        "try:\n    run_distributed(rank_of, 2)\nexcept ValueError as error:\n    print(error)\n"
        "WorkerPool(2)\n"
    )
    result = _python("-", stdin=script)
    assert "fn=rank_of is defined in __main__ of a script read from <stdin>" in result.stdout, result.stdout
    # Even an importable function cannot help: the workers would re-run the script from its file.
    assert result.returncode != 0
    assert "WorkerPool cannot start processes from a script read from <stdin>" in result.stderr, result.stderr
    assert "did not start" not in result.stderr


def test_a_script_file_with_a_main_guard_works(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    body = SCRIPT.replace("print(run_distributed", 'if __name__ == "__main__":\n    print(run_distributed')
    script.write_text(body)
    result = _python(str(script))
    assert result.returncode == 0 and result.stdout.strip() == "[0, 1]", result.stderr


def test_lambdas_and_nested_functions_are_refused_before_any_process_starts() -> None:
    def nested(rank: int, world_size: int) -> int:
        return rank

    for fn in (lambda rank, world_size: rank, nested):
        with pytest.raises(ValueError, match="lambda or a nested function"):
            run_distributed(fn, 2)
    check_importable(module_level)  # a module-level function of an importable module passes
    assert WorkerPool.run.__doc__ is not None
