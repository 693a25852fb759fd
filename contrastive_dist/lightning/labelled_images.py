"""Labelled images for a k-NN probe: a training set, a labelled bank and held-out queries.

* :class:`LabelledImages` gives ``(uint8 image, label)`` from the generated shapes, an ImageFolder,
  CIFAR-10 or any dataset of ``(image, ..., label, ...)`` items, on a subset of its indices.
* :func:`shapes_splits`, :func:`cifar10_splits` and :func:`image_folder_splits` cut a dataset into
  :class:`LabelledSplits`: what to train on, the bank whose labels vote, the queries to classify.

torchvision is needed (for a PIL image's resize, and for CIFAR-10 and ImageFolder).

Example:
    >>> train, bank, queries, classes = shapes_splits(train_size=8, val_size=4, bank_size=6, image_size=16)
    >>> image, label = queries[0]
    >>> len(train), len(bank), len(queries), classes, tuple(image.shape), 0 <= label < classes
    (8, 6, 4, 5, (3, 16, 16), True)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import Dataset

from contrastive_dist.shapes import SHAPES, ShapesDataset

__all__ = ["LabelledImages", "LabelledSplits", "cifar10_splits", "image_folder_splits", "shapes_splits"]


class LabelledImages(Dataset):
    """``(uint8 image (3, S, S), label)`` from the items of ``source``, restricted to ``indices``.

    Args:
        source: a dataset whose items hold an image in field 0 (a uint8 tensor, used as it is; or a
            PIL image, resized and centre-cropped to ``image_size``) and an int label.
        indices: the items of ``source`` this dataset has, in its order.
        image_size: the side ``S`` of a PIL image's crop.
        label_field: where the label is in an item: 1 for torchvision's ``(image, label)``, 2 for
            :class:`~contrastive_dist.shapes.ShapesDataset` (its label: the shape).

    Example:
        >>> from contrastive_dist.shapes import ShapesDataset
        >>> images = LabelledImages(ShapesDataset("val", size=6, image_size=8), [5, 0], 8, label_field=2)
        >>> image, label = images[0]
        >>> len(images), tuple(image.shape), 0 <= label < 5
        (2, (3, 8, 8), True)
    """

    def __init__(self, source: Any, indices: Sequence[int], image_size: int, *, label_field: int = 1) -> None:
        from torchvision.transforms import v2

        self.source, self.indices, self.label_field = source, list(indices), label_field
        self.to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.uint8, scale=True),
                                     v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        item = self.source[self.indices[index]]
        image = item[0] if isinstance(item[0], Tensor) else self.to_tensor(item[0])
        return image, int(item[self.label_field])


class LabelledSplits(NamedTuple):
    """A dataset cut for a k-NN probe: ``(train, bank, queries, classes)``."""

    train: LabelledImages  #: the images to train on (their labels unused)
    bank: LabelledImages  #: labelled training images whose features vote
    queries: LabelledImages  #: held-out images whose labels the vote must find
    classes: int  #: the number of labels


def shapes_splits(*, train_size: int, val_size: int, bank_size: int, image_size: int, seed: int = 0,
                  background_noise: float = 0.0, tint_spread: float = 0.0) -> LabelledSplits:
    """The generated shapes, labelled by their shape (5 classes); the bank is the first training images.

    A plain background by default: a per-image tint or noise pattern, shared by an image's two
    views, would let a contrastive loss tell images apart without looking at the shape.

    Args:
        train_size: generated training images.
        val_size: generated held-out queries (the ``"val"`` split).
        bank_size: the bank's images, the first of the training set (at most ``train_size``).
        image_size: the images' side.
        seed: the generator's seed.
        background_noise: the background's pixel noise (std).
        tint_spread: the range of the per-image background tint.

    Example:
        >>> splits = shapes_splits(train_size=4, val_size=2, bank_size=10, image_size=8)
        >>> len(splits.bank), splits.classes
        (4, 5)
    """
    background = {"background_noise": background_noise, "tint_spread": tint_spread}
    train = ShapesDataset("train", size=train_size, image_size=image_size, seed=seed, **background)
    held_out = ShapesDataset("val", size=val_size, image_size=image_size, seed=seed, **background)
    shapes = {"image_size": image_size, "label_field": 2}  # a ShapesDataset item's label: its shape
    return LabelledSplits(LabelledImages(train, range(train_size), **shapes),
                          LabelledImages(train, range(min(bank_size, train_size)), **shapes),
                          LabelledImages(held_out, range(val_size), **shapes), len(SHAPES))


def cifar10_splits(root: str, *, val_size: int, bank_size: int, image_size: int = 32, seed: int = 0,
                   download: bool = False) -> LabelledSplits:
    """CIFAR-10: train on its training set; a seeded random bank of it; the first test images as queries.

    Args:
        root: the torchvision dataset folder.
        val_size: queries, the first of the test set (at most its 10 000).
        bank_size: the bank's images, drawn without replacement from the training set.
        image_size: the images' side (CIFAR-10's are 32).
        seed: the bank's draw.
        download: let torchvision download the dataset into ``root``.

    Raises:
        RuntimeError: (torchvision) the dataset is not in ``root`` and ``download`` is off.

    Example:
        >>> cifar10_splits("/nowhere", val_size=10, bank_size=100)
        Traceback (most recent call last):
        RuntimeError: Dataset not found or corrupted. You can use download=True to download it
    """
    import torchvision

    train = torchvision.datasets.CIFAR10(root, train=True, download=download)
    test = torchvision.datasets.CIFAR10(root, train=False, download=download)
    bank = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:bank_size]
    return LabelledSplits(LabelledImages(train, range(len(train)), image_size),
                          LabelledImages(train, bank.tolist(), image_size),
                          LabelledImages(test, range(min(val_size, len(test))), image_size), 10)


def image_folder_splits(path: str, *, val_size: int, bank_size: int, image_size: int,
                        seed: int = 0) -> LabelledSplits:
    """An ImageFolder (one folder per class), shuffled by ``seed``: the last ``val_size`` images are the queries.

    Args:
        path: the folder of class folders.
        val_size: held-out queries.
        bank_size: the bank's images, the first of the (shuffled) training images.
        image_size: the side of the images' centre crop.
        seed: the shuffle's seed.

    Raises:
        ValueError: the folder has no more than ``val_size`` images.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from PIL import Image
        >>> root = Path(tempfile.mkdtemp())
        >>> for name in ("cat", "dog"):
        ...     (root / name).mkdir()
        ...     for i in range(3):
        ...         Image.new("RGB", (20, 10)).save(root / name / f"{i}.png")
        >>> splits = image_folder_splits(str(root), val_size=2, bank_size=3, image_size=8)
        >>> len(splits.train), len(splits.bank), len(splits.queries), splits.classes, tuple(splits.bank[0][0].shape)
        (4, 3, 2, 2, (3, 8, 8))
    """
    import torchvision

    folder = torchvision.datasets.ImageFolder(Path(path).expanduser())
    order = torch.randperm(len(folder), generator=torch.Generator().manual_seed(seed)).tolist()
    if len(order) <= val_size:
        raise ValueError(f"{path} has {len(order)} images; need more than --val-size={val_size}: "
                         "add images or lower --val-size")
    train, queries = order[:-val_size], order[-val_size:]
    return LabelledSplits(LabelledImages(folder, train, image_size),
                          LabelledImages(folder, train[:bank_size], image_size),
                          LabelledImages(folder, queries, image_size), len(folder.classes))
