"""CLIP recipe data: the generated shapes, or image-caption pairs listed in a CSV file."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch
from models import ByteTokenizer
from shapes import ShapesDataset
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

MEAN, STD = 0.5, 0.25  # images are scaled as (x / 255 - MEAN) / STD


class CaptionCollate:
    """Batch ``(image uint8, caption, ..., index)`` items into ``(images float, tokens, indices)``; picklable."""

    def __init__(self, *, context_length: int) -> None:
        self.tokenizer = ByteTokenizer(context_length=context_length)

    def __call__(self, items: list[tuple[Any, ...]]) -> tuple[Tensor, Tensor, Tensor]:
        images = torch.stack([item[0] for item in items]).float().div(255).sub(MEAN).div(STD)
        tokens = self.tokenizer([item[1] for item in items])
        indices = torch.tensor([item[-1] for item in items], dtype=torch.long)
        return images, tokens, indices


class CsvCaptions(Dataset):
    """Image-caption pairs from a CSV/TSV file (open_clip's layout: ``filepath`` and ``title`` columns).

    Relative image paths are read relative to the CSV file's folder. Images are decoded with PIL
    and transformed with torchvision ``transforms.v2`` into uint8 ``(3, S, S)`` tensors.
    """

    def __init__(self, rows: list[tuple[str, str]], root: Path, transform: v2.Transform) -> None:
        self.rows, self.root, self.transform = rows, root, transform

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Tensor, str, int]:
        from PIL import Image

        path, text = self.rows[index]
        with Image.open(self.root / path) as image:
            pixels = self.transform(image.convert("RGB"))
        return pixels, text, index


def read_csv(path: Path, *, image_column: str, caption_column: str, separator: str | None) -> list[tuple[str, str]]:
    """``(image path, caption)`` rows; the separator (tab or comma) is detected from the header if not given."""
    with open(path, newline="") as file:
        header = file.readline()
        file.seek(0)
        delimiter = separator or ("\t" if "\t" in header else ",")
        reader = csv.DictReader(file, delimiter=delimiter)
        fields = reader.fieldnames or []
        if image_column not in fields or caption_column not in fields:
            raise ValueError(f"{path}: expected columns {image_column!r} and {caption_column!r}, found {fields}")
        return [(row[image_column], row[caption_column]) for row in reader]


def build_datasets(spec: str, *, image_size: int, train_size: int, val_size: int, seed: int,
                   image_column: str, caption_column: str, separator: str | None,
                   deterministic: bool = False) -> tuple[Dataset, Dataset]:
    """``"shapes"`` (default, generated, never augmented) or ``"csv:PATH"``; held out: the last ``val_size`` rows."""
    if spec == "shapes":
        return (ShapesDataset("train", size=train_size, image_size=image_size, seed=seed),
                ShapesDataset("val", size=val_size, image_size=image_size, seed=seed))
    if not spec.startswith("csv:"):
        raise ValueError(f"--data must be 'shapes' or 'csv:PATH', got {spec!r}")
    path = Path(spec[len("csv:"):])
    rows = read_csv(path, image_column=image_column, caption_column=caption_column, separator=separator)
    if len(rows) <= val_size:
        raise ValueError(f"{path} has {len(rows)} rows; need more than --val-size={val_size}")
    as_uint8 = [v2.ToImage(), v2.ToDtype(torch.uint8, scale=True)]
    train = v2.Compose([v2.RandomResizedCrop(image_size, scale=(0.7, 1.0), antialias=True), *as_uint8])
    held_out = v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size), *as_uint8])
    train = held_out if deterministic else train
    return CsvCaptions(rows[:-val_size], path.parent, train), CsvCaptions(rows[-val_size:], path.parent, held_out)
