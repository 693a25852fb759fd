"""open_clip's ``ClipLoss`` and ``SigLipLoss``, with open_clip 3.3's signatures, on this package's exact losses.

In a training script of your own that builds open_clip's losses, change one line::

    from open_clip.loss import ClipLoss, SigLipLoss          # before
    from contrastive_dist.compat.open_clip import ClipLoss, SigLipLoss  # after

open_clip's own training script (``open_clip_train``) builds its loss with ``open_clip.create_loss``,
which reads the classes from ``open_clip.factory``: there an import changes nothing. :func:`install`
makes that factory build these drop-ins, and ``python -m contrastive_dist.compat.open_clip_train ARGS``
(or ``torchrun ... -m contrastive_dist.compat.open_clip_train ARGS``) runs open_clip's script with it.

The constructor and ``forward`` take open_clip's arguments and return what open_clip returns. What
changes is the distributed result: open_clip gathers into buffers sized like the local batch and
offsets labels by ``rank * batch_size``, so it needs the same batch size on every rank (uneven
batches raise in its gather, or hang) and, with ``local_loss=True``, averages per rank, which DDP's
gradient averaging turns into the global gradient only when every rank holds as many rows. Here
every rank's rows meet every rank's columns and the result follows the
[gradient contract][gradient-contract]: for any per-rank batch sizes, 0 included, every rank returns
the single-process loss over the concatenated batch (what open_clip's training script logs from
rank 0) and the DDP gradient is its gradient. On one process the value and gradients are open_clip's.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from torch import Tensor, nn

from contrastive_dist.losses import info_nce, siglip

__all__ = ["ClipLoss", "SigLipLoss", "install", "uninstall"]

_DIST_IMPLS = {None: "ring", "bidir": "ring", "shift": "ring", "reduce": "gather", "gather": "gather"}


def _returned(loss: Tensor, output_dict: bool) -> Tensor | dict[str, Tensor]:
    return {"contrastive_loss": loss} if output_dict else loss


class ClipLoss(nn.Module):
    """CLIP's symmetric InfoNCE with open_clip's ``ClipLoss`` signature, exact under data parallelism.

    Same as open_clip: the constructor's arguments, ``forward``'s arguments, the value and the
    gradients on one process (``logit_scale`` already exponentiated; ``logit_bias``, which a softmax
    ignores, gets a zero gradient), a tensor or ``{"contrastive_loss": loss}``.

    Different: under several processes the loss is that of the global batch for any per-rank batch
    sizes (see the module docstring). ``local_loss``, ``gather_with_grad`` and ``cache_labels`` only
    choose how open_clip computes its (approximate) result and are accepted and unused: every
    combination gives the exact one. ``rank`` and ``world_size`` are read from the process group at
    call time, so the values given are not used. ``use_horovod=True`` is refused (``ValueError``):
    this package runs on ``torch.distributed``.

    One line to change: ``from contrastive_dist.compat.open_clip import ClipLoss``.

    Args:
        local_loss: accepted, unused (the result is the exact global loss either way).
        gather_with_grad: accepted, unused (gradients always flow through the gather).
        cache_labels: accepted, unused (no labels are built).
        rank: accepted, unused (read from the process group).
        world_size: accepted, unused (read from the process group).
        use_horovod: must be ``False``.

    Shape:
        image_features, text_features: ``(n_r, D)``, normalised; logit_scale: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist.compat.open_clip import ClipLoss
        >>> images = F.normalize(torch.randn(4, 8), dim=-1).requires_grad_()
        >>> texts = F.normalize(torch.randn(4, 8), dim=-1)
        >>> loss = ClipLoss(local_loss=True, gather_with_grad=True)(images, texts, torch.tensor(10.0))
        >>> loss.backward()
        >>> ClipLoss()(images, texts, 10.0, output_dict=True).keys()
        dict_keys(['contrastive_loss'])
    """

    def __init__(
        self,
        local_loss: bool = False,
        gather_with_grad: bool = False,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        use_horovod: bool = False,
    ) -> None:
        super().__init__()
        if use_horovod:
            raise ValueError("use_horovod=True is not supported: contrastive_dist gathers with torch.distributed "
                             "(run under torchrun / DDP), got use_horovod=True")
        self.local_loss, self.gather_with_grad, self.cache_labels = local_loss, gather_with_grad, cache_labels
        self.rank, self.world_size, self.use_horovod = rank, world_size, use_horovod

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None = None,
        output_dict: bool = False,
    ) -> Any:
        """The symmetric CLIP loss of this rank's pairs against every rank's (open_clip's return type)."""
        loss = info_nce(image_features, text_features, logit_scale)
        if isinstance(logit_bias, Tensor):
            # A constant added to every logit leaves a softmax unchanged: its gradient is zero, as in
            # open_clip, and the bias stays in the graph (DDP expects a gradient for a used parameter).
            loss = loss + 0.0 * logit_bias.sum()
        return _returned(loss, output_dict)


class SigLipLoss(nn.Module):
    """SigLIP's pairwise sigmoid loss with open_clip's ``SigLipLoss`` signature, exact under data parallelism.

    Same as open_clip: the constructor's and ``forward``'s arguments, the value and the gradients on
    one process (open_clip divides the sum over this rank's ``n × N`` pairs by the local batch size
    ``n``; on one process that is the package's mean over rows), a tensor or
    ``{"contrastive_loss": loss}``.

    Different: under several processes, open_clip divides each rank's sum by its own batch size, so
    DDP's average is the global loss only for equal batch sizes, and its exchanges need them equal;
    here the loss is that of the global batch for any per-rank sizes, 0 included. ``dist_impl``
    picks the transport: ``"bidir"`` / ``"shift"`` (and ``None``, open_clip's ``"bidir"``) the ring,
    ``"reduce"`` / ``"gather"`` the gather; the result is the same. ``cache_labels`` is accepted and
    unused; ``rank`` and ``world_size`` are read from the process group at call time.

    One line to change: ``from contrastive_dist.compat.open_clip import SigLipLoss``.

    Args:
        cache_labels: accepted, unused.
        rank: accepted, unused (read from the process group).
        world_size: accepted, unused (read from the process group).
        dist_impl: ``None``, ``"bidir"``, ``"shift"``, ``"reduce"`` or ``"gather"``.

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale, logit_bias: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist.compat.open_clip import SigLipLoss
        >>> images, texts = F.normalize(torch.randn(4, 8), dim=-1), F.normalize(torch.randn(4, 8), dim=-1)
        >>> SigLipLoss(dist_impl="gather")(images, texts, torch.tensor(10.0), torch.tensor(-10.0)).shape
        torch.Size([])
    """

    def __init__(
        self,
        cache_labels: bool = False,
        rank: int = 0,
        world_size: int = 1,
        dist_impl: str | None = None,
    ) -> None:
        super().__init__()
        if dist_impl not in _DIST_IMPLS:
            raise ValueError(f"dist_impl must be one of {sorted(k for k in _DIST_IMPLS if k)} or None, "
                             f"got {dist_impl!r}")
        self.cache_labels, self.rank, self.world_size = cache_labels, rank, world_size
        self.dist_impl = dist_impl or "bidir"

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float,
        output_dict: bool = False,
    ) -> Any:
        """The sigmoid loss of this rank's images against every rank's texts (open_clip's return type)."""
        loss = siglip(image_features, text_features, logit_scale, logit_bias,
                      communication=_DIST_IMPLS[self.dist_impl])  # type: ignore[arg-type]
        return _returned(loss, output_dict)


