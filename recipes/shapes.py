"""An offline, generated image-caption dataset: coloured shapes with captions that name them.

Every image is rendered from its attributes — shape, colour, size, position — and a seed, so the
same ``(seed, split, index)`` always gives the same image on every rank and every run; nothing
is downloaded. The caption names all four attributes ("a small red circle in the top left"),
so an image is matched by exactly one caption of the held-out split, whose samples all have
distinct captions (retrieval is then exact, with chance 1/N).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor
from torch.utils.data import Dataset

SHAPES = ("circle", "square", "triangle", "cross", "ring")
COLOURS = {
    "red": (0.90, 0.15, 0.15),
    "green": (0.15, 0.80, 0.20),
    "blue": (0.20, 0.35, 0.95),
    "yellow": (0.95, 0.90, 0.15),
    "purple": (0.65, 0.20, 0.85),
    "cyan": (0.15, 0.85, 0.90),
}
SIZES = {"small": 0.11, "large": 0.19}  # radius as a fraction of the image side
POSITIONS = {
    "top left": (0, 0), "top middle": (0, 1), "top right": (0, 2),
    "middle left": (1, 0), "center": (1, 1), "middle right": (1, 2),
    "bottom left": (2, 0), "bottom middle": (2, 1), "bottom right": (2, 2),
}  # fmt: skip
COMBINATIONS = len(SHAPES) * len(COLOURS) * len(SIZES) * len(POSITIONS)


def caption(shape: int, colour: int, size: int, position: int) -> str:
    """The caption of one attribute combination."""
    return (
        f"a {list(SIZES)[size]} {list(COLOURS)[colour]} {SHAPES[shape]} in the {list(POSITIONS)[position]}"
    )


def render(
    attributes: Tensor, image_size: int, generator: torch.Generator, *, background_noise: float = 0.04,
    tint_spread: float = 0.2,
) -> Tensor:
    """Render ``(n, 4)`` attribute rows (shape, colour, size, position) as uint8 images ``(n, 3, S, S)``.

    The background is a per-image tint, uniform in ``[0.2 - tint_spread / 2, 0.2 + tint_spread / 2]``
    per channel, plus Gaussian pixel noise of standard deviation ``background_noise``; both 0 give a
    plain grey background. The same random numbers are drawn whatever the two values, so only the
    background changes with them.
    """
    n = attributes.shape[0]
    shape, colour, size, position = attributes.unbind(1)
    grid = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size
    y, x = grid.view(1, -1, 1), grid.view(1, 1, -1)
    cells = torch.tensor(list(POSITIONS.values()), dtype=torch.float32)[position]
    jitter = (torch.rand(n, 2, generator=generator) - 0.5) * 0.06
    centre = 0.22 + 0.28 * cells + jitter  # cell centres at 0.22, 0.5, 0.78: large shapes stay inside
    radius = torch.tensor(list(SIZES.values()))[size] * (0.9 + 0.2 * torch.rand(n, generator=generator))
    cy, cx, r = centre[:, 0].view(-1, 1, 1), centre[:, 1].view(-1, 1, 1), radius.view(-1, 1, 1)
    dy, dx = (y - cy) / r, (x - cx) / r
    masks = torch.stack(
        [
            dx**2 + dy**2 <= 1,
            (dx.abs() <= 0.85) & (dy.abs() <= 0.85),
            (dy <= 0.8) & (dy >= -1) & (dx.abs() <= (dy + 1) / 1.8 * 1.0),
            ((dx.abs() <= 0.3) & (dy.abs() <= 1)) | ((dy.abs() <= 0.3) & (dx.abs() <= 1)),
            (dx**2 + dy**2 <= 1) & (dx**2 + dy**2 >= 0.3),
        ]
    )  # (shape kind, n, S, S)
    mask = masks[shape, torch.arange(n)].unsqueeze(1)
    rgb = torch.tensor(list(COLOURS.values()))[colour]
    rgb = (rgb + (torch.rand(n, 3, generator=generator) - 0.5) * 0.15).clamp(0, 1).view(n, 3, 1, 1)
    # A dim, low-contrast background with a little noise, so the shape is the only strong signal.
    tint = (0.2 - tint_spread / 2) + tint_spread * torch.rand(n, 3, 1, 1, generator=generator)
    background = tint + background_noise * torch.randn(n, 3, image_size, image_size, generator=generator)
    image = torch.where(mask, rgb, background)
    return (image.clamp(0, 1) * 255).round().to(torch.uint8)


class ShapesDataset(Dataset):
    """Generated images of coloured shapes with their captions and labels.

    Args:
        split: ``"train"`` (attributes drawn at random) or ``"val"`` (held-out renderings of
            distinct attribute combinations, so every held-out caption is unique).
        size: number of samples (``"val"``: at most :data:`COMBINATIONS`).
        image_size: image side in pixels.
        seed: the dataset seed; the same seed gives the same data everywhere.
        background_noise: standard deviation of the background's pixel noise (see :func:`render`).
        tint_spread: range of the background's per-image tint (see :func:`render`).

    Items are ``(image uint8 (3, S, S), caption str, label int, index int)``; the label is the shape.
    """

    def __init__(self, split: str, *, size: int, image_size: int = 32, seed: int = 0,
                 background_noise: float = 0.04, tint_spread: float = 0.2) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if split == "val" and not 0 < size <= COMBINATIONS:
            raise ValueError(
                f"the held-out split has distinct captions: size must be in [1, {COMBINATIONS}], got {size}"
            )
        if size < 1 or image_size < 8:
            raise ValueError(f"expected size >= 1 and image_size >= 8, got {size} and {image_size}")
        if not (0 <= background_noise and 0 <= tint_spread <= 0.4):
            raise ValueError(f"expected background_noise >= 0 and tint_spread in [0, 0.4], "
                             f"got {background_noise} and {tint_spread}")
        generator = torch.Generator().manual_seed(seed * 2 + (split == "val"))
        ranges = (len(SHAPES), len(COLOURS), len(SIZES), len(POSITIONS))
        if split == "val":
            every = torch.tensor(list(itertools.product(*(range(k) for k in ranges))))
            attributes = every[torch.randperm(len(every), generator=generator)[:size]]
        else:
            attributes = torch.stack([torch.randint(k, (size,), generator=generator) for k in ranges], dim=1)
        # Rendered once, in chunks to bound memory; every rank renders the same images.
        self.images = torch.cat([
            render(chunk, image_size, generator, background_noise=background_noise, tint_spread=tint_spread)
            for chunk in attributes.split(1024)
        ])
        self.attributes = attributes
        self.captions = [caption(*row) for row in attributes.tolist()]
        self.labels = attributes[:, 0].tolist()

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, index: int) -> tuple[Tensor, str, int, int]:
        return self.images[index], self.captions[index], self.labels[index], index


def chance_recall(k: int, n: int) -> float:
    """Chance level of recall@k when one of ``n`` candidates is right."""
    return min(k, n) / n if n else math.nan
