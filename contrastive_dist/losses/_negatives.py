"""Extra negative columns for InfoNCE: this rank's own (gathered from every rank) or shared ones (a queue)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._validation import check_features
from contrastive_dist.engine.gather import all_gather

__all__ = ["SharedNegatives", "check_negatives", "negative_columns", "negatives_marker"]


class SharedNegatives(NamedTuple):
    """Negatives that every rank already holds identically (e.g. a memory queue): used as they are.

    Plain tensors passed as ``negatives=`` are this rank's own and are gathered from every rank;
    wrapping keys in ``SharedNegatives`` says they are the same on every rank, so gathering them
    would repeat each one ``W`` times. They take no gradient.

    Attributes:
        keys: ``(K, D)`` negatives, identical on every rank.
    """

    keys: Tensor


def check_negatives(negatives: object, texts: Tensor) -> Tensor | SharedNegatives | None:
    """Check ``negatives`` against the text features: 2-d, the same ``D``, and (own negatives) the same dtype."""
    if negatives is None:
        return None
    shared = isinstance(negatives, SharedNegatives)
    name = "negatives.keys" if shared else "negatives"
    keys = check_features(name, negatives.keys if isinstance(negatives, SharedNegatives) else negatives)
    if keys.shape[1] != texts.shape[1]:
        raise ValueError(
            f"{name} must have the text features' width D={texts.shape[1]}, got shape {tuple(keys.shape)}"
        )
    if not shared and keys.dtype != texts.dtype:
        raise TypeError(f"negatives must have the text features' dtype {texts.dtype}, got {keys.dtype}")
    return SharedNegatives(keys.detach().to(texts.device)) if shared else keys


def negatives_marker(negatives: Tensor | SharedNegatives | None, texts: Tensor) -> tuple[Tensor, ...]:
    """A zero-width tensor that says which kind of negatives this rank passes, for the features' gather.

    It costs nothing on the wire, but its shape enters the gather's agreement: a rank passing own
    negatives while another passes none (it would wait alone in the negatives' gather) or shared
    ones raises the same clear error on every rank instead of hanging.
    """
    if negatives is None:
        return ()
    shape = (texts.shape[0], 0, 0) if isinstance(negatives, SharedNegatives) else (texts.shape[0], 0)
    return (texts.new_zeros(shape),)


def negative_columns(negatives: Tensor | SharedNegatives, group: ProcessGroup | None) -> Tensor:
    """All negative columns: every rank's own negatives in rank order, or the shared keys as they are.

    Own negatives take their own gather (their count differs from the batch's, so they cannot share
    the features' buffer); its agreement exchange makes a width or dtype that differs between ranks
    a clear error on every rank, and its backward returns each negative's gradient to its owner.
    """
    if isinstance(negatives, SharedNegatives):
        return negatives.keys
    return all_gather(negatives, group=group).tensor