class _NotProvided:
    """What open_clip's factory builds for a loss without a drop-in here: it says so, at construction."""

    def __init__(self, name: str, asked_by: str) -> None:
        self.name, self.asked_by = name, asked_by

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(
            f"open_clip's {self.name} ({self.asked_by}) has no exact drop-in in contrastive_dist, and "
            "contrastive_dist.compat.open_clip.install() is active: call contrastive_dist.compat.open_clip.uninstall() "
            f"to train with open_clip's own {self.name}, or train a CLIP or SigLIP model"
        )


_REPLACED: dict[str, object] = {}
"""open_clip's own classes in ``open_clip.factory``, while :func:`install` is active."""


def install() -> None:
    """Make ``open_clip.create_loss`` (open_clip's training script's loss) build these drop-ins; reversible.

    Sets ``ClipLoss`` and ``SigLipLoss`` in ``open_clip.factory``, where ``create_loss`` reads them
    (changing ``open_clip.loss`` would not reach it), so ``open_clip_train`` trains with the exact
    losses, ``--siglip`` and ``--local-loss --gather-with-grad`` included. CoCa's and the
    distillation losses subclass open_clip's own ``ClipLoss`` and have no drop-in here: while
    installed, asking the factory for one raises a ``ValueError`` that says so. Idempotent; imports
    open_clip (only here).

    Example:
        >>> from argparse import Namespace
        >>> import open_clip
        >>> from contrastive_dist.compat import open_clip as drop_ins
        >>> drop_ins.install()
        >>> args = Namespace(distill=False, model="ViT-B-32", siglip=False, local_loss=True, gather_with_grad=True,
        ...                  rank=0, world_size=1, horovod=False)  # what open_clip_train's flags give
        >>> type(open_clip.create_loss(args)) is drop_ins.ClipLoss
        True
        >>> drop_ins.uninstall()
        >>> open_clip.factory.ClipLoss is open_clip.loss.ClipLoss
        True
    """
    import open_clip.factory as factory

    replacements = {
        "ClipLoss": ClipLoss,
        "SigLipLoss": SigLipLoss,
        "CoCaLoss": _NotProvided("CoCaLoss", "a CoCa model"),
        "DistillClipLoss": _NotProvided("DistillClipLoss", "--distill"),
    }
    for name, replacement in replacements.items():
        _REPLACED.setdefault(name, getattr(factory, name))
        setattr(factory, name, replacement)


def uninstall() -> None:
    """Give ``open_clip.factory`` its own loss classes back (nothing to do if :func:`install` was not called).

    Example:
        >>> import open_clip
        >>> from contrastive_dist.compat import open_clip as drop_ins
        >>> drop_ins.install()
        >>> drop_ins.uninstall()
        >>> open_clip.factory.SigLipLoss is open_clip.loss.SigLipLoss
        True
    """
    factory = sys.modules.get("open_clip.factory")
    if factory is not None:
        for name, original in _REPLACED.items():
            setattr(factory, name, original)
    _REPLACED.clear()
