"""Every loss under ``torch.compile(fullgraph=True)`` equals eager, in value and gradient, on 2 gloo processes.

With ``sizes=`` given the gather takes its traceable route (functional collectives), so the whole
loss, collectives included, is one graph. Compiled with the ``aot_eager`` backend (CPU, no
C++ toolchain needed); shards are uneven and one rank is empty. Each case resets dynamo, so every
case is a fresh compilation rather than a cached graph or an eager fallback after a recompile limit.

Compiling takes minutes of both cores (12 in a CI run, beside the suite), and nothing else waits on
it: the checks run in a pytest process of their own, a background command (``tests/background.py``)
started with the session; :func:`test_in_a_process_of_its_own` reads its outcome.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path

import background
import pytest
import torch
import torch._dynamo
from loss_references import KINDS, encode, make_problem, package_value, value_and_grads
from torch import Tensor

from contrastive_dist import DistributedInfoNCE, NTXentLoss, SharedNegatives, SigLIPLoss, SupConLoss
from contrastive_dist.testing import WorkerPool

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-6}
REPLICATED = ("log_scale", "bias")
"""Parameters every rank holds whole: DDP averages their gradients, and one path may share them among
the ranks otherwise than another (eager Gram losses form each pair of tiles on one rank, whatever rows
it holds), so their gradients are compared summed over the ranks; the features' are compared per rank."""
MODULES = {
    "DistributedInfoNCE": lambda chunk: DistributedInfoNCE(chunk_size=chunk),
    "NTXentLoss": lambda chunk: NTXentLoss(chunk_size=chunk),
    "SigLIPLoss": lambda chunk: SigLIPLoss(chunk_size=chunk),
    "SupConLoss": lambda chunk: SupConLoss(chunk_size=chunk),
}
Case = tuple[str, int | None, tuple[int, int], str] | tuple[str, int | None, tuple[int, int], str, str]
"""``(kind, chunk, shards, dtype[, backend])``: the backend ``aot_eager`` unless named."""
SHARED_KEYS = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
"""Shared negatives (the text width of ``make_problem``), the same on every rank."""


def functional_step(kind: str, params: dict[str, Tensor], data: dict[str, Tensor], chunk: int | None, sizes):
    """``kind`` may name ids, a mode and a variant: ``"siglip:positive:weighted"`` (ids with ``same_id="positive"``),
    ``"clip:mask:mean:ring"`` (ring mode), ``"clip:mask:mean:shared"`` (shared negatives without ids, as a queue's)."""
    name, same_id, mode, variant = (kind.split(":") + ["", "mean", ""])[:4]
    options: dict[str, object] = {"communication": "ring"} if variant == "ring" else {}
    if variant == "shared":  # the same keys on every rank (made outside the compiled region)
        options["negatives"] = SharedNegatives(SHARED_KEYS.to(params["w_text"].dtype))
    value = package_value(name, mode, params, data, chunk_size=chunk, sizes=sizes, same_id=same_id, **options)
    return value if mode != "none" else (value * data["upstream"][:, 0]).sum()


def module_step(criterion: torch.nn.Module, params: dict[str, Tensor], data: dict[str, Tensor], sizes):
    images, texts = encode(params, data)
    scale = params["log_scale"].exp()
    if isinstance(criterion, SigLIPLoss):
        return criterion(images, texts, scale, params["bias"], sizes=sizes)
    if isinstance(criterion, SupConLoss):
        return criterion(torch.stack([images, texts], dim=1), data["labels"], scale, sizes=sizes)
    return criterion(images, texts, scale, sizes=sizes)


