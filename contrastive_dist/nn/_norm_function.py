"""The arithmetic of synchronized BatchNorm: global batch statistics and their exact backward.

Forward, one collective per layer: every rank packs ``[count, problem, mean, M2]`` of its
own rows (``count`` values per channel, ``M2`` the sum of squared deviations from the local
mean, both computed in two passes) into one small float64 vector, and one equal-size
all-gather hands every rank the whole ``(W, 2 + 2C)`` table. Each rank then merges the rows
with Chan et al.'s parallel formula::

    N = Σ_r n_r        mean = Σ_r n_r·mean_r / N        M2 = Σ_r M2_r + Σ_r n_r·(mean_r − mean)²

Why not one all-reduce of ``[count, Σx, Σx²]``: ``Σx²/N − mean²`` cancels catastrophically
when ``|mean| ≫ std`` (in float32, an activation with mean 1e3 and std 1 keeps about one
significant digit of its variance; with mean 1e4, none). Local two-pass moments plus Chan's
merge never subtract two large numbers, and the table is tiny (``W × (2C + 2)`` values), so
an all-gather costs what an all-reduce costs. Every rank merges the same table in the same
order, so the statistics, and hence the running buffers, are bitwise identical on every rank.
The count goes along, so the "1 value per channel" error and the empty-batch case are decided
after the collective, by every rank alike.

Backward, one collective per layer: with ``x̂ = (x − mean)·invstd`` and global sums over all
``N`` values of a channel,

    dx = weight·invstd·(dy − Σdy/N − x̂·Σ(dy·x̂)/N)

so the ranks all-reduce the two per-channel sums ``[Σdy, Σdy·x̂]`` (SUM). ``dy`` on each rank is
the gradient of that rank's own loss, so the result is the gradient of the sum of all ranks'
losses, which DDP's averaging turns into the single-process gradient under the package's
gradient contract. The weight and bias gradients are the *local* sums; DDP averages them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from contrastive_dist.engine._wire import all_gather_single, all_reduce
from contrastive_dist.nn._norm_mode import STATISTICS

__all__ = ["GlobalStats", "global_batch_stats", "normalize_with_global_stats"]

# Half-precision inputs are reduced and normalized with float32 statistics (the mixed-dtype
# path of the native batch_norm kernels); float32 and float64 inputs keep their own dtype.
_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class GlobalStats(NamedTuple):
    """Per-channel statistics of the global batch (float64) and its count of values per channel."""

    mean: Tensor
    var: Tensor  # biased: M2 / count
    total: int


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which a batch of ``dtype`` is reduced and normalized."""
    return _ACCUMULATE.get(dtype, dtype)


def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.ndim)]


def _channel_shape(x: Tensor) -> tuple[int, ...]:
    return (1, -1, *([1] * (x.ndim - 2)))


def _local_moments(x: Tensor, channels: int) -> Tensor:
    """``[count, problem, mean (C), M2 (C)]`` of this rank's values, float64."""
    packed = torch.zeros(2 + 2 * channels, dtype=torch.float64, device=x.device)
    if x.ndim < 2 or x.shape[1] != channels:
        packed[1] = 1.0  # reported to every rank, which all raise instead of hanging
        return packed
    count = x.numel() // channels
    packed[0] = count
    if count == 0:
        return packed
    dtype = accumulate_dtype(x.dtype)
    dims = _reduce_dims(x)
    mean = x.sum(dims, dtype=dtype) / count
    # Second pass over the centred values: the stable local M2 that Chan's merge needs.
    m2 = (x.to(dtype) - mean.view(_channel_shape(x))).square_().sum(dims)
    packed[2 : 2 + channels] = mean
    packed[2 + channels :] = m2
    return packed


