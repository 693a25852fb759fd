"""siglip-kernel's ``SigLIPPlusLoss``, ``DistributedSigLIPPlusLoss`` and ``DistributedSigLIPLoss`` (0.1.2's signatures).

Change one import::

    from siglip_kernel import DistributedSigLIPPlusLoss                        # before
    from contrastive_dist.compat.siglip_kernel import DistributedSigLIPPlusLoss  # after

The constructors and ``forward`` take siglip-kernel's arguments and return what it returns; nothing
here imports siglip-kernel, and everything runs on the CPU too. SigLIP+ is siglip-kernel's definition
(``L = (1/(N·M)) Σ_ij v_ij (softplus(s_ij) − s_ij y_ij)``: ``N`` images against ``M`` captions, a pair a
positive where the group ids are equal, weighted ``α/k_i + β/k'_j`` with ``α = β = ½`` when
``symmetric``, or soft labels), computed by :func:`~contrastive_dist.siglip` with ``image_ids=`` and
``text_ids=``. What changes under several processes: siglip-kernel's distributed losses need the same
``N`` and ``M`` on every rank (a mismatch hangs) and return each rank's stripe of the loss; here any
per-rank counts work, 0 included, and every rank returns the global loss (its gradient the rank's share:
the [gradient contract][gradient-contract]), the process group read at call time (``rank`` and
``world_size`` are accepted and unused). ``overlap``, ``num_groups`` and ``chunk_size=0`` (its
adaptive chunk) only choose how siglip-kernel computes and are accepted; a positive ``chunk_size`` is
the rows a block here too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist.engine.gather import all_gather
from contrastive_dist.losses import siglip
from contrastive_dist.losses._captions import count_in, plus_loss
from contrastive_dist.losses._options import Communication

__all__ = ["DistributedSigLIPLoss", "DistributedSigLIPPlusLoss", "SigLIPPlusLoss"]

_LOG_SCALE_RANGE = (math.log(0.01), math.log(100.0))  # siglip-kernel clamps the learnt log-scale to this


def _communication(strategy: str) -> Communication:
    if strategy not in ("ring", "gather"):
        raise ValueError(f"strategy must be 'ring' or 'gather', got {strategy!r} (the loss is always the global "
                         "batch's here: siglip-kernel's 'local' strategy has no counterpart)")
    return "ring" if strategy == "ring" else "gather"


class SigLIPPlusLoss(nn.Module):
    """siglip-kernel's ``SigLIPPlusLoss``: M captions against N images, positives by group id.

    Same: the constructor, ``forward((images, captions), img_gid, txt_gid)`` (the features
    L2-normalised inside, the learnt ``logit_scale`` clamped to ``[ln 0.01, ln 100]``, ids defaulting to
    ``arange``), the returned ``{"total_loss", "logit_scale", "n_positives"}``, the parameters
    ``logit_scale`` and ``logit_bias`` (a buffer without ``use_bias``). Different: under a process group
    the loss is the global batch's (see the module docstring).

    Example:
        >>> import torch
        >>> from contrastive_dist.compat.siglip_kernel import SigLIPPlusLoss
        >>> criterion = SigLIPPlusLoss()
        >>> images, captions = torch.randn(3, 8), torch.randn(7, 8)
        >>> out = criterion((images, captions), torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1, 1, 2, 2, 2]))
        >>> out["n_positives"].item()
        7
    """

    def __init__(self, temperature: float = 0.07, symmetric: bool = True, use_bias: bool = True,
                 bias_init: float = 0.0, soft_weighting: bool = True, soft_label: bool = False,
                 chunk_size: int = 0) -> None:  # fmt: skip
        super().__init__()
        if not soft_weighting and not soft_label:
            raise NotImplementedError("soft_weighting=False with soft_label=False is not a SigLIP+ weighting "
                                      "(siglip-kernel does not implement it either)")
        self.symmetric, self.soft_label, self.chunk_size = symmetric, soft_label, chunk_size
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / temperature)))
        if use_bias:
            self.logit_bias = nn.Parameter(torch.tensor(float(bias_init)))
        else:
            self.register_buffer("logit_bias", torch.tensor(0.0))
        self._communication: Communication = "gather"
        self._group: Any = None

    def forward(self, embeddings: Any, img_gid: Tensor | None = None, txt_gid: Tensor | None = None
                ) -> dict[str, Tensor]:  # fmt: skip
        """``{"total_loss": L, "logit_scale": exp(clamped log-scale), "n_positives": Σ_i k_i}`` (global)."""
        images, captions = (F.normalize(features, dim=-1) for features in embeddings)
        device = images.device
        image_ids = torch.arange(images.shape[0], device=device) if img_gid is None else img_gid.long()
        text_ids = torch.arange(captions.shape[0], device=device) if txt_gid is None else txt_gid.long()
        log_scale = self.logit_scale.clamp(*_LOG_SCALE_RANGE)
        loss = plus_loss(images, captions, log_scale.exp(), self.logit_bias, image_ids, text_ids,
                         symmetric=self.symmetric, soft_label=self.soft_label, chunk_size=self.chunk_size or None,
                         communication=self._communication, group=self._group)  # fmt: skip
        loss = loss if loss.dtype == torch.float64 else loss.float()  # half inputs: fp32, as siglip-kernel's
        return {"total_loss": loss, "logit_scale": log_scale.exp().detach(),
                "n_positives": self._positives(image_ids, text_ids)}  # fmt: skip

    def _positives(self, image_ids: Tensor, text_ids: Tensor) -> Tensor:
        """Σ_i k_i over the global batch: the pairs with equal ids."""
        every_image, every_text = (all_gather(ids, group=self._group).tensor for ids in (image_ids, text_ids))
        return count_in(every_image, every_text).sum()


class DistributedSigLIPPlusLoss(SigLIPPlusLoss):
    """siglip-kernel's ``DistributedSigLIPPlusLoss``, for any per-rank counts; ``strategy`` picks the transport.

    Same as :class:`SigLIPPlusLoss`, with siglip-kernel's distributed constructor; ``forward`` needs the
    ids. ``process_group`` is the group (default: the world); ``strategy="ring"`` (siglip-kernel's only
    route, the default) or ``"gather"`` maps onto ``communication=``. Every rank returns the global loss.
    """

    def __init__(self, temperature: float = 0.07, symmetric: bool = True, use_bias: bool = True,
                 bias_init: float = 0.0, soft_label: bool = False, chunk_size: int = 0,
                 num_groups: int | None = None, rank: int = 0, world_size: int = 1, process_group: Any = None,
                 overlap: bool = True, strategy: str = "ring") -> None:  # fmt: skip
        super().__init__(temperature, symmetric, use_bias, bias_init, True, soft_label, chunk_size)
        self.num_groups, self.rank, self.world_size, self.overlap = num_groups, rank, world_size, overlap
        self.process_group, self.strategy = process_group, strategy
        self._communication, self._group = _communication(strategy), process_group

    def forward(self, embeddings: Any, img_gid: Tensor | None = None, txt_gid: Tensor | None = None
                ) -> dict[str, Tensor]:  # fmt: skip
        """See :meth:`SigLIPPlusLoss.forward`; the ids are required, as in siglip-kernel."""
        if img_gid is None or txt_gid is None:
            raise ValueError("DistributedSigLIPPlusLoss needs img_gid and txt_gid (one group id per image and caption)")
        return super().forward(embeddings, img_gid, txt_gid)


class DistributedSigLIPLoss(nn.Module):
    """siglip-kernel's ``DistributedSigLIPLoss`` (plain SigLIP, one caption per image), for any per-rank sizes.

    ``forward(image_features, text_features, logit_scale, logit_bias=None)``: the scale already
    exponentiated, the features as given. siglip-kernel divides each rank's rows by its batch size, so
    the mean over its ranks is ``(1/B) Σ_ij −log σ(z_ij s_ij)`` over the global batch: what every rank
    returns here (:func:`~contrastive_dist.siglip`).
    """

    def __init__(self, chunk_size: int = 0, strategy: str = "ring", rank: int = 0, world_size: int = 1,
                 process_group: Any = None, overlap: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.chunk_size, self.strategy, self.rank, self.world_size = chunk_size, strategy, rank, world_size
        self.process_group, self.overlap = process_group, overlap
        self._communication = _communication(strategy)

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                logit_bias: Tensor | None = None) -> Tensor:  # fmt: skip
        """The global SigLIP loss (siglip-kernel's normalisation)."""
        bias = 0.0 if logit_bias is None else logit_bias
        return siglip(image_features, text_features, logit_scale, bias, chunk_size=self.chunk_size or None,
                      group=self.process_group, communication=self._communication)  # fmt: skip
