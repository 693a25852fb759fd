"""Synchronized BatchNorm: exact global statistics on any backend, for uneven and empty ranks.

Per-rank BatchNorm normalizes each rank's rows with that rank's own statistics, so the
distributed run differs from one process on the whole batch, and a rank holding one sample
fails ("Expected more than 1 value per channel when training"). ``torch.nn.SyncBatchNorm``
fixes the statistics on GPUs only. :class:`SyncBatchNorm` here normalizes every rank's rows
with the mean and variance of the *global* batch, on gloo (CPU) and NCCL (GPU) alike, with one
small collective per layer forward and one backward (see ``_norm_function`` for the algebra).
SimCLR's "global BN" is exactly this.

Under the package's gradient contract (rank ``r`` returns ``(W / N)·Σ_{i on r} ℓ_i`` and DDP
averages gradients), a model whose BatchNorm layers are converted with
:func:`convert_sync_batchnorm` trains to the same parameters *and* running statistics as one
process on the concatenated batch, whatever the per-rank batch sizes, including 0.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from contrastive_dist._dist import GroupLike, get_world_size, is_distributed, process_group
from contrastive_dist.nn._norm_function import GlobalStats, global_batch_stats, normalize_with_global_stats
from contrastive_dist.nn._norm_mode import agree_on_training

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of every rank; a drop-in for ``nn.BatchNorm1d/2d/3d``.

    In training mode with more than one rank, the mean and variance of each channel are those
    of the concatenation of every rank's batch, and the backward is exact through them. The
    running statistics (unbiased variance with the global count) and ``num_batches_tracked``
    are updated identically on every rank. In every other case (eval mode, one rank, no process
    group) the layer is exactly ``nn.BatchNorm``; in eval mode with
    ``track_running_stats=False`` it therefore uses this rank's own batch statistics, with no
    collective, so ranks may evaluate independently (as ``torch.nn.SyncBatchNorm`` does).

    Parameters, buffers and their names are those of ``nn.BatchNorm``, so state dicts load
    either way.

    Every rank must run every training forward *and* backward of the layer, also a rank with
    no rows (its loss must stay connected to the model output, as the gradient contract
    requires), or the other ranks wait in the collective. Every rank must be in the same mode: a
    rank in eval mode while the others train is found at the step's first layer, and every rank
    raises the same ``ValueError`` (one small agreement per training step, see ``_norm_mode``).

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; ``None`` for a
            cumulative average.
        affine: learn a per-channel ``weight`` and ``bias``.
        track_running_stats: keep running statistics for eval mode.
        group: the ranks that share statistics, a process group or a device mesh (default: the world;
            [group][option-group]).
        device: device of the parameters and buffers.
        dtype: dtype of the parameters and buffers.

    Raises:
        ValueError: on every rank, when the global batch holds one value per channel in
            training, some rank's input is not ``(N, C, *)``, or a rank is in eval mode while
            the others train.

    Shape:
        input: ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)``, ``N`` may be 0.
        output: same shape as input.

    Example:
        >>> import torch
        >>> from contrastive_dist import SyncBatchNorm
        >>> norm = SyncBatchNorm(4)
        >>> x = torch.randn(6, 4, 5, 5)
        >>> y = norm(x)  # one process: nn.BatchNorm2d
        >>> torch.allclose(y, torch.nn.functional.batch_norm(x, None, None, training=True), atol=1e-6)
        True
        >>> y.sum().backward()
        >>> int(norm.num_batches_tracked)
        1

    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        group: GroupLike = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        if not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"eps must be a float >= 0, got {eps!r}")
        if momentum is not None and (not isinstance(momentum, (int, float)) or not 0.0 <= momentum <= 1.0):
            raise ValueError(f"momentum must be None or a float in [0, 1], got {momentum!r}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.group = group
        # Input ranks accepted; a layer converted from BatchNorm1d/2d/3d keeps that class's check.
        self.input_dims: tuple[int, ...] | None = None

    def _check_input_dim(self, input: Tensor) -> None:
        if self.input_dims is not None and input.dim() not in self.input_dims:
            expected = " or ".join(f"{dims}D" for dims in self.input_dims)
            raise ValueError(f"expected {expected} input, got {input.dim()}D input")
        if input.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C, *) with at least 2 dimensions, got {input.dim()}D")

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` with global batch statistics (training) or as ``nn.BatchNorm``."""
        group = process_group(self.group)
        if not (self.training and is_distributed(group)):
            return super().forward(input)
        world_size = get_world_size(group)
        agree_on_training(input, self.num_features, group)  # every rank trains: else the same error everywhere
        stats = global_batch_stats(input, self.num_features, group, world_size)
        if self.track_running_stats:
            self._update_running_stats(stats)
        return normalize_with_global_stats(input, self.weight, self.bias, stats, self.eps, group)

    @torch.no_grad()
    def _update_running_stats(self, stats: GlobalStats) -> None:
        # As nn.BatchNorm: the step is counted even for an empty batch, whose statistics are
        # then skipped (there are none; using them would write NaN into the buffers).
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if stats.total == 0 or self.running_mean is None or self.running_var is None:
            return
        tracked = self.num_batches_tracked
        # momentum=None: cumulative average over the tracked batches, as nn.BatchNorm.
        if self.momentum is not None:
            factor = float(self.momentum)
        else:
            factor = 1.0 / float(tracked) if tracked is not None else 0.0
        unbiased_var = stats.var * (stats.total / (stats.total - 1))
        for buffer, batch_value in ((self.running_mean, stats.mean), (self.running_var, unbiased_var)):
            updated = buffer.to(torch.float64).mul_(1.0 - factor).add_(batch_value, alpha=factor)
            buffer.copy_(updated)


