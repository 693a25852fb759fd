"""MkDocs hook: the API reference's index, one row per public name, generated from the API pages.

The rows are the ``::: path`` blocks of the API pages, in the navigation's order (a module block,
``contrastive_dist.lightning`` or ``contrastive_dist.testing``, stands for the names in its
``__all__``), each with the first line of its docstring: a name added to a page is listed, and
nothing is written twice. ``tests/test_docs.py`` checks that the pages cover every public name.
"""

from __future__ import annotations

import re
from pathlib import Path

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- the table of every public name -->"
BLOCK = re.compile(r"^::: ([\w.]+)\s*$", flags=re.MULTILINE)


def documented(page_source: str, package: griffe.Module) -> list[tuple[str, str]]:
    """``(identifier, first docstring line)`` of every object a page renders, modules expanded."""
    rows = []
    for path in BLOCK.findall(page_source):
        obj = package[path.removeprefix("contrastive_dist.")] if path != "contrastive_dist" else package
        names = [f"{path}.{name}" for name in obj.exports] if obj.is_module and obj.exports else [path]
        for name in names:
            target = package[name.removeprefix("contrastive_dist.")]
            docstring = target.docstring.value if target.docstring else ""
            rows.append((name, docstring.strip().splitlines()[0] if docstring.strip() else ""))
    return rows


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill the index page's marker with one table per API page."""
    if MARKER not in markdown:
        return markdown
    # The docstrings as the API pages show them (roles turned into links): the same extension.
    extensions = griffe.load_extensions(str(Path(__file__).with_name("docstrings.py")))
    package = griffe.load("contrastive_dist", search_paths=[str(ROOT)], resolve_aliases=True, extensions=extensions)
    pages = [item.file.src_uri for item in page.parent.children if item.is_page] if page.parent else []
    sections = []
    for src_uri in pages:
        if src_uri == page.file.src_uri:
            continue
        source = (Path(config.docs_dir) / src_uri).read_text(encoding="utf-8")
        title = source.splitlines()[0].lstrip("# ").strip()
        lines = [f"## [{title}]({Path(src_uri).name})", "", "| name | what it is |", "|---|---|"]
        for identifier, summary in documented(source, package):
            shown, summary = identifier.rsplit(".", 1)[-1], summary.replace("|", r"\|")
            lines.append(f"| [`{shown}`][{identifier}] | {summary} |")
        sections.append("\n".join(lines))
    return markdown.replace(MARKER, "\n\n".join(sections))
