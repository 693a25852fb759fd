"""Generated image–caption data that needs no download: coloured shapes whose captions name them.

A shape (circle, square, triangle, cross, ring) of one of 6 colours, 2 sizes and 9 positions is
drawn on a tinted, noisy background; its caption names all four ("a small red circle in the top
left"). The recipes train on it, so a loss or a model can be tried in minutes on a CPU; the images
are rendered once, from the seed, and are the same in every process.

Example:
    >>> from contrastive_dist.shapes import ShapesDataset
    >>> data = ShapesDataset("val", size=4, image_size=16)
    >>> image, text, label, index = data[0]
    >>> tuple(image.shape), image.dtype, len(data), index
    ((3, 16, 16), torch.uint8, 4, 0)
    >>> text.startswith("a ") and " in the " in text
    True
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "ShapesDataset", "caption", "kind_caption", "normalize", "render",
]

SHAPES = ("circle", "square", "triangle", "cross", "ring")
COLOURS = {"red": (0.90, 0.15, 0.15), "green": (0.15, 0.80, 0.20), "blue": (0.20, 0.35, 0.95),
           "yellow": (0.95, 0.90, 0.15), "purple": (0.65, 0.20, 0.85), "cyan": (0.15, 0.85, 0.90)}
SIZES = {"small": 0.11, "large": 0.19}  # radius as a fraction of the image side
POSITIONS = {"top left": (0, 0), "top middle": (0, 1), "top right": (0, 2), "middle left": (1, 0), "center": (1, 1),
             "middle right": (1, 2), "bottom left": (2, 0), "bottom middle": (2, 1), "bottom right": (2, 2)}
COMBINATIONS = len(SHAPES) * len(COLOURS) * len(SIZES) * len(POSITIONS)
KINDS = len(SHAPES) * len(COLOURS)  # colour-shape kinds: what a coarse caption names
MEAN, STD = 0.5, 0.25  # uint8 images become (x / 255 - MEAN) / STD


def caption(shape: int, colour: int, size: int, position: int) -> str:
    """The full caption of one attribute row: "a small red circle in the top left"."""
    return f"a {list(SIZES)[size]} {list(COLOURS)[colour]} {SHAPES[shape]} in the {list(POSITIONS)[position]}"


def kind_caption(shape: int, colour: int, form: int) -> str:
    """The coarse caption of a kind, in one of 4 forms: ``form`` bit 0 capitalises, bit 1 adds a full stop."""
    text = f"a {list(COLOURS)[colour]} {SHAPES[shape]}"
    return (text.capitalize() if form & 1 else text) + ("." if form & 2 else "")


def render(attributes: Tensor, image_size: int, generator: torch.Generator, *, background_noise: float = 0.04,
           tint_spread: float = 0.2) -> Tensor:
    """``(n, 4)`` attribute rows (shape, colour, size, position) → uint8 images ``(n, 3, S, S)``.

    The background is a per-image tint, uniform in ``0.2 ± tint_spread / 2`` per channel, plus
    Gaussian pixel noise of std ``background_noise``; both 0 give plain grey. The same random numbers
    are drawn whatever the two values, so only the background changes with them.
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
    masks = torch.stack([  # (shape kind, n, S, S)
        dx**2 + dy**2 <= 1,
        (dx.abs() <= 0.85) & (dy.abs() <= 0.85),
        (dy <= 0.8) & (dy >= -1) & (dx.abs() <= (dy + 1) / 1.8),
        ((dx.abs() <= 0.3) & (dy.abs() <= 1)) | ((dy.abs() <= 0.3) & (dx.abs() <= 1)),
        (dx**2 + dy**2 <= 1) & (dx**2 + dy**2 >= 0.3),
    ])
    mask = masks[shape, torch.arange(n)].unsqueeze(1)
    rgb = torch.tensor(list(COLOURS.values()))[colour]
    rgb = (rgb + (torch.rand(n, 3, generator=generator) - 0.5) * 0.15).clamp(0, 1).view(n, 3, 1, 1)
    tint = (0.2 - tint_spread / 2) + tint_spread * torch.rand(n, 3, 1, 1, generator=generator)
    background = tint + background_noise * torch.randn(n, 3, image_size, image_size, generator=generator)
    return (torch.where(mask, rgb, background).clamp(0, 1) * 255).round().to(torch.uint8)


