"""The attributes sentence-transformers' ranking losses carry, on the drop-ins: options, config, citation.

sentence-transformers reads them from outside the loss: ``get_config_dict()`` and ``citation`` go
into the saved model card, ``MatryoshkaLoss`` and ``AdaptiveLayerLoss`` look for
``uses_gradient_cache`` and ``calculate_loss``, and users assign ``loss.scale = …``. The options live
in one :class:`~contrastive_dist.compat._ranking.RankingOptions`; an assignment goes there too (a
module assigned as ``similarity_fct`` included, which ``nn.Module`` would otherwise keep as a
submodule the loss never reads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from contrastive_dist.compat._ranking import RankingOptions

__all__ = ["GRADIENT_CACHE_CITATION", "RankingAttributes", "similarity_name"]

OPTIONS = ("scale", "similarity_fct", "gather_across_devices", "directions", "partition_mode", "hardness_mode",
           "hardness_strength")


def _bibtex(key: str, title: str, authors: list[str], year: int, eprint: str, primary: str = "cs.CL") -> str:
    """A BibTeX ``@misc`` entry of an arXiv paper, as sentence-transformers' model cards list them."""
    return (f"\n@misc{{{key},\n    title={{{title}}},\n    author={{{' and '.join(authors)}}},\n    year={{{year}}},\n"
            f"    eprint={{{eprint}}},\n    archivePrefix={{arXiv}},\n    primaryClass={{{primary}}}\n}}\n")


GRADIENT_CACHE_CITATION = _bibtex(
    "gao2021scaling", "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup",
    ["Luyu Gao", "Yunyi Zhang", "Jiawei Han", "Jamie Callan"], 2021, "2101.06983", "cs.LG")
_ALL_DIRECTIONS = _bibtex(
    "li2023towards", "Towards General Text Embeddings with Multi-stage Contrastive Learning",
    ["Zehan Li", "Xin Zhang", "Yanzhao Zhang", "Dingkun Long", "Pengjun Xie", "Meishan Zhang"], 2023, "2308.03281")
_BOTH_WAYS = _bibtex(
    "gunther2023jina", "Jina Embeddings 2: 8192-Token General-Purpose Text Embeddings for Long Documents",
    ["Michael Günther", "Jackmin Ong", "Isabelle Mohr", "Alaeddine Abdessalem", "Tanguy Abel", "Mohammad Kalim Akram",
     "Susana Guzman", "Georgios Mastrapas", "Saba Sturua", "Bo Wang", "Maximilian Werk", "Nan Wang", "Han Xiao"],
    2023, "2310.19923")
_INFO_NCE = _bibtex(
    "oord2018representation", "Representation Learning with Contrastive Predictive Coding",
    ["Aaron van den Oord", "Yazhe Li", "Oriol Vinyals"], 2018, "1807.03748", "cs.LG")


def similarity_name(similarity_fct: Callable[[Tensor, Tensor], Tensor]) -> str:
    """The similarity's name in the config: ``cos_sim``, ``partial`` bindings with their keywords."""
    if isinstance(similarity_fct, functools.partial):
        name = getattr(similarity_fct.func, "__name__", type(similarity_fct.func).__name__)
        keywords = ", ".join(f"{key}={value!r}" for key, value in similarity_fct.keywords.items())
        return f"{name}({keywords})" if keywords else name
    return str(getattr(similarity_fct, "__name__", type(similarity_fct).__name__))


class RankingAttributes(nn.Module):
    """The options as attributes (read and assigned), ``temperature``, ``get_config_dict`` and ``citation``."""

    def _ranking_options(self) -> RankingOptions:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:
        if name in OPTIONS:
            return getattr(self._ranking_options(), name)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OPTIONS:
            setattr(self._ranking_options(), name, value)
        else:
            super().__setattr__(name, value)

    @property
    def temperature(self) -> float:
        """``1 / scale``."""
        return 1.0 / self._ranking_options().scale

    def get_config_dict(self) -> dict[str, Any]:
        """The options, as sentence-transformers' model card lists them."""
        options = self._ranking_options()
        return {"scale": options.scale, "similarity_fct": similarity_name(options.similarity_fct),
                "gather_across_devices": options.gather_across_devices, "directions": options.directions,
                "partition_mode": options.partition_mode, "hardness_mode": options.hardness_mode,
                "hardness_strength": options.hardness_strength}

    @property
    def citation(self) -> str:
        """The paper of the loss with these directions, as BibTeX."""
        options = self._ranking_options()
        if set(options.directions) == {"query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"}:
            if options.partition_mode == "joint":
                return _ALL_DIRECTIONS
        if set(options.directions) == {"query_to_doc", "doc_to_query"} and options.partition_mode == "per_direction":
            return _BOTH_WAYS
        return _INFO_NCE
