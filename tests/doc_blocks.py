"""The Python blocks of the README and of the documentation pages, as the tests run them.

A block runs in one of two ways:

* a **script** begins with ``# NAME.py — run with: COMMAND``: it is written to ``NAME.py`` and
  ``COMMAND`` runs it (``python`` is this interpreter, ``torchrun`` is ``python -m
  torch.distributed.run``, ``accelerate`` accelerate's command line); it must exit 0, and a
  ``# prints: TEXT`` line in it says what its output must contain (``...`` stands for any text);
* every other block runs in this process, after the page's earlier blocks, in their namespace, as
  a reader running them one after the other in a Python session would.

``python tests/doc_blocks.py PAGE`` runs one page's blocks so, in a fresh folder (its working
folder): how ``tests/test_docs_snippets.py`` runs the pages with scripts, as background commands.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import background
from forked_runs import forked_runs

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
SCRIPT = re.compile(r"^# (?P<name>\w+\.py) — run with: (?P<command>.+)$")
PRINTS = re.compile(r"^\s*# prints: (?P<text>.+)$", flags=re.MULTILINE)


@dataclass(frozen=True)
class Block:
    """One fenced Python block of a page."""

    page: Path
    line: int  # of the block's first line of code, from 1
    code: str

    @property
    def script(self) -> re.Match[str] | None:
        return SCRIPT.match(self.code.splitlines()[0]) if self.code.strip() else None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of the site's sources."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def python_blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [Block(page, text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in FENCE.finditer(text)]


def run_in_process(block: Block, namespace: dict[str, object]) -> None:
    exec(compile(block.code, block.where, "exec"), namespace)


def run_page(page: Path, directory: Path, timeout: float, *, forked: bool = True) -> None:
    """Every block of ``page`` in order, from ``directory`` (the working folder: files the blocks write land there)."""
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in python_blocks(page):
        if block.script is not None:
            run_script(block, directory, timeout, forked=forked)
        else:
            run_in_process(block, namespace)


def run_script(block: Block, directory: Path, timeout: float, *, forked: bool = True) -> str:
    """Write the block to its file in ``directory``, run its command there; return its output.

    ``forked``: a ``python FILE.py`` command runs as a fork of the process that imported torch and
    Lightning already (``forked_runs``); otherwise every command is a fresh process.
    """
    script = block.script
    assert script is not None, block.where
    (directory / script["name"]).write_text(block.code, encoding="utf-8")
    command = shlex.split(script["command"])
    launcher = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"],
                "accelerate": [sys.executable, "-m", "accelerate.commands.accelerate_cli"]}
    if forked and command[0] == "python" and not command[1].startswith("-"):  # `python FILE.py`: a fork
        result = forked_runs().script(command[1:], cwd=directory, env=dict(os.environ), timeout=timeout)
    else:
        argv = [*launcher[command[0]], *command[1:]]
        result = subprocess.run(argv, cwd=directory, capture_output=True, text=True, timeout=timeout)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{block.where}: {' '.join(command)} exited {result.returncode}\n{output[-6000:]}"
    for expected in PRINTS.findall(block.code):
        pattern = ".*?".join(re.escape(piece.strip()) for piece in expected.split("..."))
        found = re.search(pattern, output, flags=re.DOTALL)
        assert found, f"{block.where}: the output lacks {expected!r}\n{output[-3000:]}"
    return output


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="doc_blocks_") as folder:
        os.chdir(folder)
        # No bound of its own but the clock's cap, and no fork server (whose start is bounded in seconds): the
        # wait for this command follows its work (tests/background.py), a busy machine only slows it.
        run_page(Path(sys.argv[1]).resolve(), Path(folder), timeout=background.CAP_S, forked=False)
