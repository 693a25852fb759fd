"""The losses on their fused epilogue path (CUDA's, run here in Triton's interpreter) against float64.

On CUDA every block of float32 or bfloat16 features (keys included: SupCon's labels, sample ids) takes
the fused Triton epilogues (``losses/_fused.py``) in every path (gather mode, ring mode, per-row
losses); here the same path runs on CPU tensors under
``TRITON_INTERPRET=1`` with ``CONTRASTIVE_DIST_EPILOGUE=triton``, in a process of its own (Triton reads
the variable when it is first imported): :func:`test_in_interpreter` runs this file's checks there.
Each check counts the fused ops it called, so that a silent fall back to the eager chain fails it.
The reference is independent of the code under test: the plain float64 loops of
``tests/loss_references.py``, on the CPU.

On a GPU the same single-process checks run on its compiled kernels (``benchmarks/gpu_day.sh`` does)::

    CONTRASTIVE_DIST_FUSED_LOSS_CHECKS=1 CONTRASTIVE_DIST_TEST_DEVICE=cuda \
        python -m pytest tests/test_losses_fused_epilogue.py -k test_fused_path
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

import background  # noqa: E402
from loss_references import make_problem, objective, package_value, reference_value, value_and_grads  # noqa: E402

from contrastive_dist import SharedNegatives  # noqa: E402
from contrastive_dist.losses import _triton  # noqa: E402
from contrastive_dist.losses._options import PRODUCTS_VARIABLE  # noqa: E402
from contrastive_dist.testing import WorkerPool  # noqa: E402

_CHILD = "CONTRASTIVE_DIST_FUSED_LOSS_CHECKS"
"""Set in the interpreter's process: the checks run there, and only there."""
INTERPRETER_CHECKS = "fused loss checks"
"""This file's checks in Triton's interpreter: a background command (declared below)."""
interpreted = pytest.mark.in_background(INTERPRETER_CHECKS)
DEVICE = torch.device(os.environ.get("CONTRASTIVE_DIST_TEST_DEVICE", "cpu"))
"""Where the losses run: the CPU (under the interpreter), or a GPU (its compiled kernels)."""
_OPS = ("sigmoid_block", "softmax_state", "softmax_grad", "softmax_block", "softmax_pairs", "softmax_pair_grad")


def _interpreter_command() -> str:
    """Declare this file's checks in a fresh process under ``TRITON_INTERPRET=1``: a background command."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, _CHILD: "1", "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    env[_triton.EPILOGUE_VARIABLE] = "triton"
    argv = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "not test_in_interpreter"]
    return background.command(INTERPRETER_CHECKS, argv, cwd=root, env=env)


_interpreter_command()


@pytest.mark.timeout(960)
@pytest.mark.background(INTERPRETER_CHECKS)
@pytest.mark.skipif(os.environ.get(_CHILD) == "1", reason="this is the interpreter's process")
def test_in_interpreter() -> None:
    """Every check below, in the interpreter's process (started when the session started)."""
    background.assert_every_check_passed(INTERPRETER_CHECKS)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The fused ops called, by name (the losses reach them through the module ``_triton``)."""
    calls: list[str] = []
    for name in _OPS:
        op = getattr(_triton, name)
        monkeypatch.setattr(_triton, name, lambda *a, _op=op, _name=name, **k: (calls.append(_name), _op(*a, **k))[1])
    yield calls


KINDS = ("clip", "clip_one_way", "clip_shared_negatives", "ntxent_scale", "siglip", "supcon", "supcon_views_scale",
         "clip+positive", "clip+mask", "ntxent_scale+positive", "ntxent_scale+mask", "siglip+positive", "siglip+mask")
"""The losses checked; ``+rule``: with sample ids and ``same_id=rule`` (few distinct ids: shared within and
across ranks). SupCon's labels and the ids are keys, compared in the kernels."""


def _kind(kind: str) -> tuple[str, str]:
    """The loss and its ``same_id`` (``""``: no ids)."""
    loss, _, same_id = kind.partition("+")
    return loss, same_id


