"""lightly's ``NTXentLoss``, ``DCLLoss`` and ``DCLWLoss``, with lightly 1.6's signatures, on the exact losses.

In a training script written for lightly, change one line::

    from lightly.loss import NTXentLoss                      # before
    from contrastive_dist.compat.lightly import NTXentLoss   # after

With ``gather_distributed=True`` lightly
gathers into buffers sized like the local batch and offsets labels by ``rank * batch_size``: it
needs the same batch size on every rank, and its mean over local rows makes DDP's average the
global gradient only when the sizes are equal. Here the loss follows the
[gradient contract][gradient-contract] for any per-rank sizes, 0 included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist.compat._groups import loss_group
from contrastive_dist.engine.gather import all_gather
from contrastive_dist.losses import SharedNegatives, dcl, info_nce, nt_xent
from contrastive_dist.queue import DistributedMemoryQueue

__all__ = ["DCLLoss", "DCLWLoss", "NTXentLoss", "negative_mises_fisher_weights"]


def negative_mises_fisher_weights(out0: Tensor, out1: Tensor, sigma: float = 0.5) -> Tensor:
    """The DCLW weight of each pair in this batch, as lightly has it: ``2 − n · softmax(out0_i · out1_i / σ)``.

    Detached. The same function as lightly's, for a ``weight_fn``: over the rows it is given (a rank's batch).
    :class:`DCLWLoss` takes the softmax over the global batch instead.

    Shape:
        out0, out1: ``(n, D)``; output: ``(n,)``.

    Example:
        >>> import torch
        >>> weights = negative_mises_fisher_weights(torch.eye(3), torch.eye(3))
        >>> torch.allclose(weights, torch.ones(3))
        True
    """
    similarity = (out0.detach() * out1.detach()).sum(dim=1) / sigma
    return 2 - out0.shape[0] * torch.softmax(similarity, dim=0)


def _positive(name: str, value: float) -> float:
    """``value`` as a float, after lightly's check that it is > 0 (a ``ValueError`` otherwise)."""
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return float(value)


def _gathering(gather_distributed: bool) -> bool:
    """The check lightly makes: gathering needs ``torch.distributed`` (a ``ValueError`` otherwise)."""
    if gather_distributed and not dist.is_available():
        raise ValueError("gather_distributed is True but torch.distributed is not available: set "
                         "gather_distributed=False or install a torch build with distributed support")
    return gather_distributed


def _bank_shape(memory_bank_size: int | Sequence[int]) -> tuple[int, int] | None:
    """``None`` for no bank, else ``(num_features, dim)``; lightly's checks, as ``ValueError``."""
    shape = (memory_bank_size,) if isinstance(memory_bank_size, int) else tuple(memory_bank_size)
    if any(x < 0 for x in shape):
        raise ValueError(f"memory_bank_size must have non-negative entries, got {memory_bank_size}")
    if shape == (0,):
        return None
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"memory_bank_size must be 0 (no bank) or a (num_features, dim) tuple, got "
                         f"{memory_bank_size}")
    return shape[0], shape[1]


class NTXentLoss(nn.Module):
    """SimCLR's NT-Xent (or, with a memory bank, MoCo's InfoNCE) with lightly's ``NTXentLoss`` signature.

    Same as lightly: the arguments, ``forward(out0, out1)`` (both L2-normalised inside), the value
    and gradients on one process; without a bank, each of the ``2n`` views must pick its partner
    among the other ``2n − 1``; with a bank of ``(num_features, dim)``, each ``out0`` row must pick
    its ``out1`` row against the bank's keys only, and the bank starts as lightly's does (random unit
    keys, drawn from the same random stream) and takes ``out1`` after the loss when ``out0``
    requires gradient.

    Different: ``gather_distributed=True`` gives the loss of the global batch for any per-rank batch
    sizes, and its bank is one [`DistributedMemoryQueue`][contrastive_dist.DistributedMemoryQueue],
    the same on every rank (rank 0's initial keys are taken by all). ``gather_distributed=False``
    keeps lightly's per-rank meaning (each rank's batch and bank alone) and so is not exact across
    ranks. A bank keeps the last ``num_features`` keys; lightly drops the part of a batch that
    passes the end of its buffer, so the two banks differ after a batch size that does not divide
    ``num_features``. A temperature ≤ 0 is refused (lightly accepts a negative one).

    One line to change: ``from contrastive_dist.compat.lightly import NTXentLoss``.

    Args:
        temperature: the softmax temperature, > 0.
        memory_bank_size: ``0`` (no bank) or ``(num_features, dim)``.
        gather_distributed: the global batch's negatives (and bank) across ranks, or each rank's own.

    Shape:
        out0, out1: ``(n_r, D)``; output: ``()``.

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.lightly import NTXentLoss
        >>> criterion = NTXentLoss(temperature=0.1, memory_bank_size=(16, 8), gather_distributed=True)
        >>> out0, out1 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
        >>> criterion(out0, out1).backward()  # then out1's 4 keys enter the bank
    """

    def __init__(
        self,
        temperature: float = 0.5,
        memory_bank_size: int | Sequence[int] = 0,
        gather_distributed: bool = False,
    ) -> None:
        super().__init__()
        self.temperature = _positive("temperature", temperature)
        self.gather_distributed = _gathering(gather_distributed)
        shape = _bank_shape(memory_bank_size)
        self.memory_bank: DistributedMemoryQueue | None = None
        self._bank_shared = False
        if shape is not None:
            self.memory_bank = DistributedMemoryQueue(*shape)
            initial = F.normalize(torch.randn(shape), dim=-1)  # lightly's draw: the same random stream after it
            # Newest first, so that the first keys pushed replace lightly's first rows.
            self.memory_bank.load_state_dict({"memory": initial.flip(0), "count": torch.tensor(shape[0])})

    def forward(self, out0: Tensor, out1: Tensor) -> Tensor:
        """The loss of this rank's pairs against every rank's (or this rank's, see the class docstring)."""
        group = loss_group(self.gather_distributed)
        out0, out1 = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
        bank = self.memory_bank
        if bank is None:
            return nt_xent(out0, out1, temperature=self.temperature, group=group)
        if not self._bank_shared:
            bank.group = group
            self._share_initial_bank(bank)
        keys = SharedNegatives(bank.negatives.keys.to(out0.dtype))
        # Every batch row has id 0: the other rows of the batch leave the softmax, which holds the
        # row's positive and the bank only, as in lightly (and MoCo).
        ids = torch.zeros(out0.shape[0], dtype=torch.long, device=out0.device)
        loss = info_nce(out0, out1, temperature=self.temperature, symmetric=False, negatives=keys, ids=ids,
                        same_id="mask", group=group)
        if out0.requires_grad:
            bank.enqueue(out1)
        return loss

    def _share_initial_bank(self, bank: DistributedMemoryQueue) -> None:
        """Every rank takes rank 0's initial keys, so that the bank is the same everywhere."""
        self._bank_shared = True
        if bank.group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            own = bank.memory if dist.get_rank() == 0 else bank.memory[:0]
            with torch.no_grad():
                bank.memory.copy_(all_gather(own.contiguous()).tensor)


