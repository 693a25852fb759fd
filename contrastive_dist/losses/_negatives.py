"""Extra negative columns for InfoNCE: this rank's own (they join its column block) or shared ones (a queue).

**Own negatives** (each rank's ``k_r`` rows, any count, 0 included, with gradient) are columns of
their rank, after its texts: gathered from every rank after every text in gather mode, travelling
appended to their rank's text block in ring mode. Every image row meets every negative once
(image→text only: text→image is over the texts alone), and each negative's gradient goes back to
its owner (the gather's reduce-scatter, or the ring's accumulator). Every rank's ``k_r`` comes from
the agreement exchange. **Shared negatives** (identical on every rank, no gradient, e.g. a memory
queue) are columns held here: the kernel meets them locally, with no transfer.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from contrastive_dist._validation import check_features
from contrastive_dist.engine._agreement import Layout
from contrastive_dist.engine._ring import Ring
from contrastive_dist.engine.gather import gather_agreed
from contrastive_dist.losses._options import check_ids, operands
from contrastive_dist.losses._transports import Columns, OneBlock, RingBlocks

__all__ = [
    "SharedNegatives",
    "check_negative_ids",
    "check_negatives",
    "negatives_options",
    "shared_negatives_option",
    "with_negatives",
]


class SharedNegatives(NamedTuple):
    """Negatives that every rank already holds identically (e.g. a memory queue): used as they are.

    Plain tensors passed as ``negatives=`` are this rank's own and are gathered from every rank;
    wrapping keys in ``SharedNegatives`` says they are the same on every rank, so gathering them
    would repeat each one ``W`` times. They take no gradient.

    Attributes:
        keys: ``(K, D)`` negatives, identical on every rank.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import SharedNegatives, info_nce
        >>> images, texts = F.normalize(torch.randn(4, 8), dim=-1), F.normalize(torch.randn(4, 8), dim=-1)
        >>> bank = SharedNegatives(F.normalize(torch.randn(16, 8), dim=-1))  # the same 16 keys on every rank
        >>> info_nce(images, texts, negatives=bank).shape
        torch.Size([])
    """

    keys: Tensor


def check_negatives(negatives: object, negative_ids: object, ids: object, texts: Tensor
                    ) -> tuple[Tensor | SharedNegatives | None, Tensor | None]:  # fmt: skip
    """Check InfoNCE's extra negatives against the text features and their ids against the rows'.

    The negatives: 2-d, the texts' ``D`` and (own negatives) dtype; ``negative_ids=``: one int64 id per
    negative, and only with both ``negatives=`` and ``ids=``. Returns both, the shared ones detached.
    """
    check_negative_ids(negative_ids, ids, negatives)
    if negatives is None:
        return None, None
    shared = isinstance(negatives, SharedNegatives)
    name = "negatives.keys" if shared else "negatives"
    keys = check_features(name, negatives.keys if isinstance(negatives, SharedNegatives) else negatives)
    if keys.shape[1] != texts.shape[1]:
        raise ValueError(
            f"{name} must have the text features' width D={texts.shape[1]}, got shape {tuple(keys.shape)}"
        )
    if not shared and keys.dtype != texts.dtype:
        raise TypeError(f"negatives must have the text features' dtype {texts.dtype}, got {keys.dtype}")
    checked = SharedNegatives(keys.detach().to(texts.device)) if shared else keys
    return checked, check_ids("negative_ids", negative_ids, keys.shape[0], texts)


def negatives_options(negatives: object, negative_ids: object) -> dict[str, object]:
    """What every rank must agree on of the negatives: their kind, whether they have ids, the shared ones' digest.

    Example:
        >>> negatives_options(None, None)
        {'negatives': 'none', 'negative_ids': False, 'shared_negatives': None}
    """
    kind = "none" if negatives is None else "shared" if isinstance(negatives, SharedNegatives) else "own"
    shared = shared_negatives_option(negatives, negative_ids)
    return {"negatives": kind, "negative_ids": negative_ids is not None, "shared_negatives": shared}


def check_negative_ids(negative_ids: object, ids: object, negatives: object) -> None:
    """``negative_ids=`` names the negatives' ids against the rows' ids: it needs both ``negatives=`` and ``ids=``."""
    if negative_ids is None:
        return
    if negatives is None:
        raise ValueError("negative_ids= gives the ids of negatives=, but no negatives were passed")
    if ids is None:
        raise ValueError(
            "negative_ids= gives the ids of negatives=, which are compared with the rows' ids= (a negative "
            "sharing a row's id is masked or a positive), but no ids= were passed: pass ids= (one int64 id "
            "per row) too, or drop negative_ids="
        )


_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: a fixed odd multiplier that spreads the bits


def shared_negatives_option(negatives: object, negative_ids: object) -> str | None:
    """What every rank must agree on of shared negatives: their count and a digest of their ids.

    Shared negatives are the same on every rank by contract; a rank whose queue holds other ids
    (a different count, or ids in another order) would silently compute another loss. Their ids
    are one int64 per key: digested on their device in one pass (``(K,)``, no copy of the keys),
    read with the agreement's own synchronisation. Under ``torch.compile`` nothing is exchanged, so
    nothing is compared, as for every option there.

    Example:
        >>> import torch
        >>> keys = SharedNegatives(torch.randn(3, 4))
        >>> shared_negatives_option(keys, None)
        '3 keys'
        >>> in_order, swapped = torch.tensor([5, 6, 7]), torch.tensor([5, 7, 6])
        >>> shared_negatives_option(keys, in_order) != shared_negatives_option(keys, swapped)
        True
    """
    if not isinstance(negatives, SharedNegatives) or not isinstance(negatives.keys, Tensor):
        return None
    text = f"{negatives.keys.shape[0] if negatives.keys.ndim else 0} keys"
    ids = negative_ids
    if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.ndim != 1 or torch.compiler.is_compiling():
        return text  # wrong ids are this rank's problem, raised by the checks; no digest under compile
    position = torch.arange(1, ids.shape[0] + 1, dtype=torch.int64, device=ids.device) * _MIX
    mixed = (ids + position) * (position | 1)  # int64 arithmetic wraps: a digest, not a sum of ids
    digest = int((mixed ^ (mixed >> 31)).sum()) & (2**48 - 1)
    return f"{text}, negative_ids #{digest:012x}"


def with_negatives(columns: Columns, negatives: Tensor | SharedNegatives, negative_keys: Tensor | None,
                   layout: Layout) -> Columns:  # fmt: skip
    """``columns`` with InfoNCE's extra negatives: every rank's own after its features, or the shared ones held here.

    Own negatives: gather mode gathers every rank's (their agreed counts, one more collective) after every
    rank's features; ring mode appends this rank's to its block, which then has ``n_r + k_r`` columns.
    Their keys join the features' keys (without keys of their own, the columns' keys cover the features
    only, and the negatives share none with any row).
    """
    if isinstance(negatives, SharedNegatives):
        return columns._replace(local=(operands(negatives.keys), negative_keys))
    own = [operands(negatives), negative_keys if columns.keys is not None else None]
    present = [tensor for tensor in own if tensor is not None]
    counts = layout.extra_sizes
    gather = isinstance(columns.transport, OneBlock) and layout.world_size > 1
    gathered = iter(gather_agreed(present, layout._replace(sizes=counts)).tensors if gather else present)
    features = torch.cat((columns.features, next(gathered).to(columns.features.dtype)))
    keys = columns.keys
    if keys is not None and negative_keys is not None:
        keys = torch.cat((keys, next(gathered).to(keys.dtype)))
    if isinstance(columns.transport, OneBlock):
        return columns._replace(features=features, keys=keys)
    rows = tuple(size + count for size, count in zip(columns.counts, counts, strict=True))
    keyed = rows if negative_keys is not None else columns.key_counts
    ring = columns.transport.ring
    transport = RingBlocks(Ring(ring.rank, ring.world_size, rows, ring.group))
    return columns._replace(features=features, keys=keys, transport=transport, counts=rows, key_counts=keyed)
