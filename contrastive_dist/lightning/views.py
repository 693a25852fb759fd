"""Images for self-supervised training: SimCLR's two augmented views of each image, and a collate.

* :func:`simclr_augment` is SimCLR's view distribution on uint8 tensors (torchvision ``transforms.v2``).
* :class:`TwoViews` turns ``(uint8 image, label)`` items (a
  :class:`~contrastive_dist.lightning.labelled_images.LabelledImages`, say) into SimCLR's training
  items ``(view, view, index)``.
* :func:`image_collate` batches such items, images normalised, field by field.

torchvision is needed.

Example:
    >>> import torch
    >>> images = [(torch.randint(256, (3, 20, 20), dtype=torch.uint8), label) for label in range(4)]
    >>> views = TwoViews(images, simclr_augment(16))
    >>> first, second, index = image_collate([views[0], views[3]])
    >>> tuple(first.shape), first.dtype, index.tolist()
    ((2, 3, 16, 16), torch.float32, [0, 3])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from contrastive_dist.shapes import normalize

__all__ = ["TwoViews", "image_collate", "simclr_augment"]


def simclr_augment(image_size: int, *, min_crop: float = 0.08, hue: float = 0.1) -> Any:
    """SimCLR's view distribution on uint8 ``(3, H, W)`` tensors → ``(3, image_size, image_size)``.

    Random resized crop (scale ``min_crop`` to 1), horizontal flip, colour jitter (p 0.8), grayscale
    (p 0.2) and Gaussian blur (p 0.5), as in SimCLR for small images. ``hue=0.5`` (any hue) stops
    colour telling images apart, when colour is not what the features should encode.

    Example:
        >>> import torch
        >>> augment = simclr_augment(8, min_crop=0.5, hue=0.5)
        >>> view = augment(torch.zeros(3, 16, 16, dtype=torch.uint8))
        >>> tuple(view.shape), view.dtype
        ((3, 8, 8), torch.uint8)
    """
    from torchvision.transforms import v2

    return v2.Compose([
        v2.RandomResizedCrop(image_size, scale=(min_crop, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, hue)], p=0.8),
        v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(3, sigma=(0.1, 2.0))], p=0.5),
    ])


class TwoViews(Dataset):
    """Training items ``(view, view, index)`` of ``(image, label)`` items; ``augment=None``: two identical views.

    Each view is an independent draw of ``augment`` (from torch's global random state, which
    Lightning's ``seed_everything(..., workers=True)`` seeds in every DataLoader worker).

    Example:
        >>> import torch
        >>> first, second, index = TwoViews([(torch.ones(3, 4, 4), 0)], None)[0]
        >>> torch.equal(first, second), index
        (True, 0)
    """

    def __init__(self, images: Dataset, augment: Any | None) -> None:
        self.images, self.augment = images, augment

    def __len__(self) -> int:
        return len(self.images)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        image, _ = self.images[index]
        if self.augment is None:
            return image, image, index
        return self.augment(image), self.augment(image), index


def image_collate(items: list[tuple[Any, ...]]) -> tuple[Tensor, ...]:
    """Field by field: uint8 images → normalised float batches, ints → int64 tensors; picklable for workers.

    Shape:
        - each image field: ``(n, 3, S, S)`` float32 (:func:`contrastive_dist.shapes.normalize`);
          each int field: ``(n,)`` int64.

    Example:
        >>> import torch
        >>> images, labels = image_collate([(torch.zeros(3, 2, 2, dtype=torch.uint8), 4)] * 3)
        >>> tuple(images.shape), labels.tolist()
        ((3, 3, 2, 2), [4, 4, 4])
    """
    return tuple(normalize(torch.stack(field)) if isinstance(field[0], Tensor) else torch.tensor(field)
                 for field in zip(*items))
