"""Ring mode's per-sample weights, ``reduction="none"`` and extra negatives, as gather mode defines them.

**Weights and reduction.** Every ring body ends holding ``ℓ_i``, the loss of each of this rank's
rows, with autograd attached (the ring kernels recompute their logits in backward with per-row
upstream gradients). ``reduction="none"`` returns them; otherwise :func:`ring_mean` returns this
rank's share ``W · Σ_local w_i ℓ_i / Σ_global w_i`` (``w = 1`` without weights), the global
denominator from one scalar all-reduce. The weights are among the tensors of the ring's
agreement exchange, so a rank passing weights while another does not raises the same error on
every rank before any collective that only one of them would run.

**Own negatives** (each rank's ``k_r`` rows, any count, 0 included, with gradient) travel round
the ring appended to their rank's text block: block ``r`` has ``n_r + k_r`` key rows, so every
image row meets every negative once (image→text only: the column log-sum-exps, text→image,
cover each block's leading text rows alone) and each negative's gradient comes home with its
block's accumulator. A second agreement exchange gives every rank every ``k_r`` (and checks dtype, width
and gradient tracking); the features' exchange carries a zero-width marker of the kind of
negatives each rank passes, so a rank passing own negatives while another does not fails there.
Memory: one block of ``max_r (n_r + k_r)`` rows and ``chunk × max_r (n_r + k_r)`` logits.

**Shared negatives** (identical on every rank, no gradient, e.g. a memory queue) do not travel:
they are extra local columns, merged into the image rows' log-sum-exps ``chunk_size`` rows at a
time (``chunk × K`` logits, recomputed in backward).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from contrastive_dist.engine._agreement import agree_on_sizes
from contrastive_dist.engine._ring import Ring
from contrastive_dist.losses._chunked import contract_factor
from contrastive_dist.losses._reduction import total_factor
from contrastive_dist.losses._ring_softmax import ring_logsumexp

__all__ = ["ring_mean", "shared_logsumexp", "with_negatives"]


def ring_mean(rows: Tensor, ring: Ring, weights: Tensor | None, *, counted: Tensor | None = None) -> Tensor:
    """Return this rank's share of the global (weighted) mean of the per-row losses ``rows``.

    Returns ``W · Σ_i w_i ℓ_i / Σ_global w_i`` (``w = 1`` without weights; 0 when the denominator is
    0), so that the mean over ranks is the global mean. With ``counted`` (SupCon: the anchors with
    positives) only counted rows enter the denominator, and ``rows`` must be 0 elsewhere. The
    unweighted mean over the global row count needs no collective (the sizes are known); the
    others take one scalar all-reduce, run by every rank alike.

    Shape:
        rows, weights, counted: ``(m_r,)``; output: ``()``.

    Example:
        >>> import torch
        >>> rows, weights = torch.tensor([1.0, 3.0]), torch.tensor([3.0, 1.0])
        >>> ring_mean(rows, Ring(0, 1, (2,)), weights)
        tensor(1.5000)
        >>> ring_mean(rows, Ring(0, 1, (2,)), None)
        tensor(2.)
    """
    if weights is None and counted is None:
        return rows.sum() * contract_factor(sum(ring.sizes), ring.world_size)
    if weights is None:
        total = counted.sum()  # type: ignore[union-attr]  # an exact integer count
    else:
        total = (weights if counted is None else weights * counted).sum()
    if ring.world_size > 1:
        dist.all_reduce(total, group=ring.group)
    numerator = rows.sum() if weights is None else rows @ weights
    return numerator * total_factor(ring.world_size, total.to(rows.dtype))


def with_negatives(ring: Ring, texts: Tensor, negatives: Tensor) -> tuple[Ring, Tensor]:
    """The travelling text blocks with each rank's own negatives appended, and the ring of their sizes.

    One agreement exchange tells every rank every negative count ``k_r``; a dtype, width or
    gradient tracking that differs between ranks raises the same ``ValueError`` on every rank.

    Shape:
        texts: ``(n_r, D)``; negatives: ``(k_r, D)``; output: ``(n_r + k_r, D)``, sizes ``n_r + k_r``.
    """
    if ring.world_size == 1:
        counts: tuple[int, ...] = (negatives.shape[0],)
    else:
        counts = agree_on_sizes((negatives,), 0, None, ring.group, ring.world_size)
    sizes = tuple(rows + count for rows, count in zip(ring.sizes, counts, strict=True))
    return Ring(ring.rank, ring.world_size, sizes, ring.group), torch.cat((texts, negatives.to(texts.dtype)))


def shared_logsumexp(queries: Tensor, keys: Tensor, scale: Tensor, chunk_size: int | None) -> Tensor:
    """Row log-sum-exps of ``s · Q Kᵀ`` over keys held here (shared negatives), ``chunk_size`` rows at a time.

    The one-rank case of the ring kernel: no transfer, logits recomputed in backward, no key gradient.

    Shape:
        queries: ``(n_r, D)``; keys: ``(K, D)``; scale: ``()``; output: ``(n_r,)``.

    Example:
        >>> import torch
        >>> queries, keys = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
        >>> scale = torch.tensor(2.0, dtype=torch.float64)
        >>> torch.allclose(shared_logsumexp(queries, keys, scale, 2), (2.0 * queries @ keys.T).logsumexp(1))
        True
    """
    keys = keys.detach().to(queries.dtype)
    row_lse, _, _, _ = ring_logsumexp(queries, keys, scale, Ring(0, 1, (keys.shape[0],)), chunk_size=chunk_size)
    return row_lse
