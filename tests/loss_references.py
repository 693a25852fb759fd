"""Plain float64 loop references of every loss, a shared problem (encoder + global batch), and the package's call.

Each reference gives the per-row losses ``ℓ_i`` of the whole global batch, written as loops over
rows and columns straight from the definitions; the mean, the weighted mean ``Σ w_i ℓ_i / Σ w_i``
and SupCon's mean over anchors with positives are derived from them in one place. :data:`REGISTRY`
holds one entry per loss (its reference, its call, what it takes): a new loss is one entry there.
Imported by the loss tests and, through pickled functions, by their gloo workers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from contrastive_dist import SharedNegatives, dcl, hcl, info_nce, nt_xent, siglip, supcon

DCLW_SIGMA = 0.5
MODES = ("mean", "weighted", "none")
"""``weighted``: ``weight=``; ``none``: ``reduction="none"``, differentiated through ``Σ u_i ℓ_i`` (random ``u``)."""
TEMPERATURE = {"ntxent": 0.5, "supcon": 0.3}


def _same(ids: Tensor | None, i: int, other_ids: Tensor | None, j: int) -> bool:
    return ids is not None and other_ids is not None and j < len(other_ids) and int(ids[i]) == int(other_ids[j])


def _softmax_row(logits: list[Tensor], positives: list[int], masked: list[int]) -> Tensor:
    """``logsumexp`` over the candidates (every column not ``masked``) minus the mean of the positives' logits."""
    candidates = [logit for j, logit in enumerate(logits) if j not in masked]
    return torch.logsumexp(torch.stack(candidates), 0) - sum(logits[p] for p in positives) / len(positives)


def _targets(i: int, positive: int, columns: int, ids: Tensor | None, column_ids: Tensor | None,
             same_id: str) -> tuple[list[int], list[int]]:
    """The positives and masked columns of row ``i`` (its positive column ``positive``), written out."""
    sharing = [j for j in range(columns) if _same(ids, i, column_ids, j)]
    if same_id == "positive" and ids is not None:
        return sharing, []
    return [positive], [j for j in sharing if j != positive]


def clip_rows(images: Tensor, texts: Tensor, scale: Tensor, negatives: Tensor | None, symmetric: bool,
              ids: Tensor | None = None, negative_ids: Tensor | None = None, same_id: str = "mask") -> Tensor:
    columns = texts if negatives is None else torch.cat([texts, negatives])
    column_ids = None if ids is None else (ids if negative_ids is None else torch.cat([ids, negative_ids]))
    rows = []
    for i in range(images.shape[0]):
        logits = [scale * images[i] @ c for c in columns]
        row = _softmax_row(logits, *_targets(i, i, len(columns), ids, column_ids, same_id))
        if symmetric:
            logits = [scale * texts[i] @ m for m in images]
            row = (row + _softmax_row(logits, *_targets(i, i, len(images), ids, ids, same_id))) / 2
        rows.append(row)
    return torch.stack(rows) if rows else images.sum(1) * 0


def ntxent_rows(z1: Tensor, z2: Tensor, scale: Tensor | float, ids: Tensor | None = None,
                same_id: str = "mask") -> Tensor:
    z = torch.cat([F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)])
    count = z1.shape[0]
    both_ids = None if ids is None else torch.cat([ids, ids])
    anchors = []
    for a in range(2 * count):
        logits = [scale * z[a] @ z[j] for j in range(2 * count)]
        positives, masked = _targets(a, (a + count) % (2 * count), 2 * count, both_ids, both_ids, same_id)
        anchors.append(_softmax_row(logits, [p for p in positives if p != a], masked + [a]))  # never itself
    return torch.stack([(anchors[i] + anchors[i + count]) / 2 for i in range(count)]) if count else z1.sum(1) * 0


def dcl_rows(z1: Tensor, z2: Tensor, scale: Tensor, sigma: float | None = None, ids: Tensor | None = None) -> Tensor:
    """Each sample's DCL loss: its two anchors' mean of ``−v l_{a,a'} + logsumexp`` over the other samples' views."""
    z = torch.cat([F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)])
    count = z1.shape[0]
    cosines = [z[i] @ z[i + count] for i in range(count)]
    weights = [1.0] * count
    if sigma is not None and count:  # DCLW: the von Mises-Fisher weight over the whole batch, detached
        soft = torch.softmax(torch.stack(cosines).detach() / sigma, dim=0)
        weights = [2 - count * soft[i] for i in range(count)]
    anchors = []
    for a in range(2 * count):
        own = a % count
        negatives = [scale * z[a] @ z[j] for j in range(2 * count)
                     if j % count != own and not _same(ids, own, ids, j % count)]
        if not negatives:  # no negative: no loss
            anchors.append(z1.sum() * 0)
            continue
        anchors.append(torch.logsumexp(torch.stack(negatives), 0) - weights[own] * scale * cosines[own])
    return torch.stack([(anchors[i] + anchors[i + count]) / 2 for i in range(count)]) if count else z1.sum(1) * 0