@torch.no_grad()
def global_batch_stats(x: Tensor, channels: int, group: ProcessGroup | None, world_size: int) -> GlobalStats:
    """Mean and biased variance per channel over every rank's batch (one all-gather).

    Raises:
        ValueError: on every rank, when some rank's input is not ``(N, channels, *)`` or when
            the global batch holds exactly one value per channel (as ``nn.BatchNorm`` does).

    """
    local = _local_moments(x, channels)
    table = local.new_empty((world_size, local.numel()))
    all_gather_single(table, local.unsqueeze(0), group=group, operation=STATISTICS)
    counts, problems = table[:, 0], table[:, 1]
    means, m2s = table[:, 2 : 2 + channels], table[:, 2 + channels :]
    # One host sync reads every decision the ranks must agree on.
    decisions = torch.stack([problems.sum(), counts.sum()]).tolist()
    if decisions[0] > 0:
        bad = problems.nonzero().flatten().tolist()
        raise ValueError(
            f"SyncBatchNorm expected input of shape (N, {channels}, *) on every rank; rank(s) {bad} "
            f"gave another shape (this rank: {tuple(x.shape)})"
        )
    total = int(decisions[1])
    if total == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {x.size()} on this rank "
            f"and 1 value per channel over the {world_size} ranks"
        )
    if total == 0:
        zeros = means.new_zeros(channels)
        return GlobalStats(zeros, zeros + 1.0, 0)
    weights = counts.unsqueeze(1)
    mean = (weights * means).sum(0) / total
    m2 = m2s.sum(0) + (weights * (means - mean).square()).sum(0)
    return GlobalStats(mean, m2 / total, total)


class _NormalizeWithGlobalStats(torch.autograd.Function):
    """``(x − mean)·invstd·weight + bias`` with global statistics; backward all-reduces two sums."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        mean: Tensor,
        var: Tensor,
        eps: float,
        count: int,
        group: ProcessGroup | None,
    ) -> Tensor:
        dtype = accumulate_dtype(x.dtype)
        mean, var = mean.to(dtype), var.to(dtype)
        weight_c = None if weight is None else weight.to(dtype)
        bias_c = None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight_c, mean, var)
        ctx.eps, ctx.count, ctx.group = eps, count, group
        ctx.weight_dtype = None if weight is None else weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # The eval-mode kernel applies given statistics in one fused pass.
        return F.batch_norm(x, mean, var, weight_c, bias_c, False, 0.0, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight, mean, var = ctx.saved_tensors
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        if x.numel() > 0:
            # Eval-mode backward with the global statistics: exactly the two local sums Σdy·x̂, Σdy.
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_out, x, weight, mean, var, None, None, False, ctx.eps, [False, True, True]
            )
        else:
            sum_dy_xhat, sum_dy = mean.new_zeros(mean.shape), mean.new_zeros(mean.shape)
        grad_weight = sum_dy_xhat.to(ctx.weight_dtype) if need_weight else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if need_bias else None
        grad_x = None
        # Every rank holds the same graph, so every rank takes the same branch here; with a
        # global count of 0 (known to all ranks) there is nothing to reduce.
        if need_x and ctx.count == 0:
            grad_x = torch.zeros_like(x)
        elif need_x:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            all_reduce(sums, ctx.group, operation="SyncBatchNorm backward (sum of the gradient statistics)")
            global_dy, global_dy_xhat = sums.chunk(2)
            invstd = (var + ctx.eps).rsqrt()
            scale = invstd if weight is None else weight * invstd
            # dx = scale·dy + (x̂·k + c); the eval kernel computes x̂·k + c in one fused pass.
            slope = -scale * global_dy_xhat / ctx.count
            offset = -scale * global_dy / ctx.count
            grad_x = F.batch_norm(x, mean, var, slope, offset, False, 0.0, ctx.eps)
            grad_x.addcmul_(grad_out, scale.view(_channel_shape(x)))
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def normalize_with_global_stats(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    stats: GlobalStats,
    eps: float,
    group: ProcessGroup | None,
) -> Tensor:
    """Normalize ``x`` with ``stats``; differentiable through the global statistics.

    Every rank must call the backward too (one all-reduce), also a rank with no rows.
    """
    out = _NormalizeWithGlobalStats.apply(x, weight, bias, stats.mean, stats.var, eps, stats.total, group)
    return out
