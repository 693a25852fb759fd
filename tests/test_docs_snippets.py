"""Every Python block of the README and of the documentation pages runs as written (see ``doc_blocks``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_blocks import README, ROOT, pages, python_blocks, run_in_process, run_script

PAGES_WITH_CODE = [page for page in pages() if python_blocks(page)]
SCRIPT_TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def headless(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPLBACKEND", "Agg")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[str(page.relative_to(ROOT)) for page in PAGES_WITH_CODE])
def test_every_block_of_the_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files the blocks write (shards, checkpoints) land here
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in python_blocks(page):
        if block.script is not None:
            run_script(block, tmp_path, SCRIPT_TIMEOUT_S)
        else:
            run_in_process(block, namespace)


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
                assert block.script["command"].split()[0] in ("python", "torchrun"), block.where
                assert block.script["name"] in block.script["command"], block.where
                assert 'if __name__ == "__main__":' in block.code or "pytest" in block.script["command"], block.where


def test_the_readme_snippet_is_the_home_pages() -> None:
    """The short snippet is shown twice, on GitHub and on the site: the same code both times."""
    readme, home = python_blocks(README)[0].code, python_blocks(ROOT / "docs" / "index.md")[0].code
    assert readme == home
