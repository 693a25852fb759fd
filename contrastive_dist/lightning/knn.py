"""k-NN evaluation of self-supervised features: a labelled bank and held-out queries in one split.

:class:`KnnSplit` puts the bank's images and the queries' in one dataset, so one distributed
validation loader encodes both; :func:`split_knn_accuracy` gathers every rank's share and scores
it with :func:`knn_accuracy` (a similarity-weighted vote, as in instance-discrimination papers),
to be read against :func:`majority_rate`, the accuracy of always answering the most common class.

Example:
    >>> import torch
    >>> bank = torch.eye(3)                                  # one unit feature per class
    >>> queries = torch.tensor([[0.9, 0.1, 0.0], [0.0, 0.2, 0.9]])
    >>> knn_accuracy(bank, torch.arange(3), queries, torch.tensor([0, 2]), classes=3, k=1)
    1.0
    >>> majority_rate(torch.tensor([0, 2, 2, 1]), classes=3)
    0.5
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from contrastive_dist import all_gather_many

__all__ = ["KnnSplit", "knn_accuracy", "majority_rate", "split_knn_accuracy"]


class KnnSplit(Dataset):
    """Evaluation items ``(image, label, is_query)``: the labelled bank first, then the queries.

    Args:
        bank: ``(image, label)`` items whose features vote.
        queries: ``(image, label)`` items whose label the vote must find.

    Example:
        >>> split = KnnSplit([("bank image", 3)], [("query image", 1), ("another", 0)])
        >>> len(split), split[0], split[2]
        (3, ('bank image', 3, 0), ('another', 0, 1))
    """

    def __init__(self, bank: Any, queries: Any) -> None:
        self.bank, self.queries = bank, queries

    def __len__(self) -> int:
        return len(self.bank) + len(self.queries)

    def __getitem__(self, index: int) -> tuple[Any, int, int]:
        is_query = index >= len(self.bank)
        image, label = self.queries[index - len(self.bank)] if is_query else self.bank[index]
        return image, label, int(is_query)


def knn_accuracy(bank: Tensor, bank_labels: Tensor, queries: Tensor, query_labels: Tensor, *, classes: int,
                 k: int = 20, temperature: float = 0.1) -> float:
    """The fraction of queries whose similarity-weighted vote of their ``k`` nearest bank rows is their label.

    Each of a query's ``k`` most similar bank rows (dot product: pass rows of length 1) votes for
    its label with weight ``exp(similarity / temperature)``.

    Args:
        bank: the labelled features.
        bank_labels: their labels, in ``[0, classes)``.
        queries: the features to classify.
        query_labels: their labels.
        classes: the number of classes.
        k: neighbours per query (all of the bank when it has fewer rows).
        temperature: the votes' temperature.

    Shape:
        - bank: ``(B, D)``; bank_labels: ``(B,)`` int64; queries: ``(Q, D)``; query_labels: ``(Q,)``.

    Example:
        >>> import torch
        >>> bank = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
        >>> knn_accuracy(bank, torch.tensor([0, 1, 1]), torch.tensor([[0.6, 0.8]]), torch.tensor([1]), classes=2, k=2)
        1.0
    """
    similarity, neighbours = (queries @ bank.T).topk(min(k, len(bank)), dim=1)
    weights = (similarity / temperature).exp()
    votes = weights.new_zeros(len(queries), classes).scatter_add_(1, bank_labels[neighbours], weights)
    return (votes.argmax(1) == query_labels).float().mean().item()


def split_knn_accuracy(features: Tensor, labels: Tensor, is_query: Tensor, *, classes: int, k: int = 20,
                       temperature: float = 0.1) -> float:
    """:func:`knn_accuracy` of a :class:`KnnSplit`'s features over every rank: the same value on every rank.

    Each rank passes the features of its share of the split (uneven shares, and empty ones, are
    fine); they are gathered from every rank (:func:`~contrastive_dist.all_gather_many`, one
    collective), and the queries among them vote with the bank's. Without a process group: this
    process's rows.

    Shape:
        - features: ``(n, D)`` rows of length 1; labels: ``(n,)`` int64; is_query: ``(n,)``, 1 for a query.

    Example:
        >>> import torch
        >>> features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1]])
        >>> split_knn_accuracy(features, torch.tensor([0, 1, 0]), torch.tensor([0, 0, 1]), classes=2, k=1)
        1.0
    """
    features, labels, is_query = all_gather_many((features, labels, is_query)).tensors
    query = is_query.bool()
    return knn_accuracy(features[~query], labels[~query], features[query], labels[query], classes=classes, k=k,
                        temperature=temperature)


def majority_rate(labels: Tensor, classes: int) -> float:
    """The accuracy of always answering the most common of ``labels``: the chance level of a k-NN probe.

    Example:
        >>> import torch
        >>> majority_rate(torch.tensor([1, 1, 0]), classes=4)
        0.6666666666666666
    """
    return torch.bincount(labels, minlength=classes).max().item() / len(labels)
