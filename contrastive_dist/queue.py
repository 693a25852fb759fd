"""A memory queue of past keys (MoCo-style negatives) that is the same on every rank.

Each step, every rank calls :meth:`DistributedMemoryQueue.enqueue` with its own keys (any number,
0 included); the keys of all ranks are gathered in rank order, i.e. in the order of the global
batch, and pushed together. So after any sequence of global batches every rank holds the queue
that one process would hold after pushing the same global batches, whatever the per-rank split,
and the queue size need not be a multiple of anything: a short last batch pushes fewer keys.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from contrastive_dist._dist import GroupLike
from contrastive_dist.engine.gather import all_gather, raise_on_all_ranks
from contrastive_dist.losses import SharedNegatives

__all__ = ["DistributedMemoryQueue"]


class DistributedMemoryQueue(nn.Module):
    """A FIFO of the last ``size`` keys of the global batches, identical on every rank.

    The keys live in buffers (``memory``, newest first, and ``count``, how many are filled), so a
    DDP or Lightning checkpoint carries the queue, and ``state_dict`` / ``load_state_dict`` resume
    it exactly; ``load_state_dict`` refuses, with a ``ValueError`` that says what was expected, a saved
    memory of another shape or dtype, a count that is not an integer in ``[0, size]``, and NaN or
    infinite keys. Being the same on every rank, the buffers are unaffected by DDP's buffer broadcast.
    The keys are stored on the buffers' device: move the queue with the model (``.to(device)``), so
    that the gather runs where the backend expects it (GPU tensors under NCCL).

    Order: within one global batch, later rows are newer (rank 0's keys are pushed first, each
    rank's in row order), so :attr:`negatives` starts with the last row of the last global batch.

    Args:
        size: how many keys the queue holds (> 0).
        dim: the keys' width ``D`` (> 0).
        dtype: the dtype the keys are stored in (keys are cast to it).
        group: the ranks that share the queue, a process group or a device mesh (default: the world;
            [group][option-group]).

    Shape:
        enqueue's keys: ``(n_r, D)``; negatives.keys: ``(min(pushed, size), D)``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import DistributedMemoryQueue, info_nce
        >>> queue = DistributedMemoryQueue(size=6, dim=8)
        >>> for step in range(3):
        ...     queries = F.normalize(torch.randn(4, 8), dim=-1).requires_grad_()
        ...     keys = F.normalize(torch.randn(4, 8), dim=-1)
        ...     loss = info_nce(queries, keys, symmetric=False, negatives=queue.negatives)
        ...     loss.backward()
        ...     queue.enqueue(keys)
        >>> len(queue), queue.negatives.keys.shape
        (6, torch.Size([6, 8]))

    """

    memory: Tensor
    count: Tensor

    def __init__(
        self, size: int, dim: int, *, dtype: torch.dtype = torch.float32, group: GroupLike = None
    ) -> None:
        super().__init__()
        for name, value in (("size", size), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be a positive int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be a positive int, got {value}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.size, self.dim, self.group = size, dim, group
        self.register_buffer("memory", torch.zeros(size, dim, dtype=dtype))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def __len__(self) -> int:
        """How many keys the queue holds now (at most ``size``)."""
        return int(self.count)

    @property
    def negatives(self) -> SharedNegatives:
        """The queue's keys, newest first, without gradient, for ``info_nce(..., negatives=)``.

        A copy: it stays what it was when taken, whatever :meth:`enqueue` does afterwards.
        """
        return SharedNegatives(self.memory[: int(self.count)].clone())

    @torch.no_grad()
    def enqueue(self, keys: Tensor) -> None:
        """Push every rank's ``keys`` (detached), gathered in rank order; call on every rank each step.

        Raises:
            ValueError / TypeError: on every rank, when a rank's keys are not ``(n_r, dim)`` floats, hold
                NaN or infinite values, or the ranks' queues disagree on ``dim``.
        """
        try:
            if not isinstance(keys, Tensor):
                raise TypeError(f"keys must be a torch.Tensor of shape (n, {self.dim}), got {type(keys).__name__}")
            if keys.ndim != 2 or keys.shape[1] != self.dim:
                raise ValueError(f"keys must have shape (n, {self.dim}) for this queue, got {tuple(keys.shape)}")
            if not keys.is_floating_point():
                raise TypeError(f"keys must be a floating-point tensor, got {keys.dtype}")
        except (ValueError, TypeError) as error:
            raise_on_all_ranks(error, (keys,), group=self.group)
        local = keys.detach().to(dtype=self.memory.dtype, device=self.memory.device)
        gathered = all_gather(local, group=self.group)  # a width that differs by rank raises here
        pushed = gathered.tensor
        # Checked on the gathered rows, which every rank holds alike: all refuse them together,
        # with no exchange of their own (after the cast: a float64 key too large for float32 is inf).
        finite = torch.isfinite(pushed).all(1)
        if not bool(finite.all()):
            owners = _owners(gathered.sizes, (~finite).nonzero().flatten().tolist())
            raise ValueError(
                f"enqueue: keys must be finite, got NaN or infinite values in the keys of rank(s) {owners} "
                f"(as {self.memory.dtype}); the queue is unchanged on every rank"
            )
        newest_first = pushed.flip(0)[: self.size]
        kept = min(int(self.count), self.size - newest_first.shape[0])
        # Older keys move down by the number pushed (a copy: source and target overlap).
        self.memory[newest_first.shape[0] : newest_first.shape[0] + kept] = self.memory[:kept].clone()
        self.memory[: newest_first.shape[0]] = newest_first
        self.count.fill_(newest_first.shape[0] + kept)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        memory, count = state_dict.get(prefix + "memory"), state_dict.get(prefix + "count")
        if memory is not None and count is not None:  # a missing key is reported by torch (strict=True)
            _check_saved_state(memory, count, self.memory)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        """Show size, dim and fill in ``repr``."""
        return f"size={self.size}, dim={self.dim}, count={int(self.count)}"


def _owners(sizes: tuple[int, ...], rows: list[int]) -> list[int]:
    """The ranks that contributed ``rows`` of a gather with ``sizes`` (rank order)."""
    ends = torch.tensor(sizes).cumsum(0)
    return sorted({int(torch.searchsorted(ends, row, right=True)) for row in rows})


def _check_saved_state(memory: object, count: object, expected: Tensor) -> None:
    """Refuse a saved queue that this queue cannot hold exactly, saying what was expected.

    Loading would otherwise cast another dtype silently, fail with a bare size mismatch, or carry a
    NaN into every later loss (the queue's keys are every rank's negatives).
    """
    size, dim = expected.shape
    if not isinstance(memory, Tensor) or not isinstance(count, Tensor):
        raise TypeError(
            f"a saved queue holds tensors memory ({size}, {dim}) and count (), got "
            f"{type(memory).__name__} and {type(count).__name__}"
        )
    if memory.shape != expected.shape or memory.dtype != expected.dtype:
        raise ValueError(
            f"a saved queue's memory must be {expected.dtype} of shape ({size}, {dim}) for this queue "
            f"(size={size}, dim={dim}), got {memory.dtype} of shape {tuple(memory.shape)}"
        )
    value = count.item() if count.numel() == 1 and not count.is_complex() and count.dtype != torch.bool else None
    if value is None or value != int(value) or not 0 <= value <= size:
        shown = count.item() if count.numel() == 1 else f"a tensor of shape {tuple(count.shape)}"
        raise ValueError(f"a saved queue's count must be one integer in [0, {size}], got {shown}")
    if not bool(torch.isfinite(memory[: int(value)]).all()):
        raise ValueError("a saved queue's memory must be finite, got NaN or infinite keys")
