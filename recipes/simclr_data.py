"""SimCLR recipe data: two augmented views per image for training, a labelled k-NN bank and queries for evaluation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from shapes import SHAPES, ShapesDataset
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms import v2

MEAN, STD = 0.5, 0.25


def simclr_augment(image_size: int, *, min_scale: float, hue: float) -> v2.Transform:
    """SimCLR's view distribution on uint8 tensors: crop, flip, colour jitter, grayscale, blur.

    ``hue`` (at most 0.5: any hue) decides whether colour may tell two images apart.
    """
    return v2.Compose([
        v2.RandomResizedCrop(image_size, scale=(min_scale, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, hue)], p=0.8),
        v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(3, sigma=(0.1, 2.0))], p=0.5),
    ])


class Images(Dataset):
    """``(uint8 image (3, S, S), label)`` pairs from shapes, an ImageFolder or CIFAR-10, restricted to ``indices``."""

    def __init__(self, source: Any, indices: Sequence[int], image_size: int) -> None:
        self.source, self.indices = source, list(indices)
        self.to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.uint8, scale=True),
                                     v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])

    def __len__(self) -> int:
        return len(self.indices)

    def image(self, index: int) -> tuple[Tensor, int]:
        item = self.source[self.indices[index]]
        image = item[0] if isinstance(item[0], Tensor) else self.to_tensor(item[0])
        return image, int(item[2] if isinstance(self.source, ShapesDataset) else item[1])

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.image(index)


class TwoViews(Dataset):
    """Training items ``(view, view, index)``; ``augment=None`` gives two identical views."""

    def __init__(self, images: Images, augment: v2.Transform | None) -> None:
        self.images, self.augment = images, augment

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        image, _ = self.images.image(index)
        if self.augment is None:
            return image, image, index
        return self.augment(image), self.augment(image), index


class KnnSplit(Dataset):
    """Evaluation items ``(image, label, is_query, index)``: the labelled bank first, then the queries."""

    def __init__(self, bank: Images, queries: Images) -> None:
        self.bank, self.queries = bank, queries

    def __len__(self) -> int:
        return len(self.bank) + len(self.queries)

    def __getitem__(self, index: int) -> tuple[Tensor, int, int, int]:
        is_query = index >= len(self.bank)
        image, label = (self.queries.image(index - len(self.bank)) if is_query else self.bank.image(index))
        return image, label, int(is_query), index


def normalize(images: Tensor) -> Tensor:
    return images.float().div(255).sub(MEAN).div(STD)


def build(spec: str, *, image_size: int, train_size: int, val_size: int, bank_size: int, seed: int,
          download: bool, background_noise: float = 0.0, tint_spread: float = 0.0,
          ) -> tuple[Images, Images, Images, int]:
    """``(train, bank, queries, classes)`` for ``shapes``, ``imagefolder:PATH`` or ``cifar10:ROOT``.

    For ``shapes``, ``background_noise`` and ``tint_spread`` set the background (see
    ``shapes.render``). The default plain background leaves the shape, its colour, size and
    position as the only content of an image: a per-image background tint or noise pattern,
    shared by the two views of an image, would let the loss tell images apart without the shape.
    """
    if spec == "shapes":
        background = {"background_noise": background_noise, "tint_spread": tint_spread}
        train_source = ShapesDataset("train", size=train_size, image_size=image_size, seed=seed, **background)
        held_out = ShapesDataset("val", size=val_size, image_size=image_size, seed=seed, **background)
        return (Images(train_source, range(train_size), image_size),
                Images(train_source, range(min(bank_size, train_size)), image_size),
                Images(held_out, range(val_size), image_size), len(SHAPES))
    kind, _, location = spec.partition(":")
    import torchvision

    if kind == "cifar10":
        train_set = torchvision.datasets.CIFAR10(location, train=True, download=download)
        test_set = torchvision.datasets.CIFAR10(location, train=False, download=download)
        generator = torch.Generator().manual_seed(seed)
        bank = torch.randperm(len(train_set), generator=generator)[:bank_size].tolist()
        return (Images(train_set, range(len(train_set)), image_size), Images(train_set, bank, image_size),
                Images(test_set, range(min(val_size, len(test_set))), image_size), 10)
    if kind == "imagefolder":
        folder = torchvision.datasets.ImageFolder(Path(location))
        order = torch.randperm(len(folder), generator=torch.Generator().manual_seed(seed)).tolist()
        if len(order) <= val_size:
            raise ValueError(f"{location} has {len(order)} images; need more than --val-size={val_size}")
        train_ids, query_ids = order[:-val_size], order[-val_size:]
        return (Images(folder, train_ids, image_size), Images(folder, train_ids[:bank_size], image_size),
                Images(folder, query_ids, image_size), len(folder.classes))
    raise ValueError(f"--data must be 'shapes', 'imagefolder:PATH' or 'cifar10:ROOT', got {spec!r}")
