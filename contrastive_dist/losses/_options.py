"""The options every loss takes, checked once: scale, temperature, chunk size, mode, reduction, weights.

Each check raises ``ValueError``/``TypeError`` saying what was expected and what came; the losses
run them through :func:`contrastive_dist._validation.collect`, so a bad option on one rank is
raised on every rank by the agreement exchange.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal, cast, get_args

import torch
from torch import Tensor

from contrastive_dist.losses._precision import compute_dtype

__all__ = [
    "Communication",
    "Reduction",
    "SameId",
    "agreed_options",
    "check_bool",
    "check_chunk_size",
    "check_communication",
    "check_ids",
    "check_positive_weight",
    "check_reduction",
    "check_same_id",
    "check_sigma",
    "check_temperature",
    "check_weight",
    "positive_scalar",
    "resolve_scale",
    "scalar_tensor",
]

Communication = Literal["gather", "ring"]
Reduction = Literal["mean", "none"]


def agreed_options(
    *,
    chunk_size: object,
    communication: object,
    reduction: object,
    weight: object,
    temperature: object = None,
    logit_scale: object = None,
    **own: object,
) -> dict[str, object]:
    """The options every rank must share, in the form the agreement compares: the common ones, then ``own``.

    ``temperature`` is compared only where ``logit_scale`` is not given (a scale tensor replaces it);
    ``weight`` by whether one is given (its values are per row, like the features).

    Example:
        >>> agreed_options(chunk_size=None, communication="ring", reduction="mean", weight=None, temperature=0.1)
        {'chunk_size': None, 'communication': 'ring', 'reduction': 'mean', 'weight': False, 'temperature': 0.1}
    """
    options: dict[str, object] = {
        "chunk_size": chunk_size,
        "communication": communication,
        "reduction": reduction,
        "weight": weight is not None,
    }
    if temperature is not None:
        options["temperature"] = temperature if logit_scale is None else "logit_scale"
    return options | own


def check_communication(communication: object) -> Communication:
    """Check ``communication`` is one of the allowed modes."""
    allowed = get_args(Communication)
    if communication not in allowed:
        raise ValueError(f"communication must be one of {allowed}, got {communication!r}")
    return cast(Communication, communication)


def check_reduction(reduction: object, weight: object) -> Reduction:
    """Check ``reduction`` is ``"mean"`` or ``"none"``, and that ``weight`` comes only with ``"mean"``."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    if reduction == "none" and weight is not None:
        raise ValueError(
            "weight= applies to reduction='mean' only; with reduction='none' the per-row losses come back "
            "unweighted and the caller weights and normalises them"
        )
    return cast(Reduction, reduction)


def check_bool(name: str, value: object) -> bool:
    """Check for a ``bool``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_temperature(temperature: object) -> float:
    """Return ``temperature`` as a float after checking it is a real number > 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    value = float(temperature)
    if not value > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return value


def check_chunk_size(chunk_size: object) -> int | None:
    """Check that ``chunk_size`` is ``None`` or a positive int."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be None or a positive int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size}")
    return chunk_size


def scalar_tensor(name: str, value: object, like: Tensor) -> Tensor:
    """A one-element tensor (kept in the graph) or a real number as a 0-d tensor in ``like``'s compute dtype."""
    dtype = compute_dtype(like.dtype)
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar (one element), got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor or a real number, got {value.dtype}")
        return value.reshape(()).to(dtype=dtype, device=like.device)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a scalar tensor or a real number, got {type(value).__name__}")
    return _filled(float(value), like)


def _filled(value: float, like: Tensor) -> Tensor:
    """A number the host holds as a 0-d tensor on ``like``'s device: filled there, not copied (no host sync).

    Under ``torch.compile`` the number is a constant of the graph, as before: no copy happens there either.
    """
    if torch.compiler.is_compiling():
        return torch.tensor(value, dtype=compute_dtype(like.dtype), device=like.device)
    return torch.full((), value, dtype=compute_dtype(like.dtype), device=like.device)


