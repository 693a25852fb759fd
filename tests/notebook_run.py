"""Execute one notebook top to bottom in a fresh ``python3`` kernel; print what the tests check, as JSON.

``python tests/notebook_run.py NOTEBOOK`` runs it as Jupyter would (working folder: the notebook's),
registering the ``python3`` kernel from the installed ipykernel (no network) when Jupyter cannot
find it, and prints ``{"errors": [...], "images": N}``: the error outputs and how many plots were
drawn. A cell that raises ends the run with its traceback and exit code 1. ``tests/test_notebooks.py``
starts it as a background command (``tests/background.py``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import nbclient
import nbformat
from jupyter_client.kernelspec import KernelSpecManager

KERNEL = "python3"
CELL_TIMEOUT_S = 600
"""A cell's bound, and the kernel start's: generous, the run may get only the CPU time the suite leaves."""


def _kernel() -> str:
    """The ``python3`` kernel, registered in a temporary prefix when Jupyter cannot find it."""
    if KERNEL not in KernelSpecManager().find_kernel_specs():
        from ipykernel.kernelspec import install

        prefix = tempfile.mkdtemp(prefix="jupyter_")
        install(prefix=prefix, kernel_name=KERNEL)
        os.environ["JUPYTER_PATH"] = str(Path(prefix) / "share" / "jupyter")
    return KERNEL


def main(path: Path) -> int:
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, kernel_name=_kernel(), timeout=CELL_TIMEOUT_S, startup_timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    outputs = [output for cell in notebook.cells for output in cell.get("outputs", [])]
    errors = [output for output in outputs if output.output_type == "error"]
    images = sum("image/png" in output.get("data", {}) for output in outputs)
    print(json.dumps({"errors": errors, "images": images}))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]).resolve()))
