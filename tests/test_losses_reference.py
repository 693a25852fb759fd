"""Plain float64 loop references for the losses and a small shared problem (encoder + global batch).

Imported by the loss tests and, through pickled functions, by their gloo workers.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist import info_nce, nt_xent, siglip, supcon

KINDS = ("clip", "clip_one_way", "ntxent", "ntxent_scale", "siglip", "supcon", "supcon_views", "supcon_views_scale")
"""``*_scale``: the loss gets the learnable ``logit_scale`` instead of its fixed temperature."""
NTXENT_TEMPERATURE, SUPCON_TEMPERATURE = 0.5, 0.3


def clip_reference(images: Tensor, texts: Tensor, scale: Tensor, symmetric: bool = True) -> Tensor:
    def one_direction(queries: Tensor, keys: Tensor) -> Tensor:
        total = queries.new_zeros(())
        for i in range(queries.shape[0]):
            logits = torch.stack([scale * (queries[i] @ keys[j]) for j in range(keys.shape[0])])
            total = total + torch.logsumexp(logits, 0) - logits[i]
        return total / queries.shape[0]

    image_to_text = one_direction(images, texts)
    return (image_to_text + one_direction(texts, images)) / 2 if symmetric else image_to_text


def ntxent_reference(z1: Tensor, z2: Tensor, scale: Tensor | float) -> Tensor:
    z = torch.cat([F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)])
    count = z.shape[0]
    total = z.new_zeros(())
    for i in range(count):
        positive = (i + count // 2) % count
        logits = torch.stack([z[i] @ z[j] * scale for j in range(count) if j != i])
        total = total + torch.logsumexp(logits, 0) - z[i] @ z[positive] * scale
    return total / count


def siglip_reference(images: Tensor, texts: Tensor, scale: Tensor, bias: Tensor) -> Tensor:
    total = images.new_zeros(())
    for i in range(images.shape[0]):
        for j in range(texts.shape[0]):
            sign = 1.0 if i == j else -1.0
            total = total - F.logsigmoid(sign * (scale * (images[i] @ texts[j]) + bias))
    return total / images.shape[0]


def supcon_reference(features: Tensor, labels: Tensor, scale: Tensor | float) -> Tensor:
    views = 1 if features.ndim == 2 else features.shape[1]
    flat = features.reshape(-1, features.shape[-1])
    flat_labels = [int(label) for label in labels for _ in range(views)]
    total, anchors = flat.new_zeros(()), 0
    for a in range(flat.shape[0]):
        positives = [p for p in range(flat.shape[0]) if p != a and flat_labels[p] == flat_labels[a]]
        if not positives:
            continue
        logits = torch.stack([flat[a] @ flat[j] * scale for j in range(flat.shape[0]) if j != a])
        lse = torch.logsumexp(logits, 0)
        total = total + sum(lse - flat[a] @ flat[p] * scale for p in positives) / len(positives)
        anchors += 1
    return total / anchors if anchors else flat.sum() * 0


def make_problem(seed: int, total: int, dtype: torch.dtype) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Encoder parameters (leaf tensors) and a global batch, the same on every process for a seed."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    params = {
        "w_image": draw(6, 5),
        "w_text": draw(4, 5),
        "log_scale": torch.tensor(math.log(1 / 0.2), dtype=dtype),
        "bias": torch.tensor(-1.5, dtype=dtype),
    }
    for param in params.values():
        param.requires_grad_()
    labels = torch.randint(0, 3, (total,), generator=generator)
    if total:
        labels[0] = 99  # a class seen once: single-view SupCon has an anchor without positives
    data = {"x_image": draw(total, 6), "x_text": draw(total, 4), "labels": labels}
    return params, data


def encode(params: dict[str, Tensor], data: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    images = F.normalize(data["x_image"] @ params["w_image"], dim=-1)
    return images, F.normalize(data["x_text"] @ params["w_text"], dim=-1)


def package_loss(
    kind: str,
    params: dict[str, Tensor],
    data: dict[str, Tensor],
    chunk_size: int | None,
    sizes: tuple[int, ...] | None,
    communication: Literal["gather", "ring"] = "gather",
    group: ProcessGroup | None = None,
) -> Tensor:
    images, texts = encode(params, data)
    scale = params["log_scale"].exp()
    options = {"chunk_size": chunk_size, "sizes": sizes, "communication": communication, "group": group}
    if kind in ("clip", "clip_one_way"):
        return info_nce(images, texts, scale, symmetric=kind == "clip", **options)  # type: ignore[arg-type]
    if kind.startswith("ntxent"):
        raw_1, raw_2 = data["x_image"] @ params["w_image"], data["x_text"] @ params["w_text"]
        given = scale if kind == "ntxent_scale" else None
        return nt_xent(raw_1, raw_2, given, temperature=NTXENT_TEMPERATURE, **options)  # type: ignore[arg-type]
    if kind == "siglip":
        return siglip(images, texts, scale, params["bias"], **options)  # type: ignore[arg-type]
    features = images if kind == "supcon" else torch.stack([images, texts], dim=1)
    given = scale if kind == "supcon_views_scale" else None
    return supcon(features, data["labels"], given, temperature=SUPCON_TEMPERATURE, **options)  # type: ignore[arg-type]


def reference_loss(kind: str, params: dict[str, Tensor], data: dict[str, Tensor]) -> Tensor:
    images, texts = encode(params, data)
    scale = params["log_scale"].exp()
    if kind in ("clip", "clip_one_way"):
        return clip_reference(images, texts, scale, symmetric=kind == "clip")
    if kind.startswith("ntxent"):
        raw_1, raw_2 = data["x_image"] @ params["w_image"], data["x_text"] @ params["w_text"]
        return ntxent_reference(raw_1, raw_2, scale if kind == "ntxent_scale" else 1 / NTXENT_TEMPERATURE)
    if kind == "siglip":
        return siglip_reference(images, texts, scale, params["bias"])
    features = images if kind == "supcon" else torch.stack([images, texts], dim=1)
    return supcon_reference(features, data["labels"], scale if kind == "supcon_views_scale" else 1 / SUPCON_TEMPERATURE)


def value_and_grads(loss: Tensor, params: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return loss.detach(), {
        name: torch.zeros_like(param) if grad is None else grad
        for (name, param), grad in zip(params.items(), grads, strict=True)
    }


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype == torch.float64:
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