def siglip_rows(images: Tensor, texts: Tensor, scale: Tensor, bias: Tensor, ids: Tensor | None = None,
                same_id: str = "mask") -> Tensor:
    rows = []
    for i in range(images.shape[0]):
        positives, masked = _targets(i, i, texts.shape[0], ids, ids, same_id)
        terms = [-F.logsigmoid((1 if j in positives else -1) * (scale * images[i] @ text + bias))
                 for j, text in enumerate(texts) if j not in masked]
        rows.append(torch.stack(terms).sum())
    return torch.stack(rows) if rows else images.sum(1) * 0


def supcon_rows(features: Tensor, labels: Tensor, scale: Tensor | float) -> tuple[Tensor, Tensor]:
    """Per-anchor losses shaped like ``features[..., 0]`` (0 without positives), and which anchors have positives."""
    flat = features.reshape(-1, features.shape[-1])
    views = 1 if features.ndim == 2 else features.shape[1]
    flat_labels = [int(label) for label in labels for _ in range(views)]
    rows, counted = [], []
    for a in range(flat.shape[0]):
        positives = [p for p in range(flat.shape[0]) if p != a and flat_labels[p] == flat_labels[a]]
        counted.append(bool(positives))
        if not positives:
            rows.append(flat[a].sum() * 0)
            continue
        lse = torch.logsumexp(torch.stack([scale * flat[a] @ flat[j] for j in range(flat.shape[0]) if j != a]), 0)
        rows.append(sum(lse - scale * flat[a] @ flat[p] for p in positives) / len(positives))
    shape = features.shape[:-1]
    if not rows:
        return features.sum(-1) * 0, torch.zeros(shape, dtype=torch.bool)
    return torch.stack(rows).reshape(shape), torch.tensor(counted).reshape(shape)