class ShapesDataset(Dataset):
    """Items ``(image uint8 (3, S, S), caption, label = the shape, index)``, the same on every rank and run.

    ``"train"`` draws attributes at random; ``"val"`` renders distinct combinations (at most
    :data:`COMBINATIONS`), so every held-out caption is unique and retrieval has chance ``1/N``
    (unless ``duplicate_captions``).

    ``duplicate_captions=F`` makes captions repeat as on the web, where one alt-text ("a photo of a
    dog") covers many images: a fraction ``F`` of the :data:`KINDS` colour-shape kinds, the same in
    both splits, is captioned by its kind alone, written in one of the 4 forms of :func:`kind_caption`
    ("a red circle", "A red circle."); size and position go unnamed. Images do not change with ``F``.
    """

    def __init__(self, split: str, *, size: int, image_size: int = 32, seed: int = 0,
                 background_noise: float = 0.04, tint_spread: float = 0.2, duplicate_captions: float = 0.0) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if split == "val" and not 0 < size <= COMBINATIONS:
            raise ValueError(f"the held-out split has distinct combinations: size must be in [1, {COMBINATIONS}], "
                             f"got {size}")
        if size < 1 or image_size < 8:
            raise ValueError(f"expected size >= 1 and image_size >= 8, got {size} and {image_size}")
        if not (0 <= background_noise and 0 <= tint_spread <= 0.4):
            raise ValueError(f"expected background_noise >= 0 and tint_spread in [0, 0.4], "
                             f"got {background_noise} and {tint_spread}")
        if not 0 <= duplicate_captions <= 1:
            raise ValueError(f"duplicate_captions is a fraction of the colour-shape kinds, in [0, 1]; "
                             f"got {duplicate_captions}")
        generator = torch.Generator().manual_seed(seed * 2 + (split == "val"))
        ranges = (len(SHAPES), len(COLOURS), len(SIZES), len(POSITIONS))
        if split == "val":
            every = torch.tensor(list(itertools.product(*(range(k) for k in ranges))))
            attributes = every[torch.randperm(len(every), generator=generator)[:size]]
        else:
            attributes = torch.stack([torch.randint(k, (size,), generator=generator) for k in ranges], dim=1)
        # Rendered once, in chunks to bound memory.
        self.images = torch.cat([render(chunk, image_size, generator, background_noise=background_noise,
                                        tint_spread=tint_spread) for chunk in attributes.split(1024)])
        self.captions = [caption(*row) for row in attributes.tolist()]
        self.labels = attributes[:, 0].tolist()
        # Drawn after the images, so they stay the same; the kinds from the seed alone: the same in both splits.
        forms = torch.randint(4, (size,), generator=generator).tolist()
        kinds = torch.randperm(KINDS, generator=torch.Generator().manual_seed(seed))
        kinds = kinds[: round(duplicate_captions * KINDS)]
        coarse = torch.isin(attributes[:, 0] * len(COLOURS) + attributes[:, 1], kinds)
        for index in coarse.nonzero().flatten().tolist():
            shape, colour = attributes[index, :2].tolist()
            self.captions[index] = kind_caption(shape, colour, forms[index])

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, index: int) -> tuple[Tensor, str, int, int]:
        return self.images[index], self.captions[index], self.labels[index], index


def normalize(images: Tensor) -> Tensor:
    """uint8 images → float ``(x / 255 - MEAN) / STD``, the input the recipes' image towers take.

    Shape:
        images: any shape; the result has the same shape, dtype float32.
    """
    return images.float().div(255).sub(MEAN).div(STD)
