"""MkDocs hook: the committed notebooks become pages of the site, with their saved outputs.

Each ``notebooks/NAME.ipynb`` becomes the page ``notebooks/NAME.md``: markdown cells as they are
(LaTeX turned into MathML, which browsers draw without a script from the network), code cells as
highlighted Python, text outputs as text blocks and every PNG output as an image file,
``notebooks/NAME/figure-K.png`` (K counts the notebook's figures from 1), which the guides may show
too. Nothing is executed here: the outputs are those committed (``tests/test_notebooks.py`` runs the
notebooks and checks that they are committed executed). Links from a notebook to files of the
repository outside the site are shown as file names.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

from latex2mathml.converter import convert as latex_to_mathml
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", flags=re.DOTALL)
INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\s)(.+?)(?<![\s\\])\$")
OUTSIDE_LINK = re.compile(r"\[([^\]]+)\]\((\.\./[^)]+)\)")


def figure_name(notebook: str, index: int) -> str:
    """The site path of a notebook's ``index``-th figure (from 1)."""
    return f"notebooks/{notebook}/figure-{index}.png"


def _math(text: str) -> str:
    # Code spans hold dollar signs of their own (shell variables): leave them alone.
    pieces = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(pieces), 2):
        piece = DISPLAY_MATH.sub(lambda m: latex_to_mathml(m.group(1).strip(), display="block"), pieces[i])
        pieces[i] = INLINE_MATH.sub(lambda m: latex_to_mathml(m.group(1)), piece)
    return "".join(pieces)


def _markdown_cell(source: str) -> str:
    # A link to a repository file outside the site (../benchmarks/x.py) cannot resolve here: name the file.
    source = OUTSIDE_LINK.sub(lambda m: m.group(1) if m.group(1).startswith("`") else f"`{m.group(1)}`", source)
    return _math(source)


def _fenced(language: str, text: str) -> str:
    fence = "````" if "```" in text else "```"
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def notebook_page(path: Path) -> tuple[str, list[bytes]]:
    """The markdown of one notebook's page, and its figures (PNG bytes) in order."""
    notebook: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    parts: list[str] = []
    figures: list[bytes] = []
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            parts.append(_markdown_cell(source))
            continue
        if cell["cell_type"] != "code" or not source.strip():
            continue
        parts.append(_fenced("python", source))
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if output["output_type"] == "stream":
                parts.append(_fenced("text", "".join(output["text"])))
            elif "image/png" in data:
                figures.append(base64.b64decode(data["image/png"]))
                parts.append(f"![Figure {len(figures)}]({path.stem}/figure-{len(figures)}.png)")
            elif "text/plain" in data:
                parts.append(_fenced("text", "".join(data["text/plain"])))
    source_note = (
        f'!!! info "`notebooks/{path.name}`"\n'
        "    Shown with the outputs it was committed with; run it with Jupyter from the `notebooks/` folder.\n"
    )
    return "\n\n".join([parts[0], source_note, *parts[1:]]) + "\n", figures


@event_priority(100)  # before the other plugins look at the files
def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every notebook's page and figures to the site."""
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        page, figures = notebook_page(path)
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=page))
        for index, png in enumerate(figures, start=1):
            files.append(File.generated(config, figure_name(path.stem, index), content=png))
    return files