def _problem(dtype: torch.dtype, total: int = 37, seed: int = 1) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Leaf parameters and data on :data:`DEVICE`."""
    params, data = make_problem(seed=seed, total=total, dtype=dtype)
    params = {name: tensor.detach().to(DEVICE).requires_grad_() for name, tensor in params.items()}
    return params, {name: (tensor.to(dtype) if tensor.is_floating_point() else tensor).to(DEVICE)
                    for name, tensor in data.items()}


def _shared_negatives(dtype: torch.dtype) -> Tensor:
    generator = torch.Generator().manual_seed(9)
    negatives = torch.nn.functional.normalize(torch.randn(5, 5, generator=generator, dtype=torch.float64), dim=-1)
    return negatives.to(dtype)


def _reference(kind: str, mode: str, params: dict[str, Tensor], data: dict[str, Tensor]) -> tuple[Tensor, dict]:
    """The plain float64 loops on the same (rounded) values, on the CPU."""
    kind, same_id = _kind(kind)
    params64 = {name: tensor.detach().cpu().double().requires_grad_() for name, tensor in params.items()}
    data64 = {name: tensor.cpu() for name, tensor in data.items()}
    data64 = {name: tensor.double() if tensor.is_floating_point() else tensor for name, tensor in data64.items()}
    shared = kind == "clip_shared_negatives"
    negatives = _shared_negatives(params["w_text"].dtype).double() if shared else None
    value = reference_value("clip" if shared else kind, mode, params64, data64, negatives=negatives, same_id=same_id)
    return value.detach(), value_and_grads(objective(value, mode, data64["upstream"]), params64)[1]


def _package(kind: str, mode: str, params: dict[str, Tensor], data: dict[str, Tensor], **options: object) -> Tensor:
    kind, options["same_id"] = _kind(kind)
    if kind == "clip_shared_negatives":
        shared = SharedNegatives(_shared_negatives(params["w_text"].dtype).to(DEVICE))
        return package_value("clip", mode, params, data, negatives=shared, **options)  # type: ignore[arg-type]
    return package_value(kind, mode, params, data, **options)  # type: ignore[arg-type]


def _objective(value: Tensor, mode: str, data: dict[str, Tensor]) -> Tensor:
    """The loss, or ``Σ u_i ℓ_i`` of per-row losses (``reduction="none"``: their recomputed path)."""
    return objective(value, mode, data["upstream"].to(value.dtype))


@interpreted
@pytest.mark.parametrize(("products", "chunk"), [("auto", None), ("auto", 16), ("half", None)])
@pytest.mark.parametrize("mode", ["mean", "weighted", "none"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_path_equals_the_float64_reference(
    kind: str, mode: str, products: str, chunk: int | None, fused_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # products="half": bfloat16 features stay bfloat16 and G is written in bfloat16 (CUDA's route).
    monkeypatch.setenv(PRODUCTS_VARIABLE, products)
    dtype = torch.float32 if products == "auto" else torch.bfloat16
    params, data = _problem(dtype)
    value = _package(kind, mode, params, data, chunk_size=chunk)
    _, grads = value_and_grads(_objective(value, mode, data), params)
    assert fused_calls, "the fused epilogue was not taken"
    expected, expected_grads = _reference(kind, mode, params, data)
    # bfloat16: features, products and the gradients handed back are rounded to bfloat16. SupCon's
    # gradient (many positives per row) loses more there, on either path: the eager chain's own error
    # on these problems reaches 1.8e-2 of the largest entry.
    rtol = 1e-5 if dtype == torch.float32 else (2**-5 if kind.startswith("supcon") else 2**-6)
    torch.testing.assert_close(value.detach().cpu().double(), expected, rtol=rtol, atol=rtol * 1e-3)
    for name, grad in grads.items():
        reference = expected_grads[name]
        assert float((grad.cpu().double() - reference).abs().max()) <= rtol * float(reference.abs().max()), name


MODES = ("mean", "weighted", "none")
CASES = [(kind, communication) for kind in ("clip", "siglip", "supcon", "clip+positive", "siglip+mask")
         for communication in ("gather", "ring")]  # fmt: skip


def distributed_fused(rank: int, world_size: int, shards: tuple[int, ...]) -> list[list[tuple[Tensor, dict, int]]]:
    """Per case and mode: this rank's share of the loss (or its rows), its parameter gradients on the fused
    path, and how many fused ops that call ran."""
    calls: list[str] = []
    for name in _OPS:
        op = getattr(_triton, name)
        setattr(_triton, name, lambda *a, _op=op, _name=name, **k: (calls.append(_name), _op(*a, **k))[1])
    params, data = _problem(torch.float32, total=sum(shards), seed=3)
    start, stop = sum(shards[:rank]), sum(shards[: rank + 1])
    local = {name: tensor[start:stop] for name, tensor in data.items()}
    results = []
    for kind, communication in CASES:
        results.append([])
        for mode in MODES:
            calls.clear()
            value = _package(kind, mode, params, local, chunk_size=2, sizes=shards, communication=communication)
            grads = value_and_grads(_objective(value, mode, local), params)[1]
            results[-1].append((value.detach(), grads, len(calls)))
    return results


@interpreted
def test_across_ranks_with_an_empty_one() -> None:
    # InfoNCE: every rank's partial column states merged by the exchange (gather), or travelling with
    # their block (ring); per-row losses take the recomputed path; an empty rank takes part.
    shards = (3, 0, 4)
    with WorkerPool(len(shards), timeout=600) as pool:  # (the process may run at idle priority)
        outcomes = pool.run(distributed_fused, shards)
    params, data = _problem(torch.float32, total=sum(shards), seed=3)
    for case_index, case in enumerate(CASES):
        for index, mode in enumerate(MODES):
            what = (*case, mode)
            expected, expected_grads = _reference(case[0], mode, params, data)
            shares = [results[case_index][index] for results in outcomes]
            assert all(calls for (_, _, calls), size in zip(shares, shards, strict=True) if size), what
            # A mean: the mean over ranks is the global loss and DDP averages the parameters' gradients.
            # Rows: the ranks' rows in rank order are the global rows, their objectives' sum the global one.
            divisor = 1 if mode == "none" else len(shards)
            values = [value.double() for value, _, _ in shares]
            value = torch.cat(values) if mode == "none" else sum(values) / divisor
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-8, msg=lambda m, w=what: f"{w}: {m}")
            for name, reference in expected_grads.items():
                grad = sum(grads[name].double() for _, grads, _ in shares) / divisor
                assert float((grad - reference).abs().max()) <= 1e-5 * float(reference.abs().max()), (what, name)
