"""Held-out image–text retrieval counted by id, its value by chance, and a grid of retrieved captions.

With repeated captions (or a label per pair), plain recall calls a retrieved copy of the right
caption a miss. :func:`recall_by_id` counts a query as right when its best answer *with its own id*
is beaten by fewer than ``k`` answers with another id; with distinct ids it is ordinary recall.

Example:
    >>> import torch
    >>> image = torch.eye(3)
    >>> text = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> ids = torch.tensor([7, 7, 9])   # pairs 0 and 1 share a caption
    >>> {key: round(float(value), 3) for key, value in recall_by_id(image, text, ids, top_k=(1,)).items()}
    {'image_to_text_r1': 1.0, 'text_to_image_r1': 1.0}
    >>> {key: round(value, 3) for key, value in recall_by_chance(ids, (1,)).items()}
    {'image_to_text_r1': 0.556, 'text_to_image_r1': 0.556}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["recall_by_chance", "recall_by_id", "retrieval_grid"]


def recall_by_id(image: Tensor, text: Tensor, ids: Tensor, *, top_k: Sequence[int]) -> dict[str, Tensor]:
    """Recall@k of each image among the texts and of each text among the images, counted by id.

    A query is a hit at ``k`` when fewer than ``k`` answers *with another id* score strictly
    higher than its best answer with its own id: an image that finds any copy of its caption is
    right, and so is a text that finds any image it captions; no run is rewarded or penalised for
    how it orders answers of one id. With distinct ids this is
    :func:`contrastive_dist.retrieval_accuracy` (ties count for the query there too).

    Shape:
        image, text: ``(N, D)``, row ``i`` a pair; ids: ``(N,)`` int64.
    """
    same = ids[:, None] == ids[None, :]
    recall = {}
    for name, scores in (("image_to_text", image @ text.T), ("text_to_image", text @ image.T)):
        best_right = scores.masked_fill(~same, -math.inf).amax(dim=1, keepdim=True)
        wrong_above = (scores.masked_fill(same, -math.inf) > best_right).sum(dim=1)
        recall.update({f"{name}_r{k}": (wrong_above < k).to(scores.dtype).mean() for k in top_k})
    return recall


def recall_by_chance(ids: Tensor, top_k: Sequence[int]) -> dict[str, float]:
    """:func:`recall_by_id` of a random order, in both directions.

    A query with ``m`` right answers among ``N`` misses at ``k`` with probability ``C(N - m, k) / C(N, k)``.
    """
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    n, right = len(ids), counts[inverse].tolist()
    return {f"{direction}_r{k}": sum(1 - math.comb(n - m, k) / math.comb(n, k) for m in right) / n
            for direction in ("image_to_text", "text_to_image") for k in top_k}


def retrieval_grid(images: Tensor, captions: Sequence[str], scores: Tensor, ids: Tensor, path: Path, *,
                   panels: int = 8) -> None:
    """Images with their top-3 retrieved captions, right ones (same id) marked, the true one shown if missed.

    Shape:
        images: ``(N, 3, H, W)`` uint8; scores: ``(N, N)`` image × text similarities; ids: ``(N,)``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels, top = min(panels, len(captions)), min(3, len(captions))
    retrieved = scores[:panels].topk(top, dim=1).indices.tolist()
    columns = min(panels, 4)
    rows = -(-panels // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(max(3.3 * columns, 8), 3.6 * rows + 0.7), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for i, axis in enumerate(axes.flat[:panels]):
        axis.imshow(images[i].permute(1, 2, 0).numpy(), interpolation="nearest")
        right = [bool(ids[j] == ids[i]) for j in retrieved[i]]  # any answer with the query's id counts
        lines = [(f"{'✓' if hit else '✗'} {k + 1}. {captions[j][:42]}", "green" if hit else "dimgray")
                 for k, (j, hit) in enumerate(zip(retrieved[i], right))]
        if not any(right):
            lines.append((f"true: {captions[i][:42]}", "crimson"))
        for row, (line, colour) in enumerate(lines):
            axis.text(0.0, -0.05 - 0.1 * row, line, transform=axis.transAxes, va="top", fontsize=7, color=colour)
    figure.suptitle(f"held-out images and their top-{top} retrieved captions\n✓ green: a right caption (same id)   "
                    "✗ grey: a wrong one   red 'true:': the right caption, when it is not among them", fontsize=9)
    figure.subplots_adjust(left=0.02, right=0.98, top=0.86, bottom=0.12, hspace=0.75, wspace=0.15)
    figure.savefig(path, dpi=110, bbox_inches="tight")  # the caption lines sit below the axes
    plt.close(figure)
