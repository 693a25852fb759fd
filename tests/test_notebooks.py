"""Every notebook runs top to bottom without an error, and is committed with its plots.

Executed in a fresh ``python3`` kernel with the working directory set to ``notebooks/`` (as
Jupyter does) and ``CONTRASTIVE_DIST_NOTEBOOK_QUICK=1``, which makes the notebooks use smaller
sizes; the committed outputs come from a normal run.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 150
KERNEL = "python3"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``python3`` kernel; registered from the installed ipykernel (no network) when Jupyter cannot find it."""
    from jupyter_client.kernelspec import KernelSpecManager

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTRASTIVE_DIST_NOTEBOOK_QUICK", "1")  # the kernel inherits this environment
        patch.setenv("MPLBACKEND", "Agg")
        if KERNEL not in KernelSpecManager().find_kernel_specs():
            from ipykernel.kernelspec import install

            prefix = tmp_path_factory.mktemp("jupyter")
            install(prefix=str(prefix), kernel_name=KERNEL)
            patch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
            assert KERNEL in KernelSpecManager().find_kernel_specs()
        yield KERNEL


def test_notebooks_are_present() -> None:
    names = [path.name for path in NOTEBOOKS]
    assert names == ["01_gradient_exactness.ipynb", "02_memory_and_speed.ipynb", "03_clip_walkthrough.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_notebook_runs(path: Path, kernel_name: str) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=kernel_name,
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    errors = [output for cell in notebook.cells for output in cell.get("outputs", []) if output.output_type == "error"]
    assert not errors
    images = [output for cell in notebook.cells for output in cell.get("outputs", [])
              if "image/png" in output.get("data", {})]
    assert images, f"{path.name} drew no plot"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.stem for path in NOTEBOOKS])
def test_committed_notebook_shows_its_plots(path: Path) -> None:
    """Viewed on GitHub, a notebook shows its saved outputs: they must be there, and stay small."""
    notebook = json.loads(path.read_text())
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert all(cell["execution_count"] is not None for cell in code_cells), f"{path.name} is not fully executed"
    assert not [out for cell in code_cells for out in cell["outputs"] if out["output_type"] == "error"]
    assert any("image/png" in out.get("data", {}) for cell in code_cells for out in cell["outputs"])
    assert path.stat().st_size < 300 * 1024, f"{path.name} is {path.stat().st_size // 1024} KB"
