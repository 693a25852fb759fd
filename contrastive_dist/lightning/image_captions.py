"""Images with several captions each, from a CSV: one sample an image and all of its captions.

A CSV in open_clip's layout lists one pair a row (:func:`~contrastive_dist.lightning.image_text.csv_rows`);
an image with several captions either repeats its path on several rows, or holds a JSON list of
captions in one cell (``["a red circle", "a circle, red"]``). :func:`captions_by_image` joins them,
:class:`CsvImageCaptions` loads each image with its captions, and :class:`CaptionsCollate` batches
them for a loss with ``image_ids=`` and ``text_ids=``: ``n`` images, their ``m`` captions, each
caption's id that of its image (the image's index in the dataset, unique across ranks).

Example:
    >>> rows = [("a.png", "a red circle", 0), ("b.png", '["a blue square", "blue, a square"]', 1),
    ...         ("a.png", "a circle, red", 2)]
    >>> captions_by_image(rows)
    [('a.png', ['a red circle', 'a circle, red']), ('b.png', ['a blue square', 'blue, a square'])]
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from contrastive_dist.lightning.towers import ByteTokenizer
from contrastive_dist.shapes import normalize

__all__ = ["CaptionsCollate", "CsvImageCaptions", "captions_by_image"]


def captions_by_image(rows: Sequence[tuple[str, str, int]]) -> list[tuple[str, list[str]]]:
    """``(image path, captions)`` in the order the images first appear; a JSON list cell is several captions."""
    grouped: dict[str, list[str]] = {}
    for path, caption, _ in rows:
        grouped.setdefault(path, []).extend(_captions_in(caption))
    return list(grouped.items())


def _captions_in(cell: str) -> list[str]:
    """A caption cell's captions: a JSON list of strings, or the cell itself."""
    if cell.lstrip().startswith("["):
        try:
            parsed = json.loads(cell)
        except json.JSONDecodeError:
            return [cell]
        if isinstance(parsed, list) and parsed and all(isinstance(text, str) for text in parsed):
            return parsed
    return [cell]


class CsvImageCaptions:
    """``(transform(image), captions, index)`` of :func:`captions_by_image`'s images, paths relative to ``root``."""

    def __init__(self, groups: Sequence[tuple[str, list[str]]], root: Path, transform: Callable[[Any], Any]) -> None:
        self.groups, self.root, self.transform = list(groups), Path(root), transform

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> tuple[Any, list[str], int]:
        from PIL import Image

        path, captions = self.groups[index]
        with Image.open(self.root / path) as image:
            return self.transform(image.convert("RGB")), captions, index


class CaptionsCollate:
    """``(image uint8, captions, index)`` items → ``(images, tokens, image_ids, text_ids)``; picklable for workers.

    Every caption of every image is a row of ``tokens``; ``text_ids`` repeats each image's id (its
    dataset index) once per caption, so that the loss pairs each caption with its image, on any rank.

    Shape:
        - output: ``(n, 3, S, S)`` float32, ``(m, context_length)`` int64, ``(n,)`` int64, ``(m,)`` int64.

    Example:
        >>> import torch
        >>> items = [(torch.zeros(3, 4, 4, dtype=torch.uint8), ["a red circle", "a circle"], 7),
        ...          (torch.zeros(3, 4, 4, dtype=torch.uint8), ["a blue square"], 9)]
        >>> images, tokens, image_ids, text_ids = CaptionsCollate(16)(items)
        >>> tuple(images.shape), tuple(tokens.shape), image_ids.tolist(), text_ids.tolist()
        ((2, 3, 4, 4), (3, 16), [7, 9], [7, 7, 9])
    """

    def __init__(self, context_length: int) -> None:
        self.tokenize = ByteTokenizer(context_length)

    def __call__(self, items: list[tuple[Any, list[str], int]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Collate a list of items (a rank's non-empty share of a step)."""
        captions = [text for item in items for text in item[1]]
        image_ids = torch.tensor([item[2] for item in items], dtype=torch.long)
        counts = torch.tensor([len(item[1]) for item in items])
        return (normalize(torch.stack([item[0] for item in items])), self.tokenize(captions), image_ids,
                image_ids.repeat_interleave(counts))  # fmt: skip
