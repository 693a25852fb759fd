"""The README's first Python snippet runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_snippet_runs_and_ends_in_backward():
    snippet = python_blocks()[0]
    assert len(snippet.strip().splitlines()) <= 15
    assert snippet.strip().endswith("loss.backward()")
    namespace: dict[str, object] = {}
    exec(compile(snippet, str(README), "exec"), namespace)
    loss = namespace["loss"]
    assert loss.ndim == 0 and loss.grad_fn is not None  # type: ignore[attr-defined]
