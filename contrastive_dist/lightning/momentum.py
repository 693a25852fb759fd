"""MoCo's parts: a momentum (EMA) key encoder and the symmetrised loss against a memory queue.

MoCo v2 trains a query encoder; a momentum encoder, an exponential moving average of it with no
gradient (:func:`momentum_copy`, moved by :func:`momentum_update_` each step), embeds the keys;
:func:`momentum_contrast_loss` makes each view's queries pick the key of the other view among the
keys of the global batch and those of a :class:`~contrastive_dist.DistributedMemoryQueue` of past
batches, symmetrised as in MoCo v3, then enqueues the step's keys.

Why a momentum encoder rather than queueing the query encoder's own detached embeddings: the
queue holds keys from up to ``K / N`` steps ago (a queue of ``K``, global batches of ``N``), and
they are useful negatives only while they stay comparable with today's keys; MoCo's ablation
(momentum 0) fails to train for that reason. The EMA copy changes slowly and costs one no-grad
forward per step; kept in the ``LightningModule`` with the queue, its weights and the queue's
buffers are in every checkpoint, so a resumed run continues exactly.

Example:
    >>> import torch
    >>> query_encoder = torch.nn.Linear(4, 3)
    >>> key_encoder = momentum_copy(query_encoder)
    >>> with torch.no_grad():
    ...     _ = query_encoder.weight.add_(1.0)               # an optimizer step
    >>> momentum_update_(key_encoder, query_encoder, momentum=0.75)
    >>> torch.allclose(key_encoder.weight, query_encoder.weight - 0.75), key_encoder.weight.requires_grad
    (True, False)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["momentum_contrast_loss", "momentum_copy", "momentum_update_"]

Module = TypeVar("Module", bound=nn.Module)


def momentum_copy(encoder: Module) -> Module:
    """A copy of ``encoder`` that no gradient reaches: the momentum encoder's starting point.

    Example:
        >>> import torch
        >>> key = momentum_copy(torch.nn.Linear(2, 2))
        >>> [parameter.requires_grad for parameter in key.parameters()]
        [False, False]
    """
    key_encoder = copy.deepcopy(encoder)
    key_encoder.requires_grad_(False)
    return key_encoder


@torch.no_grad()
def momentum_update_(key_encoder: nn.Module, query_encoder: nn.Module, *, momentum: float) -> None:
    """Move each parameter of ``key_encoder`` towards ``query_encoder``'s: ``key ← m·key + (1 - m)·query``.

    Call it before the momentum encoder embeds the step's keys, after the last optimizer step
    (MoCo's order). The buffers (BatchNorm's running statistics) are left to the key encoder's
    own forward passes.

    Args:
        key_encoder: the momentum encoder, a :func:`momentum_copy` of ``query_encoder``.
        query_encoder: the trained encoder, with the same parameters in the same order.
        momentum: ``m`` in ``[0, 1)``; MoCo uses 0.999 for runs of 10^5 steps or more.

    Raises:
        ValueError: ``momentum`` outside ``[0, 1)``, or encoders whose parameters do not pair up.

    Example:
        >>> import torch
        >>> key, query = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
        >>> _ = key.weight.data.fill_(0.0), query.weight.data.fill_(1.0)
        >>> momentum_update_(key, query, momentum=0.9)
        >>> round(key.weight.item(), 6)
        0.1
    """
    if not 0 <= momentum < 1:
        raise ValueError(f"expected momentum in [0, 1), got {momentum}")
    try:
        for key, query in zip(key_encoder.parameters(), query_encoder.parameters(), strict=True):
            key.lerp_(query.detach(), 1 - momentum)
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"expected a key encoder with the query encoder's parameters: {error}") from error


def momentum_contrast_loss(loss: Callable[..., Tensor], queries: Tensor, keys: Tensor, queue: Any, *,
                           sizes: Sequence[int] | None = None) -> Tensor:
    """The symmetrised MoCo loss of two views against the queue; then the second view's keys join the queue.

    ``loss`` is an InfoNCE over rows against columns, :class:`~contrastive_dist.DistributedInfoNCE`
    with ``symmetric=False``: the queries of view 1 must pick the keys of view 2 among the keys of
    the global batch and ``queue.negatives`` (the past batches only: taken before this step's
    enqueue), and the other way round; the result is the mean of the two. Queries and keys are
    normalised to length 1 here; the keys, from the momentum encoder, carry no gradient.

    Args:
        loss: called as ``loss(queries, keys, sizes=sizes, negatives=queue.negatives)``.
        queries: the query encoder's projections of both views.
        keys: the momentum encoder's projections of the same views.
        queue: a :class:`~contrastive_dist.DistributedMemoryQueue` of width ``D``; every rank enqueues.
        sizes: every rank's ``n`` this step, if known (skips the loss's size exchange).

    Shape:
        - queries, keys: ``(2, n, D)`` (view, row, feature); ``n`` may be 0 on a rank.
        - output: a scalar.

    Example:
        >>> import torch
        >>> from contrastive_dist import DistributedInfoNCE, DistributedMemoryQueue
        >>> queue, loss = DistributedMemoryQueue(8, 4), DistributedInfoNCE(symmetric=False)
        >>> queries, keys = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 3, 4)
        >>> value = momentum_contrast_loss(loss, queries, keys, queue)
        >>> value.backward()
        >>> value.ndim, len(queue), tuple(queries.grad.shape)
        (0, 3, (2, 3, 4))
    """
    queries, keys = F.normalize(queries, dim=-1), F.normalize(keys, dim=-1)
    negatives = queue.negatives  # the past batches only: taken before this step's enqueue
    value = (loss(queries[0], keys[1], sizes=sizes, negatives=negatives)
             + loss(queries[1], keys[0], sizes=sizes, negatives=negatives)) / 2
    queue.enqueue(keys[1])
    return value