class DCLLoss(nn.Module):
    """Decoupled contrastive learning with lightly's ``DCLLoss`` signature, on :func:`~contrastive_dist.dcl`.

    Same as lightly: the arguments, ``forward(out0, out1)`` (both L2-normalised inside), ``weight_fn``
    called as lightly calls it (``weight_fn(out0, out1)`` for ``out0``'s anchors, ``weight_fn(out1,
    out0)`` for ``out1``'s, on the normalised rows of this rank), the value and gradients on one process.

    Different: ``gather_distributed=True`` gives the loss of the global batch for any per-rank batch
    sizes (lightly needs equal ones); an anchor with no negative (a global batch of one sample) has
    loss 0 where lightly's is ``-inf``; a temperature ≤ 0 is refused.

    One line to change: ``from contrastive_dist.compat.lightly import DCLLoss``.

    Args:
        temperature: the softmax temperature, > 0.
        weight_fn: ``(out0, out1) -> (n,)`` the positive term's weight per sample, or ``None`` (1).
        gather_distributed: the global batch's negatives across ranks, or each rank's own.

    Shape:
        out0, out1: ``(n_r, D)``, rows of the same sample paired; output: ``()``.

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.lightly import DCLLoss
        >>> out0, out1 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
        >>> DCLLoss(temperature=0.1, gather_distributed=True)(out0, out1).backward()
    """

    def __init__(self, temperature: float = 0.1, weight_fn: Callable[[Tensor, Tensor], Tensor] | None = None,
                 gather_distributed: bool = False) -> None:
        super().__init__()
        self.temperature, self.weight_fn = _positive("temperature", temperature), weight_fn
        self.gather_distributed = _gathering(gather_distributed)
        self.sigma: float | None = None

    def forward(self, out0: Tensor, out1: Tensor) -> Tensor:
        """The loss of this rank's pairs against every rank's (or this rank's alone)."""
        group = loss_group(self.gather_distributed)
        weights = None
        if self.weight_fn is not None:
            first, second = F.normalize(out0, dim=1), F.normalize(out1, dim=1)
            weights = torch.stack((self.weight_fn(first, second), self.weight_fn(second, first)), dim=1)
        return dcl(out0, out1, temperature=self.temperature, sigma=self.sigma, positive_weight=weights, group=group)


class DCLWLoss(DCLLoss):
    """DCLW with lightly's ``DCLWLoss`` signature: :class:`DCLLoss` with the von Mises–Fisher weight.

    Same as lightly on one process. Different: the weight ``2 − N · softmax(cos / σ)`` runs over the
    ``N`` samples of the global batch with ``gather_distributed=True`` (lightly's over each rank's
    batch), so that the loss is the single-process loss of the global batch.

    Args:
        temperature: the softmax temperature, > 0.
        sigma: the weight's ``σ`` > 0.
        gather_distributed: the global batch across ranks, or each rank's own.

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.lightly import DCLWLoss
        >>> out0, out1 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
        >>> DCLWLoss(temperature=0.1, sigma=0.5)(out0, out1).backward()
    """

    def __init__(self, temperature: float = 0.1, sigma: float = 0.5, gather_distributed: bool = False) -> None:
        super().__init__(temperature=temperature, gather_distributed=gather_distributed)
        self.sigma = _positive("sigma", sigma)
