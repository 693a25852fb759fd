"""CLIP's symmetric InfoNCE loss over the global batch of every rank (Radford et al., 2021)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist._dist import get_world_size
from contrastive_dist.gather import all_gather_many
from contrastive_dist.losses._checks import (
    check_chunk_size,
    check_pair,
    check_temperature,
    resolve_scale,
    validated_on_all_ranks,
)
from contrastive_dist.losses._chunked import contract_factor, local_cross_entropy_sum
from contrastive_dist.losses._module import TemperatureLoss
from contrastive_dist.losses._ring_losses import Communication, check_communication, ring_checks, ring_info_nce

__all__ = ["DistributedInfoNCE", "info_nce"]


def info_nce(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor | float | None = None,
    *,
    temperature: float = 0.07,
    symmetric: bool = True,
    chunk_size: int | None = None,
    group: ProcessGroup | None = None,
    sizes: Sequence[int] | None = None,
    communication: Communication = "gather",
) -> Tensor:
    """CLIP loss of this rank's pairs against every rank's pairs; exact under data parallelism.

    Image ``i`` must pick text ``i`` among all ``N`` texts of the global batch (cross-entropy
    over ``logit_scale · image @ textᵀ``), and with ``symmetric=True`` text ``i`` must pick
    image ``i`` too; the two directions are averaged. ``symmetric=False`` keeps image→text only.

    The features are used as given: normalise them in the model, as CLIP does. Each rank
    computes its local rows against the gathered columns and returns ``(W / N) · Σ_i ℓ_i``, so
    the mean over ranks of the returned values is the single-process loss and DDP's gradient
    averaging gives its exact gradient, for any per-rank batch sizes (including 0). Without a
    process group this is the plain single-process loss.

    Args:
        image_features: this rank's image embeddings.
        text_features: this rank's text embeddings, row ``i`` paired with image row ``i``.
        logit_scale: the similarity multiplier, already exponentiated (e.g. a learnable
            ``model.logit_scale.exp()``, as in CLIP); receives gradients. Default ``1 / temperature``.
        temperature: used when ``logit_scale`` is ``None``; must be > 0.
        symmetric: average image→text and text→image (``True``) or image→text only.
        chunk_size: compute ``chunk_size`` rows at a time against all gathered columns, so
            at most ``chunk_size × N`` logits exist at once; same value and gradients.
        group: the process group (default: the world).
        sizes: every rank's batch size, if known (skips the size exchange).
        communication: ``"gather"`` gathers every rank's features onto every rank (memory
            ``O(N·D + chunk·N)``); ``"ring"`` keeps the images here and passes text blocks round
            the ring, each logit block serving both directions (memory ``O(n_r·D + chunk·max_r n_r)``,
            independent of the number of ranks); same value and gradients.

    Returns:
        A scalar tensor: this rank's share of the global loss (0 for an empty global batch),
        float32 (float64 for float64 features): the core runs in float32 with autocast off,
        so fp16/bf16 features and ``torch.autocast`` work; gradients come back in the inputs' dtypes.

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import info_nce
        >>> images = F.normalize(torch.randn(4, 16), dim=-1).requires_grad_()
        >>> texts = F.normalize(torch.randn(4, 16), dim=-1)
        >>> logit_scale = torch.tensor(1 / 0.07).log().requires_grad_()
        >>> loss = info_nce(images, texts, logit_scale.exp())
        >>> loss.backward()
        >>> loss.shape, logit_scale.grad is not None
        (torch.Size([]), True)

    """
    with validated_on_all_ranks((image_features, text_features), group=group, sizes=ring_checks(communication, sizes)):
        image_features, text_features = check_pair("image_features", image_features, "text_features", text_features)
        scale = resolve_scale(logit_scale, check_temperature(temperature), image_features)
        chunk_size = check_chunk_size(chunk_size)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        communication = check_communication(communication)
    if communication == "ring":
        return ring_info_nce(
            image_features, text_features, scale, symmetric=symmetric, chunk_size=chunk_size, group=group, sizes=sizes
        )
    world_size = get_world_size(group)
    if not symmetric:
        gathered = all_gather_many((text_features,), group=group, sizes=sizes)
        all_texts = gathered.tensors[0]
        total = local_cross_entropy_sum(image_features, all_texts, scale, text_features, chunk_size=chunk_size)
        return total * contract_factor(sum(gathered.sizes), world_size)
    gathered = all_gather_many((image_features, text_features), group=group, sizes=sizes)
    all_images, all_texts = gathered.tensors
    image_to_text = local_cross_entropy_sum(image_features, all_texts, scale, text_features, chunk_size=chunk_size)
    text_to_image = local_cross_entropy_sum(text_features, all_images, scale, image_features, chunk_size=chunk_size)
    return (image_to_text + text_to_image) * (0.5 * contract_factor(sum(gathered.sizes), world_size))


class DistributedInfoNCE(TemperatureLoss):
    """CLIP loss over the global batch; holds the options of :func:`info_nce`.

    Args:
        temperature: ``1 / logit_scale`` when ``forward`` gets no ``logit_scale``; > 0.
        symmetric: average image→text and text→image, or image→text only.
        chunk_size: rows per block (bounded memory, same result); ``None``: all at once.
        group: the process group (default: the world).
        communication: ``"gather"`` or ``"ring"`` (per-rank memory independent of the number of
            ranks); see :func:`info_nce`.

    Shape:
        image_features, text_features: ``(n_r, D)``; logit_scale: ``()``; output: ``()``.

    Example:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from contrastive_dist import DistributedInfoNCE
        >>> criterion = DistributedInfoNCE(temperature=0.07, chunk_size=2)
        >>> images = F.normalize(torch.randn(5, 8), dim=-1).requires_grad_()
        >>> texts = F.normalize(torch.randn(5, 8), dim=-1).requires_grad_()
        >>> loss = criterion(images, texts)
        >>> loss.backward()

    """

    def __init__(
        self,
        *,
        temperature: float = 0.07,
        symmetric: bool = True,
        chunk_size: int | None = None,
        group: ProcessGroup | None = None,
        communication: Communication = "gather",
    ) -> None:
        super().__init__(temperature=temperature, chunk_size=chunk_size, group=group, communication=communication)
        if not isinstance(symmetric, bool):
            raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
        self.symmetric = symmetric

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float | None = None,
        *,
        sizes: Sequence[int] | None = None,
    ) -> Tensor:
        """Return this rank's share of the loss; see :func:`info_nce`."""
        return info_nce(
            image_features,
            text_features,
            logit_scale,
            temperature=self.temperature,
            symmetric=self.symmetric,
            chunk_size=self.chunk_size,
            group=self.group,
            sizes=sizes,
            communication=self.communication,
        )

    def extra_repr(self) -> str:
        """Show the options in ``repr``."""
        return f"{super().extra_repr()}, symmetric={self.symmetric}"