def _converted(module: _BatchNorm, group: GroupLike) -> SyncBatchNorm:
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        raise ValueError(f"convert_sync_batchnorm: run one forward through {type(module).__name__} first")
    sync = SyncBatchNorm(
        module.num_features,
        module.eps,
        module.momentum,
        module.affine,
        module.track_running_stats,
        group=group,
        device="meta",  # placeholders only: the original tensors are moved in below
    )
    # The same Parameter objects: device, dtype, requires_grad and optimizer references survive.
    for name in ("weight", "bias"):
        sync.register_parameter(name, getattr(module, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        persistent = name not in module._non_persistent_buffers_set
        sync.register_buffer(name, getattr(module, name), persistent=persistent)
    sync.train(module.training)
    sync.input_dims = _INPUT_DIMS.get(type(module))
    return sync


_INPUT_DIMS: dict[type, tuple[int, ...]] = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}


def convert_sync_batchnorm(module: nn.Module, group: GroupLike = None) -> nn.Module:
    """Replace every BatchNorm layer in ``module`` by a :class:`SyncBatchNorm`.

    Every ``nn.BatchNorm1d/2d/3d`` (any subclass of ``nn.modules.batchnorm._BatchNorm``, also
    ``torch.nn.SyncBatchNorm``) becomes a :class:`SyncBatchNorm` that holds the *same* parameter
    and buffer tensors and the same training flag. Layers that already are
    :class:`SyncBatchNorm` are kept as they are.

    Args:
        module: the model; changed in place.
        group: the ranks that share statistics, a process group or a device mesh (default: the world;
            [group][option-group]).

    Returns:
        ``module`` itself, or a new :class:`SyncBatchNorm` when ``module`` is a BatchNorm layer.

    Example:
        >>> import torch
        >>> from contrastive_dist import SyncBatchNorm, convert_sync_batchnorm
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
        >>> model = convert_sync_batchnorm(model)
        >>> isinstance(model[1], SyncBatchNorm)
        True

    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"convert_sync_batchnorm expects an nn.Module, got {type(module).__name__}")
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        # A torch.nn.SyncBatchNorm keeps its own process group unless another is given.
        return _converted(module, group if group is not None else getattr(module, "process_group", None))
    for name, child in module.named_children():
        replacement = convert_sync_batchnorm(child, group)
        if replacement is not child:
            setattr(module, name, replacement)
    return module
