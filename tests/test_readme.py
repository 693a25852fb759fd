"""The README is the front door: short, its first screen says what this is and how to install and run it."""

from __future__ import annotations

import re

from doc_blocks import README, ROOT, python_blocks, run_in_process

LINK = re.compile(r"\]\(([^)#<>]+)(#[^)]*)?\)")


def test_readme_is_short_and_its_first_screen_installs_and_runs() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200
    first_screen = "\n".join(lines[:50])
    assert "pip install -e ." in first_screen
    assert "```python" in first_screen and "loss.backward()" in first_screen
    text = README.read_text()
    assert 'pip install -e ".[recipes]" && python recipes/clip.py' in text
    assert 'pip install -e ".[dev]" && pytest' in text  # the command CI runs
    # A CPU-only machine: the CPU builds of torch and torchvision in one line (torchvision alone would pin a
    # CUDA torch of its own), and what the default one weighs; the venv stays out of git.
    cpu_line = "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_line in first_screen
    for page in ("docs/getting-started.md", "docs/index.md"):  # the site says it too
        assert cpu_line in (ROOT / page).read_text(), page
    assert "5.5 GB" in first_screen and ".venv" in first_screen
    assert ".venv/" in (ROOT / ".gitignore").read_text().splitlines()


def test_readme_snippet_runs_and_ends_in_backward() -> None:
    block = python_blocks(README)[0]
    assert len(block.code.strip().splitlines()) <= 15
    assert block.code.strip().endswith("loss.backward()")
    namespace: dict[str, object] = {}
    run_in_process(block, namespace)
    loss = namespace["loss"]
    assert loss.ndim == 0 and loss.grad_fn is not None  # type: ignore[attr-defined]


def test_every_relative_link_of_the_readme_exists() -> None:
    targets = [target for target, _ in LINK.findall(README.read_text()) if "://" not in target]
    assert targets, "the README links into the documentation"
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing
