"""The loss families: what a visit does to its rows' state, and what a row's value and logit gradient are.

Each family is a module of functions with the same contracts (see :mod:`._softmax`), gathered here into
one :class:`Family` that the driver runs; a family's fused Triton ops (:mod:`._fused`) compute the
same numbers.

* :data:`SOFTMAX` — the masked per-row log-sum-exp against the row's positives, ``ℓ_i = logsumexp_j l_ij −
  mean_{p ∈ P_i} l_ip`` (InfoNCE, NT-Xent, SupCon);
* :data:`DECOUPLED` — the log-sum-exp over the row's negatives alone (DCL, HCL): :mod:`._decoupled`;
* :data:`SIGMOID` — the per-row sum of the pair terms ``Σ_j softplus(−z_ij l_ij)`` (SigLIP).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

from torch import Tensor

from contrastive_dist.losses import _decoupled, _sigmoid, _softmax
from contrastive_dist.losses._same_key import SameKey
from contrastive_dist.losses._targets import Targets

__all__ = ["DECOUPLED", "SIGMOID", "SOFTMAX", "Family"]


class Family(NamedTuple):
    """The functions of one loss family (see :mod:`._softmax` for their contracts).

    Attributes:
        name: ``"softmax"``, ``"decoupled"`` or ``"sigmoid"``.
        stateless: a row's logit gradient needs no state (its pair terms are independent): it can be formed
            the moment a block is, in any transport.
    """

    name: str
    stateless: bool
    width: int
    empty_state: Callable[[int, Tensor], Tensor]
    block_state_: Callable[[Tensor, Targets, SameKey | None], Tensor]
    merge_: Callable[[Tensor, Tensor], None]
    merged: Callable[[Tensor], Tensor]
    finish: Callable[[Tensor], Tensor]
    has_positive: Callable[[Tensor], Tensor]
    numerators_: Callable[..., Tensor]
    gradient_: Callable[[Tensor, Tensor, Targets, SameKey | None, Tensor | float], Tensor]
    rebase_: Callable[[Tensor, Tensor, Tensor], Tensor]


def _family(name: str, module: ModuleType, *, stateless: bool = False) -> Family:
    return Family(name, stateless, module.WIDTH, *(getattr(module, field) for field in Family._fields[3:]))


SOFTMAX = _family("softmax", _softmax)
SIGMOID = _family("sigmoid", _sigmoid, stateless=True)
DECOUPLED = SOFTMAX._replace(
    name="decoupled", finish=_decoupled.finish, has_positive=_decoupled.has_positive, gradient_=_decoupled.gradient_
)
"""The softmax family with the positives out of the sum: see :mod:`._decoupled`."""
