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

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from contrastive_dist._validation import check_features
from contrastive_dist.engine._agreement import Layout
from contrastive_dist.engine._ring import Ring
from contrastive_dist.engine.gather import gather_agreed
from contrastive_dist.losses._columns import Columns, OneBlock, RingBlocks
from contrastive_dist.losses._precision import operands

__all__ = [
    "SharedNegatives",
    "check_negative_ids",
    "check_negatives",
    "negatives_kind",
    "shared_negatives_option",
    "text_columns",
    "with_own_negatives",
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


def negatives_kind(negatives: object) -> str:
    """``"none"``, ``"own"`` or ``"shared"``: an option every rank must agree on."""
    if negatives is None:
        return "none"
    return "shared" if isinstance(negatives, SharedNegatives) else "own"


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


def with_own_negatives(columns: Columns, negatives: Sequence[Tensor | None], layout: Layout) -> Columns:
    """``columns`` with every rank's own negatives after its texts: each tensor of ``negatives`` joins its peer.

    A ``None`` leaves its peer as it is (negatives without ids: the columns' ids then cover the texts
    only, and the negatives share no id). Gather mode: every rank's negatives gathered (their agreed
    counts, one more collective) after every rank's texts. Ring mode: this rank's appended to its
    block, which now has ``n_r + k_r`` columns.
    """
    counts = layout.extra_sizes
    present = [(index, tensor) for index, tensor in enumerate(negatives) if tensor is not None]
    if isinstance(columns.transport, OneBlock):
        gathered = gather_agreed([tensor for _, tensor in present], layout._replace(sizes=counts)).tensors
        rows = columns.rows
    else:
        gathered = tuple(tensor for _, tensor in present)
        ring = columns.transport.ring
        rows = tuple(size + count for size, count in zip(columns.rows, counts, strict=True))
    joined = list(columns.tensors)
    for (index, _), extra in zip(present, gathered, strict=True):
        joined[index] = torch.cat((joined[index], extra.to(joined[index].dtype)))
    if isinstance(columns.transport, OneBlock):
        return Columns(tuple(joined), columns.transport, rows)
    return Columns(tuple(joined), RingBlocks(Ring(ring.rank, ring.world_size, rows, ring.group)), rows)


def text_columns(
    texts: Columns,
    keyed: bool,
    negatives: Tensor | SharedNegatives | None,
    negative_keys: Tensor | None,
    layout: Layout,
) -> tuple[Columns, tuple[int, ...]]:
    """InfoNCE's columns: the texts (and their keys when ``keyed``), every rank's own negatives after them.

    Returns the columns and every rank's number of keyed columns (its texts, and its negatives when
    they have keys: ``negative_keys``).
    """
    columns = Columns((operands(texts.tensors[0]), *texts.tensors[1 : 1 + keyed]), texts.transport, texts.rows)
    if not isinstance(negatives, Tensor):
        return columns, texts.rows
    joined = with_own_negatives(columns, (operands(negatives), negative_keys if keyed else None), layout)
    return joined, joined.rows if keyed and negative_keys is not None else texts.rows
