"""Under DDP on gloo with shards [5, 0, 3] (float64), each drop-in equals its single-process loss on the whole batch.

Every rank's value (the global loss, what a trainer logs) and the DDP-averaged gradients (encoder
weights, ``logit_scale``, ``logit_bias``) equal the single-process drop-in's on the concatenated batch, which
the single-process tests show equal to the original's. The lightly memory bank runs four steps,
the bank filled with every rank's keys in rank order. (The originals need equal batch sizes; what
they do on this case is measured in ``benchmarks/compat_originals.py``.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from compat_cases import WIDTH, loss_and_grads, make, problem, squared_distance

from contrastive_dist.testing import WorkerPool

SHARDS = (5, 0, 3)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("clip", {}),
    ("clip", {"local_loss": True, "gather_with_grad": True, "rank": 3, "world_size": 7}),
    ("siglip", {"dist_impl": "bidir"}),
    ("siglip", {"dist_impl": "gather"}),
    ("ntxent", {"temperature": 0.2, "gather_distributed": True}),
    ("ntxent", {"temperature": 0.2, "memory_bank_size": (16, WIDTH), "gather_distributed": True}),
    ("dcl", {"temperature": 0.2, "gather_distributed": True}),
    ("dcl", {"temperature": 0.2, "weight_fn": squared_distance, "gather_distributed": True}),
    ("dclw", {"temperature": 0.2, "sigma": 0.5, "gather_distributed": True}),
    ("mnrl", {"gather_across_devices": True}),
    ("mnrl", {"gather_across_devices": True, "partition_mode": "joint", "hardness_mode": "all_negatives",
              "hardness_strength": 0.3,
              "directions": ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")}),
    ("cached_mnrl", {"gather_across_devices": True, "mini_batch_size": 2,
                     "directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}),
]


def _steps(kind: str) -> int:
    return 4 if kind == "ntxent" else 1


def _columns(kind: str) -> int:
    return 3 if kind in ("mnrl", "cached_mnrl") else 2


def _on_shards(rank: int, world_size: int) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """This rank's values (each step's) and the gradients averaged over the ranks, as DDP averages them."""
    start = sum(SHARDS[:rank])
    out = []
    for kind, options in CASES:
        data = problem(sum(SHARDS), torch.float64, columns=_columns(kind))
        torch.manual_seed(7)
        loss = make(kind, "compat", options, data).double()
        values, grads = loss_and_grads(kind, loss, data, start, start + SHARDS[rank], steps=_steps(kind))
        for grad in grads.values():  # what DDP does: the mean over ranks
            dist.all_reduce(grad)
            grad /= world_size
        out.append(([float(value) for value in values], grads))
    return out


def test_every_drop_in_is_exact_under_uneven_and_empty_ranks(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(len(SHARDS)).run(_on_shards, timeout=240)
    for index, (kind, options) in enumerate(CASES):
        data = problem(sum(SHARDS), torch.float64, columns=_columns(kind))
        torch.manual_seed(7)
        loss = make(kind, "compat", options, data).double()
        values, grads = loss_and_grads(kind, loss, data, 0, sum(SHARDS), steps=_steps(kind))
        for rank, (rank_values, rank_grads) in enumerate(result[index] for result in per_rank):
            torch.testing.assert_close(torch.tensor(rank_values, dtype=torch.float64), torch.stack(values),
                                       rtol=1e-12, atol=1e-12, msg=f"{kind} {options} rank {rank}")
            for name in grads:
                torch.testing.assert_close(rank_grads[name], grads[name], rtol=1e-11, atol=1e-12,
                                           msg=f"{kind} {options} {name}")