def make_problem(seed: int, total: int, dtype: torch.dtype, negatives: int = 0) -> tuple[dict[str, Tensor], dict]:
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
    weight = torch.rand(total, generator=generator, dtype=torch.float64).to(dtype) * 2
    weight[::3] = 0.0  # zero weights are allowed
    data = {
        "x_image": draw(total, 6),
        "x_text": draw(total, 4),
        "labels": labels,
        "weight": weight,
        "upstream": draw(total, 2),
        "x_negative": draw(negatives, 4),
        "shared": F.normalize(draw(4, 5), dim=-1),
        # Few distinct ids: duplicates inside a rank and across ranks; some negatives share a row's id.
        "ids": torch.randint(0, max(total // 2, 1), (total,), generator=generator),
        "negative_ids": torch.randint(0, max(total // 2, 1), (negatives,), generator=generator),
        "shared_ids": torch.randint(0, max(total // 2, 1), (4,), generator=generator),
    }
    return params, data


def encode(params: dict[str, Tensor], data: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    images = F.normalize(data["x_image"] @ params["w_image"], dim=-1)
    return images, F.normalize(data["x_text"] @ params["w_text"], dim=-1)


def own_negatives(params: dict[str, Tensor], x_negative: Tensor) -> Tensor:
    return F.normalize(x_negative @ params["w_text"], dim=-1)


def hcl_rows(z1: Tensor, z2: Tensor, scale: Tensor | float, beta: float, tau_plus: float,
             ids: Tensor | None = None) -> Tensor:
    """Each sample's HCL loss, its two anchors' mean, as the paper's code forms it: ``neg``, ``imp``, ``Ng``, the clamp.

    With ids, a sample's negatives leave out every view of the samples that share its id (their count is ``N``).
    """
    z = torch.cat([F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)])
    count = z1.shape[0]
    anchors = []
    for a in range(2 * count):
        own = a % count
        logits = [scale * z[a] @ z[j] for j in range(2 * count)
                  if j % count != own and not _same(ids, own, ids, j % count)]
        if not logits:  # no negative: no loss
            anchors.append(z1.sum() * 0)
            continue
        pos = torch.exp(scale * z[a] @ z[(a + count) % (2 * count)])
        neg = torch.exp(torch.stack(logits))
        imp = (beta * neg.log()).exp()
        reweight_neg = (imp * neg).sum() / imp.mean()
        negatives = len(logits)
        ng = (-tau_plus * negatives * pos + reweight_neg) / (1 - tau_plus)
        ng = torch.clamp(ng, min=negatives * torch.exp(-torch.as_tensor(scale, dtype=torch.float64)))  # M e^{-1/t}
        anchors.append(-torch.log(pos / (pos + ng)))
    return torch.stack([(anchors[i] + anchors[i + count]) / 2 for i in range(count)]) if count else z1.sum(1) * 0


class Loss(NamedTuple):
    """One loss of the test matrix: its float64 loop reference, the package's call, and what the call takes.

    Attributes:
        reference: ``(scale, params, data, negatives, ids, negative_ids, same_id) -> ℓ`` per row of the global
            batch (SupCon: per anchor), from the plain loops above.
        call: ``(scale, params, data, options) -> value``: the package's loss on this rank's ``data``.
        temperature: the fixed temperature the loss gets without a learnable scale, or ``None``: it gets
            ``params["log_scale"].exp()``.
        same_id: the loss takes ``same_id=`` (ids as positives or masks); else ids only mask (DCL, HCL) or
            none are taken (SupCon: its labels).
        negatives: the loss takes extra negatives (InfoNCE).
        gram: its rows are its own columns (NT-Xent, SupCon, DCL, HCL: pairs of tiles).
        ids: the loss takes ``ids=``.
    """

    reference: Callable[..., Tensor]
    call: Callable[..., Tensor]
    temperature: float | None = None
    same_id: bool = False
    negatives: bool = False
    gram: bool = False
    ids: bool = True


def _two_views(params: dict[str, Tensor], data: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The raw (not normalised) views of NT-Xent, DCL and HCL: each loss normalises them itself."""
    return data["x_image"] @ params["w_image"], data["x_text"] @ params["w_text"]


def _supcon(views: int) -> Loss:
    def features(params: dict[str, Tensor], data: dict[str, Tensor]) -> Tensor:
        images, texts = encode(params, data)
        return images if views == 1 else torch.stack([images, texts], dim=1)

    return Loss(
        reference=lambda scale, params, data, *_: supcon_rows(features(params, data), data["labels"], scale)[0],
        call=lambda scale, params, data, options: supcon(features(params, data), data["labels"], scale,
                                                         temperature=TEMPERATURE["supcon"], **options),
        temperature=TEMPERATURE["supcon"], gram=True, ids=False,
    )


def _clip(symmetric: bool) -> Loss:
    def reference(scale: Tensor, params: dict, data: dict, negatives: Tensor | None, ids: Tensor | None,
                  negative_ids: Tensor | None, same_id: str) -> Tensor:
        return clip_rows(*encode(params, data), scale, negatives, symmetric, ids, negative_ids, same_id)

    def call(scale: Tensor, params: dict, data: dict, options: dict[str, Any]) -> Tensor:
        return info_nce(*encode(params, data), scale, symmetric=symmetric, **options)

    return Loss(reference, call, same_id=True, negatives=True)


def _decoupled(sigma: float | None) -> Loss:
    return Loss(
        reference=lambda scale, params, data, _, ids, *__: dcl_rows(*_two_views(params, data), scale, sigma, ids),
        call=lambda scale, params, data, options: dcl(*_two_views(params, data), scale, sigma=sigma, **options),
        gram=True,
    )


def _ntxent(temperature: float | None) -> Loss:
    return Loss(
        reference=lambda scale, params, data, _, ids, __, same_id: ntxent_rows(*_two_views(params, data), scale, ids,
                                                                               same_id),
        call=lambda scale, params, data, options: nt_xent(*_two_views(params, data), scale,
                                                          temperature=TEMPERATURE["ntxent"], **options),
        temperature=temperature, same_id=True, gram=True,
    )


HCL_OPTIONS = {"beta": 0.7, "tau_plus": 0.2}
"""A hardness and a prior whose terms all count: ``Ng`` stays above its floor in the tests' problems."""

REGISTRY: dict[str, Loss] = {
    "clip": _clip(symmetric=True),
    "clip_one_way": _clip(symmetric=False),
    "ntxent": _ntxent(TEMPERATURE["ntxent"]),
    "ntxent_scale": _ntxent(None),
    "siglip": Loss(
        reference=lambda scale, params, data, _, ids, __, same_id: siglip_rows(*encode(params, data), scale,
                                                                               params["bias"], ids, same_id),
        call=lambda scale, params, data, options: siglip(*encode(params, data), scale, params["bias"], **options),
        same_id=True,
    ),
    "supcon": _supcon(views=1),
    "supcon_views": _supcon(views=2),
    "supcon_views_scale": _supcon(views=2)._replace(temperature=None),
    "dcl": _decoupled(sigma=None),
    "dclw": _decoupled(sigma=DCLW_SIGMA),
    "hcl": Loss(
        reference=lambda scale, params, data, _, ids, *__: hcl_rows(*_two_views(params, data), scale, ids=ids,
                                                                    **HCL_OPTIONS),
        call=lambda scale, params, data, options: hcl(*_two_views(params, data), scale, **HCL_OPTIONS, **options),
        temperature=TEMPERATURE["ntxent"], gram=True,
    ),
}
"""Every loss of the matrix, by name; ``*_scale``: a learnable ``logit_scale`` instead of the fixed temperature."""
KINDS = tuple(REGISTRY)
ID_KINDS = tuple(kind for kind, loss in REGISTRY.items() if loss.same_id)
GRAM_KINDS = tuple(kind for kind, loss in REGISTRY.items() if loss.gram)


def _scale(kind: str, params: dict[str, Tensor]) -> Tensor | None:
    """The loss's ``logit_scale`` argument: the learnable one, or ``None`` for a fixed temperature."""
    return None if REGISTRY[kind].temperature is not None else params["log_scale"].exp()


def reference_rows(kind: str, params: dict[str, Tensor], data: dict[str, Tensor], negatives: Tensor | None,
                   same_id: str = "", negative_ids: Tensor | None = None) -> Tensor:
    """``ℓ_i`` of every row of the global batch (SupCon: per anchor, like ``features[..., 0]``).

    ``same_id``: ``""`` (no ids), ``"mask"`` or ``"positive"``, with ``data["ids"]`` and ``negative_ids``.
    """
    loss, scale = REGISTRY[kind], _scale(kind, params)
    fixed = 1 / loss.temperature if scale is None and loss.temperature is not None else scale
    ids = data["ids"] if same_id else None
    return loss.reference(fixed, params, data, negatives, ids, negative_ids, same_id)


def reference_value(kind: str, mode: str, params: dict[str, Tensor], data: dict[str, Tensor],
                    negatives: Tensor | None = None, same_id: str = "", negative_ids: Tensor | None = None) -> Tensor:
    """The global loss (``mean``/``weighted``) or the rows (``none``), from :func:`reference_rows`."""
    rows = reference_rows(kind, params, data, negatives, same_id, negative_ids)
    if mode == "none":
        return rows
    weights = data["weight"] if mode == "weighted" else torch.ones_like(data["weight"])
    weights = weights.to(rows.dtype)
    if kind.startswith("supcon"):
        # One weight per sample, shared by its views; anchors without positives do not count.
        features = torch.stack(encode(params, data), dim=1) if rows.ndim == 2 else encode(params, data)[0]
        _, counted = supcon_rows(features, data["labels"], 1.0)
        weights = (weights[:, None].expand_as(rows) if rows.ndim == 2 else weights) * counted
    total = weights.sum()
    return (rows * weights).sum() / total if total > 0 else rows.sum() * 0


def package_value(
    kind: str,
    mode: str,
    params: dict[str, Tensor],
    data: dict[str, Tensor],
    *,
    chunk_size: int | None = None,
    sizes: tuple[int, ...] | None = None,
    communication: str = "gather",
    negatives: Tensor | SharedNegatives | None = None,
    group: ProcessGroup | None = None,
    same_id: str = "",
    negative_ids: Tensor | None = None,
) -> Tensor:
    """This rank's value of the package's loss on its local ``data`` (a share of the mean, or its rows).

    ``same_id``: ``""`` (no ids), or the ``same_id=`` with ``data["ids"]`` (and ``negative_ids``).
    """
    loss = REGISTRY[kind]
    options: dict[str, Any] = {"chunk_size": chunk_size, "sizes": sizes, "communication": communication, "group": group}
    options["reduction"] = "none" if mode == "none" else "mean"
    if mode == "weighted":
        options["weight"] = data["weight"]
    if same_id:
        options["ids"] = data["ids"]
        options.update({"same_id": same_id} if loss.same_id else {})
    if loss.negatives:
        options.update(negatives=negatives, negative_ids=negative_ids)
    return loss.call(_scale(kind, params), params, data, options)


def objective(value: Tensor, mode: str, upstream: Tensor) -> Tensor:
    """What the gradients are taken of: the loss, or ``Σ u_i ℓ_i`` for per-row losses (``u`` shaped like the rows)."""
    if mode != "none":
        return value
    return (value * (upstream if value.ndim == 2 else upstream[:, 0])).sum()


def value_and_grads(loss: Tensor, inputs: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    grads = torch.autograd.grad(loss, list(inputs.values()), allow_unused=True)
    return loss.detach(), {
        name: torch.zeros_like(tensor) if grad is None else grad
        for (name, tensor), grad in zip(inputs.items(), grads, strict=True)
    }


def assert_close(actual: Tensor, expected: Tensor, dtype: torch.dtype, what: str) -> None:
    if dtype == torch.float64:
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")
