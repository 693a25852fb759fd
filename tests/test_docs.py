"""The documentation site builds strictly, offline, and its API reference covers every public name.

``mkdocs build --strict`` fails on any warning: a broken link or anchor, a cross-reference to an API
object that has no page, a docstring the renderer cannot parse. Skipped only when the site's tools
are not installed (``pip install -e ".[docs]"``; the ``dev`` extra includes them).
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import DOCS, ROOT, python_blocks

import contrastive_dist
import contrastive_dist.compat
import contrastive_dist.testing

API = DOCS / "api"
BLOCK = re.compile(r"^::: ([\w.]+)\s*$", flags=re.MULTILINE)
# Names whose docstring has no runnable example yet; their API page shows one (a script block that names them).
EXAMPLE_ON_THE_PAGE = {"contrastive_dist.testing.run_distributed", "contrastive_dist.testing.RemoteError"}


def public_names() -> list[str]:
    lightning = importlib.import_module("contrastive_dist.lightning")
    compat = [getattr(contrastive_dist.compat, module) for module in contrastive_dist.compat.__all__]
    return ([f"contrastive_dist.{name}" for name in contrastive_dist.__all__]
            + [f"contrastive_dist.lightning.{name}" for name in lightning.__all__]
            + [f"contrastive_dist.testing.{name}" for name in contrastive_dist.testing.__all__]
            + [f"{module.__name__}.{name}" for module in compat for name in module.__all__])


def heading_id(name: str) -> str:
    """The anchor of a name's entry: its public path, or where a module of the same name shadows it."""
    module, _, short = name.rpartition(".")
    obj = getattr(importlib.import_module(module), short)
    shadowed = getattr(contrastive_dist, short, None) is obj and f"contrastive_dist.losses.{short}" == obj.__module__
    return f"{obj.__module__}.{short}" if shadowed else name


def test_the_api_pages_render_every_public_name() -> None:
    rendered = {path for page in API.glob("*.md") for path in BLOCK.findall(page.read_text())}
    for name in public_names():
        module = name.rsplit(".", 1)[0]
        assert heading_id(name) in rendered or module in rendered, f"{name} has no ::: block on an API page"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for tool in ("mkdocs", "material", "mkdocstrings_handlers.python", "latex2mathml"):
        pytest.importorskip(tool, reason='the documentation tools: pip install -e ".[docs]"')
    site_dir = tmp_path_factory.mktemp("site")
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # a banner about the theme's future, not a warning
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
                            cwd=ROOT, capture_output=True, text=True, timeout=240, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return site_dir


def entry(site: Path, name: str) -> str:
    """The HTML of one API entry: from its heading to the next entry of the same page."""
    anchor = f'id="{heading_id(name)}"'
    for page in (site / "api").rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        if anchor in html:
            start = html.index(anchor)
            end = html.find('<div class="doc doc-object', start)
            return html[start : end if end > 0 else len(html)]
    raise AssertionError(f"{name}: no API entry with {anchor}")


@pytest.mark.timeout(300)
def test_every_public_name_has_an_entry_with_signature_docstring_and_example(site: Path) -> None:
    for name in public_names():
        html = entry(site, name)
        assert "doc-signature" in html or "doc-heading" in html, f"{name}: no signature"
        assert 'class="doc doc-contents' in html and "<p>" in html, f"{name}: no docstring"
        if name in EXAMPLE_ON_THE_PAGE:
            page = API / "testing.md"
            assert any(name.rsplit(".", 1)[-1] in block.code for block in python_blocks(page)), name
        else:
            assert "Examples:" in html, f"{name}: its docstring has no example"


@pytest.mark.timeout(300)
def test_the_api_index_lists_every_public_name(site: Path) -> None:
    index = (site / "api" / "index.html").read_text(encoding="utf-8")
    for name in public_names():
        assert f'#{heading_id(name)}"' in index, f"{name}: not linked from the API index"


@pytest.mark.timeout(300)
def test_the_site_loads_nothing_from_the_network(site: Path) -> None:
    """Scripts, styles, fonts and images come from the site itself: it reads offline."""
    remote = re.compile(r"""<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=["'](?:https?:)?//""")
    for page in site.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        found = [match.group(0) for match in remote.finditer(html) if "rel=\"canonical\"" not in match.group(0)]
        assert not found, f"{page.relative_to(site)} loads {found[:3]}"
    for sheet in site.rglob("*.css"):
        assert not re.search(r"url\(\s*[\"']?(?:https?:)?//", sheet.read_text(encoding="utf-8")), sheet


@pytest.mark.timeout(300)
def test_the_notebooks_are_pages_with_their_figures(site: Path) -> None:
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = site / "notebooks" / notebook.stem / "index.html"
        html = page.read_text(encoding="utf-8")
        figures = re.findall(r'<img[^>]+src="([^"]+\.png)"', html)
        assert figures, f"{notebook.name}: no figure on its page"
        assert all((page.parent / figure).resolve().is_file() for figure in figures)
        assert "<math" in html or "$" not in notebook.read_text(), f"{notebook.name}: its formulas are not rendered"


@pytest.mark.timeout(300)
def test_long_signatures_render_formatted_on_several_lines_that_fit_the_column(site: Path) -> None:
    # Without a formatter (ruff, in the docs extra) mkdocstrings writes a signature as one line: info_nce's
    # ran past 500 characters, cut at the page's edge.
    html = entry(site, "contrastive_dist.info_nce")
    code = re.search(r'class="[^"]*doc-signature[^"]*"><pre><span></span><code>(.*?)</code>', html, flags=re.DOTALL)
    assert code is not None, "info_nce: no signature block"
    lines = re.sub(r"<[^>]+>", "", code.group(1)).splitlines()
    assert len(lines) > 10 and lines[0] == "info_nce(" and lines[-1].startswith(")"), lines
    assert max(map(len, lines)) <= 80, max(lines, key=len)


def test_cross_references_read_on_a_forge_too() -> None:
    # mkdocs' autorefs form [text][identifier] shows as raw brackets where the Markdown is read directly;
    # a relative link to the API page's anchor reads everywhere, and the strict build checks the anchor.
    autoref = re.compile(r"\]\[contrastive_dist[\w.]*\]")
    found = [f"{page.relative_to(DOCS)}: {match.group(0)}" for page in DOCS.rglob("*.md") if page.parent != API
             for match in autoref.finditer(page.read_text())]
    assert not found, found[:5]


CODE_COLUMN = 100  # characters of a code line the site's column shows; docs/assets/extra.css wraps longer ones


def test_code_lines_of_the_pages_fit_the_column() -> None:
    fence = re.compile(r"^```(python|bash)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
    wide = [f"{page.relative_to(DOCS)}: {line}" for page in DOCS.rglob("*.md")
            for _, code in fence.findall(page.read_text()) for line in code.splitlines() if len(line) > CODE_COLUMN]
    assert not wide, wide[:5]
