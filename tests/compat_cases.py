"""The drop-ins of ``contrastive_dist.compat`` and the originals they mimic, on the same small problems.

One problem per kind: leaf parameters (encoder weights, ``logit_scale`` / ``logit_bias``) and raw
rows; :func:`loss_and_grads` runs a loss object on rows ``start:stop`` for ``steps`` steps and
returns the values and the parameters' gradients. The single-process tests compare a drop-in with
its original on the whole batch; the gloo workers run the drop-in on their shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist.compat import lightly as compat_lightly
from contrastive_dist.compat import open_clip as compat_open_clip
from contrastive_dist.compat import sentence_transformers as compat_st

DIM, WIDTH = 6, 5


class ColumnEncoder(nn.Sequential):
    """A sentence-transformers-style model: ``features["x"] @ W`` as ``{"sentence_embedding": …}``.

    A ``Sequential`` (of one ``Identity``) because sentence-transformers' cached loss looks at ``model[0]``.
    """

    def __init__(self, weight: Tensor) -> None:
        super().__init__(nn.Identity())
        self.weight = nn.Parameter(weight.clone())

    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"sentence_embedding": features["x"] @ self.weight}


def squared_distance(first: Tensor, second: Tensor) -> Tensor:
    """A ``weight_fn`` for lightly's ``DCLLoss`` (its docstring's example): differentiable, symmetric."""
    return ((first - second) ** 2).sum(dim=1)


def problem(total: int, dtype: torch.dtype, seed: int = 0, columns: int = 2) -> dict[str, Tensor]:
    """Raw rows (``steps`` batches of ``total``) and initial weights, drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    data = {f"x{c}": draw(4, total, DIM) for c in range(columns)}  # 4 steps at most
    return {**data, "w0": draw(DIM, WIDTH), "w1": draw(DIM, WIDTH), "scale": torch.tensor(9.0, dtype=dtype),
            "bias": torch.tensor(-4.0, dtype=dtype)}


def make(kind: str, which: str, options: dict[str, Any], data: dict[str, Tensor]) -> nn.Module:
    """The drop-in (``which="compat"``) or the original (``"original"``) loss of ``kind``."""
    if kind in ("mnrl", "cached_mnrl"):
        options = dict(options)
        if which == "original":
            import sentence_transformers.util as st_util  # the original's own similarity functions
            options["similarity_fct"] = getattr(st_util, options.get("similarity_fct", "cos_sim"))
        else:
            options["similarity_fct"] = getattr(compat_st, options.get("similarity_fct", "cos_sim"))
    if which == "original":
        if kind in ("clip", "siglip"):
            from open_clip import loss as oc
            return oc.ClipLoss(**options) if kind == "clip" else oc.SigLipLoss(**options)
        if kind in ("ntxent", "dcl", "dclw"):
            from lightly import loss as lightly_loss
            originals = {"ntxent": lightly_loss.NTXentLoss, "dcl": lightly_loss.DCLLoss, "dclw": lightly_loss.DCLWLoss}
            return originals[kind](**options)
        from sentence_transformers.sentence_transformer import losses as st_losses
        cls = st_losses.MultipleNegativesRankingLoss if kind == "mnrl" else st_losses.CachedMultipleNegativesRankingLoss
        return cls(ColumnEncoder(data["w0"]), **options)
    if kind in ("clip", "siglip"):
        return compat_open_clip.ClipLoss(**options) if kind == "clip" else compat_open_clip.SigLipLoss(**options)
    if kind in ("ntxent", "dcl", "dclw"):
        drop_ins = {"ntxent": compat_lightly.NTXentLoss, "dcl": compat_lightly.DCLLoss, "dclw": compat_lightly.DCLWLoss}
        return drop_ins[kind](**options)
    cls = compat_st.MultipleNegativesRankingLoss if kind == "mnrl" else compat_st.CachedMultipleNegativesRankingLoss
    return cls(ColumnEncoder(data["w0"]), **options)


def loss_and_grads(kind: str, loss: nn.Module, data: dict[str, Tensor], start: int, stop: int,
                   steps: int = 1, output_dict: bool = False) -> tuple[list[Tensor], dict[str, Tensor]]:
    """The values of ``steps`` steps on rows ``start:stop`` and the gradients summed over them."""
    if kind in ("mnrl", "cached_mnrl"):
        params = {"w0": loss.model.weight}
    else:
        params = {name: data[name].clone().requires_grad_() for name in ("w0", "w1", "scale", "bias")}
    values = []
    for step in range(steps):
        rows = [data[f"x{c}"][step, start:stop] for c in range(sum(key.startswith("x") for key in data))]
        if kind in ("mnrl", "cached_mnrl"):
            value = loss([{"x": x} for x in rows], torch.zeros(len(rows[0])))
        elif kind in ("ntxent", "dcl", "dclw"):
            value = loss(rows[0] @ params["w0"], rows[1] @ params["w1"])
        else:
            images = F.normalize(rows[0] @ params["w0"], dim=-1)
            texts = F.normalize(rows[1] @ params["w1"], dim=-1)
            extra = (params["bias"],) if kind == "siglip" else ()
            value = loss(images, texts, params["scale"], *extra, output_dict=output_dict)
            if output_dict:
                assert isinstance(value, dict) and list(value) == ["contrastive_loss"]
                value = value["contrastive_loss"]
        value.backward()
        values.append(value.detach())
    used = ("w0",) if kind in ("mnrl", "cached_mnrl") else ("w0", "w1") if kind in ("ntxent", "dcl", "dclw") else (
        "w0", "w1", "scale", *(("bias",) if kind == "siglip" else ()))
    return values, {name: params[name].grad.detach().clone() for name in used}


def tolerance(dtype: torch.dtype, expected: torch.Tensor | None = None) -> dict[str, float]:
    """``assert_close`` bounds: 1e-6 (float32) or 1e-12 (float64); the absolute one times ``expected``'s largest entry.

    Two float32 computations of the same sums in another order differ by a few units in the last place of
    the largest terms: with entries of ~100 (unnormalised embeddings), one unit is 7.6e-6.
    """
    bound = 1e-6 if dtype == torch.float32 else 1e-12
    scale = 1.0 if expected is None else max(1.0, float(expected.abs().max()))
    return {"rtol": bound, "atol": bound * scale}