def positive_scalar(name: str, value: object, like: Tensor) -> Tensor:
    """:func:`scalar_tensor`, and > 0 when given as a number (checked on the host; a tensor is not synced)."""
    scale = scalar_tensor(name, value, like)
    if not isinstance(value, Tensor) and not float(cast(float, value)) > 0:
        raise ValueError(f"{name} must be > 0 (it multiplies the similarities), got {value}")
    return scale


def resolve_scale(logit_scale: object, temperature: float, like: Tensor) -> Tensor:
    """Return the similarity multiplier: ``logit_scale`` if given (already exponentiated), else ``1/temperature``."""
    if logit_scale is None:
        return _filled(1.0 / temperature, like)
    return positive_scalar("logit_scale", logit_scale, like)


def check_weight(weight: object, rows: int, like: Tensor) -> Tensor | None:
    """Return ``weight`` detached, in ``like``'s compute dtype and device, after checking it.

    Expected: a real tensor of shape ``(rows,)``, every entry finite and ≥ 0.
    """
    if weight is None:
        return None
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor of shape ({rows},), got {type(weight).__name__}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise TypeError(f"weight must be a real (float or integer) tensor, got {weight.dtype}")
    if weight.shape != (rows,):
        raise ValueError(f"weight must have one entry per local row, shape ({rows},), got {tuple(weight.shape)}")
    values = weight.detach().to(dtype=compute_dtype(like.dtype), device=like.device)
    if torch.compiler.is_compiling():
        return values  # the values are data: under torch.compile they are trusted, like sizes=
    for bad, what in ((~torch.isfinite(values), "finite"), (values < 0, ">= 0")):
        if bool(bad.any()):
            index = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"weight must be {what}, got weight[{index}] = {values[index].item()}")
    return values


SameId = Literal["mask", "positive"]
"""What two rows with the same id are to each other: ``"mask"`` (neither pushed apart nor pulled
together) or ``"positive"`` (positives of each other)."""


def check_same_id(same_id: object) -> SameId:
    """Check ``same_id`` is ``"mask"`` or ``"positive"``."""
    allowed = get_args(SameId)
    if same_id not in allowed:
        raise ValueError(f"same_id must be one of {allowed}, got {same_id!r}")
    return cast(SameId, same_id)


def check_ids(name: str, ids: object, rows: int, like: Tensor) -> Tensor | None:
    """Check for one int64 id per row, on ``like``'s device (``None`` passes)."""
    if ids is None:
        return None
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be an int64 torch.Tensor of shape ({rows},), got {type(ids).__name__}")
    if ids.dtype != torch.int64:
        raise TypeError(f"{name} must be an int64 tensor (one id per row), got {ids.dtype}")
    if ids.shape != (rows,):
        raise ValueError(f"{name} must have one id per row, shape ({rows},), got {tuple(ids.shape)}")
    return ids.to(like.device)


def check_sigma(sigma: object, positive_weight: object = None) -> float | None:
    """DCLW's ``σ``: ``None`` or a number > 0, not together with a given ``positive_weight``."""
    if sigma is None:
        return None
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"sigma must be a finite number > 0 or None, got {sigma!r}")
    if positive_weight is not None:
        raise ValueError("give sigma (DCLW's von Mises-Fisher weights) or positive_weight, not both")
    return float(sigma)


def check_positive_weight(positive_weight: object, like: Tensor) -> Tensor | None:
    """``None``, or a float tensor of ``(n,)`` (per sample) or ``(n, 2)`` (per anchor), moved to ``like``'s device."""
    if positive_weight is None:
        return None
    rows = like.shape[0]
    if not isinstance(positive_weight, Tensor) or not positive_weight.is_floating_point():
        raise TypeError(f"positive_weight must be a floating-point torch.Tensor, got {type(positive_weight).__name__}"
                        f"{'' if not isinstance(positive_weight, Tensor) else f' of {positive_weight.dtype}'}")
    if tuple(positive_weight.shape) not in ((rows,), (rows, 2)):
        shape = tuple(positive_weight.shape)
        raise ValueError(f"positive_weight must have shape ({rows},) or ({rows}, 2), got {shape}")
    weights = positive_weight.to(device=like.device, dtype=compute_dtype(like.dtype))
    return weights if weights.ndim == 2 else weights[:, None]
