"""The README's snippets for hard negatives, the memory queue and sample weights run as written."""

from __future__ import annotations

import re

import pytest
import torch
from test_readme import README

SECTION = "## Hard negatives, a memory queue, sample weights"


def section_blocks() -> list[str]:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.DOTALL)


def test_the_section_has_one_snippet_per_feature() -> None:
    blocks = section_blocks()
    assert len(blocks) == 3
    assert "negatives=hard_negatives" in blocks[0]
    assert "DistributedMemoryQueue" in blocks[1] and "queue.enqueue" in blocks[1]
    assert "weight=" in blocks[2] and 'reduction="none"' in blocks[2]


@pytest.mark.parametrize("index", range(3))
def test_snippet_runs_and_ends_in_backward(index: int) -> None:
    snippet = section_blocks()[index]
    assert len(snippet.strip().splitlines()) <= 15
    namespace: dict[str, object] = {}
    exec(compile(snippet, f"{README} ({SECTION}, snippet {index + 1})", "exec"), namespace)
    loss = namespace["loss"]
    assert isinstance(loss, torch.Tensor) and loss.ndim == 0 and loss.grad_fn is not None
    if "queue" in namespace:
        assert len(namespace["queue"]) == 3 * 32  # type: ignore[arg-type]
    if "rows" in namespace:
        rows, weight = namespace["rows"], namespace["weight"]
        # The claim in the snippet's comment, in one process.
        expected = (weight * rows).sum() / weight.sum()  # type: ignore[operator]
        torch.testing.assert_close(loss, expected)
