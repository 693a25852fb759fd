"""Every Python block of the README and of the documentation pages runs as written (see ``doc_blocks``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import background
import pytest
from doc_blocks import README, ROOT, pages, python_blocks, run_page

PAGES_WITH_CODE = [page for page in pages() if python_blocks(page)]
SCRIPT_TIMEOUT_S = 240
HEADLESS = {**os.environ, "MPLBACKEND": "Agg"}
IN_BACKGROUND = ("docs/guides/lightning.md", "docs/guides/torchrun.md", "docs/guides/coming-from.md",
                 "docs/guides/scale-out.md",
                 "docs/guides/accelerate.md")
"""Pages whose scripts start processes that wait on each other for minutes if need be (Lightning's and
torchrun's process groups): each runs whole as a background command (``tests/background.py``), on the
CPU time the rest of the suite leaves. The testing pages bound their collectives at 60 s, which a
process given no CPU time for a while could pass: they run here."""
WITH_SCRIPTS = {
    page: background.command(f"docs {page.relative_to(ROOT)}", [sys.executable, str(ROOT / "tests" / "doc_blocks.py"),
                             str(page)], cwd=ROOT, env=HEADLESS)  # fmt: skip
    for page in PAGES_WITH_CODE
    if str(page.relative_to(ROOT)) in IN_BACKGROUND
}


@pytest.fixture(autouse=True)
def headless(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLBACKEND", "Agg")


@pytest.mark.timeout(960)
@pytest.mark.parametrize("page", [
    pytest.param(page, marks=[pytest.mark.background(WITH_SCRIPTS[page])] if page in WITH_SCRIPTS else [],
                 id=str(page.relative_to(ROOT)))
    for page in PAGES_WITH_CODE
])  # fmt: skip
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if page in WITH_SCRIPTS:
        done = background.outcome(WITH_SCRIPTS[page], timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        return
    monkeypatch.chdir(tmp_path)  # files the blocks write (shards, checkpoints) land here
    run_page(page, tmp_path, SCRIPT_TIMEOUT_S)


def test_the_pages_with_code_include_the_readme_and_the_guides() -> None:
    names = {str(page.relative_to(ROOT)) for page in PAGES_WITH_CODE}
    assert {"README.md", "docs/index.md", "docs/guides/options.md", "docs/guides/data.md",
            "docs/guides/lightning.md", "docs/guides/torchrun.md", "docs/guides/testing.md"} <= names


def test_scripts_name_a_file_and_a_command() -> None:
    for page in pages():
        for block in python_blocks(page):
            if block.code.startswith("# ") and ".py" in block.code.splitlines()[0]:
                assert block.script is not None, f"{block.where}: write '# NAME.py — run with: COMMAND'"
            if block.script is not None:
                assert block.script["command"].split()[0] in ("python", "torchrun", "accelerate"), block.where
                assert block.script["name"] in block.script["command"], block.where
                assert 'if __name__ == "__main__":' in block.code or "pytest" in block.script["command"], block.where


def test_the_readme_snippet_is_the_home_pages() -> None:
    """The short snippet is shown twice, on GitHub and on the site: the same code both times."""
    readme, home = python_blocks(README)[0].code, python_blocks(ROOT / "docs" / "index.md")[0].code
    assert readme == home