GROUPS = {
    "functional": [(kind, None, (2, 3), "float64") for kind in KINDS],
    # Chunked graphs take longer to compile: two groups of about five cases each.
    "functional chunked": [(kind, 2, (3, 0), "float64") for kind in KINDS[: len(KINDS) // 2]],
    "functional chunked, continued": [(kind, 2, (3, 0), "float64") for kind in KINDS[len(KINDS) // 2 :]],
    "modules": [(name, None, (1, 4), "float32") for name in MODULES],
    "modules chunked": [(name, 2, (4, 0), "float32") for name in MODULES],
    **{
        f"sample ids, {same_id}": [(f"{kind}:{same_id}:{mode}", 2, (3, 2), "float64")
                                  for kind in ("clip", "ntxent", "siglip")]
        for same_id, mode in (("mask", "weighted"), ("positive", "none"))
    },
    # Ring mode (no environment variable needed), and ids whose columns do not fill the block.
    "ring and shared negatives": [
        ("clip:mask:mean:ring", 2, (3, 2), "float64"),
        ("clip:mask:weighted:shared", 2, (3, 2), "float64"),
    ],
    # Ring mode with ids as positives (columns' keys travelling with their block) and NT-Xent's ring, whose
    # rows are their own columns (the same tensor given twice).
    "ring, positives by id, NT-Xent": [
        ("clip:positive:mean:ring", 2, (3, 2), "float64"),
        ("clip:positive:none:ring", 2, (3, 2), "float64"),
        ("ntxent::mean:ring", 2, (3, 2), "float64"),
        ("ntxent::none:ring", None, (3, 2), "float64"),
    ],
    # Ring mode with an empty rank: its hops once crossed when compiled (moved or recomputed by the partitioner
    # by each rank's data); an ordered effect now.
    "ring with an empty rank": [
        ("siglip::mean:ring", None, (3, 0), "float64"),
        ("siglip::none:ring", 2, (0, 3), "float64"),
        ("clip::mean:ring", 2, (3, 0), "float64"),
        ("ntxent::mean:ring", None, (0, 3), "float64"),
    ],
    # Inductor's memory planning once reused a block's memory while gloo still sent it, and merged two
    # receive buffers: wrong or inf gradients (the other groups' backend, aot_eager, plans no memory).
    "ring under inductor": [
        ("clip::mean:ring", None, (3, 1), "float64", "inductor"),
        ("clip::none:ring", 2, (1, 3), "float64", "inductor"),
    ],
}
"""Cases in groups of a few compilations each (a failure names its group): every group takes 6–37 s on
an idle machine (inductor's the most, its first compilation), about 150 s for all of them."""
GROUP_SECONDS = 2400
"""How long a group's ranks may take, in seconds of the clock. The checks run beside the suite at a smaller
CPU share (``tests/background.py``): beside a busy suite a group of ten chunked cases once took 250 s of
wall time for 28 s of work, and under a further load of 4 busy processes more than the 840 s once allowed
here. A hang is found sooner: a collective waits at most the pool's timeout (600 s there)."""


def compare_compiled_with_eager(
    rank: int, world_size: int, cases: list[Case]
) -> tuple[list[str], list[dict[str, Tensor]]]:
    """For each case: max |compiled − eager| over the value and the features' gradients, against its tolerance;
    and compiled − eager of the replicated parameters' gradients, to be summed over the ranks."""
    from torch._dynamo.utils import counters

    failures: list[str] = []
    differences: list[dict[str, Tensor]] = []
    for index, (kind, chunk, shards, dtype_name, *named) in enumerate(cases):
        dtype, backend = getattr(torch, dtype_name), named[0] if named else "aot_eager"
        params, data = make_problem(seed=index, total=sum(shards), dtype=dtype)
        start = sum(shards[:rank])
        local = {name: tensor[start : start + shards[rank]] for name, tensor in data.items()}
        if kind in MODULES:
            function, arguments = module_step, (MODULES[kind](chunk), params, local, shards)
        else:
            function, arguments = functional_step, (kind, params, local, chunk, shards)
        step = functools.partial(torch.compile(function, fullgraph=True, backend=backend), *arguments)
        eager = functools.partial(function, *arguments)
        torch._dynamo.reset()
        graphs_before = counters["stats"]["unique_graphs"]
        try:
            value, grads = value_and_grads(step(), params)
        except Exception as error:  # noqa: BLE001 - reported with the case that failed
            failures.append(f"{kind} chunk={chunk} {shards}: {type(error).__name__}: {str(error)[:400]}")
            differences.append({})
            continue
        if counters["stats"]["unique_graphs"] == graphs_before:
            failures.append(f"{kind} chunk={chunk} {shards}: nothing was compiled")
        expected, expected_grads = value_and_grads(eager(), params)
        errors = [(value - expected).abs().item()]
        errors += [(grads[name] - expected_grads[name]).abs().max().item() for name in grads if name not in REPLICATED]
        if value.dtype != expected.dtype or max(errors) > TOLERANCE[dtype]:
            failures.append(f"{kind} chunk={chunk} {shards} {dtype_name}: max error {max(errors):.1e}")
        differences.append({name: grads[name] - expected_grads[name] for name in REPLICATED if name in grads})
    return failures, differences


_CHILD = "CONTRASTIVE_DIST_COMPILE_CHECKS"
"""Set in the background process: the checks run there, and only there."""
IN_CHILD = os.environ.get(_CHILD) == "1"


def _checks_command() -> str:
    """Declare this file's checks in a pytest process of their own, a background command."""
    root = Path(__file__).resolve().parents[1]
    # Collectives wait longer there: a rank may get no CPU time for a while when the suite is busy.
    env = {**os.environ, _CHILD: "1", "PYTHONPATH": str(root), background.POOL_TIMEOUT_VARIABLE: "600"}
    argv = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "not process_of_its_own"]
    return background.command("compile checks", argv, cwd=root, env=env)


COMPILE_CHECKS = _checks_command()


@pytest.mark.skipif(IN_CHILD, reason="this is the checks' own process")
@pytest.mark.timeout(960)
@pytest.mark.background(COMPILE_CHECKS)
def test_in_a_process_of_its_own() -> None:
    """Every check below, in the pytest process started with the session."""
    background.assert_every_check_passed(COMPILE_CHECKS, passed=len(GROUPS) + 1)


@pytest.mark.in_background(COMPILE_CHECKS)
@pytest.mark.timeout(GROUP_SECONDS + 60)
@pytest.mark.parametrize("group", list(GROUPS))
def test_every_loss_compiles_with_fullgraph_and_equals_eager(pool: Callable[[int], WorkerPool], group: str) -> None:
    outcomes = pool(2).run(compare_compiled_with_eager, GROUPS[group], timeout=GROUP_SECONDS)
    assert [failures for failures, _ in outcomes] == [[], []]
    for index, case in enumerate(GROUPS[group]):
        for name in outcomes[0][1][index]:
            summed = sum(differences[index][name] for _, differences in outcomes)
            assert float(summed.abs().max()) <= TOLERANCE[getattr(torch, case[3])], (case, name)


CAPTION_CASES = [
    *[(kind, {"communication": "gather", "compiled": True, "chunk_size": 2, "weighted": True})
      for kind in ("info_nce", "siglip")],
    ("siglip", {"communication": "gather", "compiled": True, "weighted": "images"}),  # one pass, weighted rows
    *[(kind, {"communication": "ring", "compiled": True, "reduction": "none", "counts": ((3, 1, 2), (2, 4, 1))})
      for kind in ("info_nce", "siglip")],
    # An empty rank on each side (images (4, 0, 3), texts (5, 6, 0)): compiled, its hops once crossed (gloo: 240 vs
    # 192 bytes) as the partitioner moved or recomputed them by each rank's data (now an ordered effect).
    *[(kind, {"communication": "ring", "compiled": True, "reduction": "none"}) for kind in ("info_nce", "siglip")],
    ("info_nce", {"communication": "ring", "compiled": True, "reduction": "none", "symmetric": False}),
]
"""Several texts per image, compiled whole with ``sizes=`` and ``text_sizes=``: both losses, both modes."""


@pytest.mark.in_background(COMPILE_CHECKS)
@pytest.mark.timeout(GROUP_SECONDS + 60)
def test_several_captions_compile_on_three_uneven_ranks(pool: Callable[[int], WorkerPool]) -> None:
    # The checks of tests/test_captions.py (float64 loop references; 3 ranks, by default images (4, 0, 3) and
    # texts (5, 6, 0)).
    from test_captions import TOLERANCE as CAPTIONS_TOLERANCE
    from test_captions import errors_per_rank

    for per_rank in zip(*pool(3).run(errors_per_rank, CAPTION_CASES, timeout=GROUP_SECONDS), strict=True):
        worst = max(error for _, error in per_rank)
        assert worst <= CAPTIONS_TOLERANCE, f"{per_rank[0][0]}: {worst:.1e}"
