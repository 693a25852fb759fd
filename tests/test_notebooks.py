"""Every notebook runs top to bottom without an error, and is committed with its plots.

Executed in a fresh ``python3`` kernel with the working directory set to ``notebooks/`` (as
Jupyter does) and ``CONTRASTIVE_DIST_NOTEBOOK_QUICK=1``, which makes the notebooks use smaller
sizes; the committed outputs come from a normal run. Each run is a command of the suite's
background (``tests/notebook_run.py``, started with the session: ``tests/background.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

import background  # noqa: E402

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
RUNNER = Path(__file__).with_name("notebook_run.py")
ENVIRONMENT = {**os.environ, "CONTRASTIVE_DIST_NOTEBOOK_QUICK": "1", "MPLBACKEND": "Agg"}  # the kernel inherits it
RUNS = {
    path: background.command(f"notebook {path.stem}", [sys.executable, str(RUNNER), str(path)], cwd=NOTEBOOK_DIR,
                             env=ENVIRONMENT)  # fmt: skip
    for path in NOTEBOOKS
}


def test_notebooks_are_present() -> None:
    names = [path.name for path in NOTEBOOKS]
    assert names == ["01_gradient_exactness.ipynb", "02_memory_and_speed.ipynb", "03_clip_walkthrough.ipynb"]


@pytest.mark.timeout(960)
@pytest.mark.parametrize(
    "path", [pytest.param(path, marks=pytest.mark.background(RUNS[path]), id=path.stem) for path in NOTEBOOKS]
)
def test_notebook_runs(path: Path) -> None:
    done = background.outcome(RUNS[path], timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]  # a cell's error and its traceback
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["errors"]
    assert report["images"], f"{path.name} drew no plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_committed_notebook_shows_its_plots(path: Path) -> None:
    """Viewed on GitHub, a notebook shows its saved outputs: they must be there, and stay small."""
    notebook = json.loads(path.read_text())
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert all(cell["execution_count"] is not None for cell in code_cells), f"{path.name} is not fully executed"
    assert not [out for cell in code_cells for out in cell["outputs"] if out["output_type"] == "error"]
    assert any("image/png" in out.get("data", {}) for cell in code_cells for out in cell["outputs"])
    assert path.stat().st_size < 300 * 1024, f"{path.name} is {path.stat().st_size // 1024} KB"
