"""Misuse between ranks is loud: the same error on every rank within seconds, no abort, no hang; the next call works.

Each case runs on real gloo processes, in both communication modes, with every loss: one rank passes
another value of a shared scalar, an input on another device type, a model in eval mode, leaves a call
before its exchange, skips a backward, or calls a barrier where the others call a loss. The cases whose
collectives stay posted (a skipped backward, a barrier) run on a process group of their own with a short
timeout, which every rank drops afterwards; the pool's own group then still works.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from contrastive_dist import SyncBatchNorm, all_gather, dcl, info_nce, nt_xent, siglip, supcon
from contrastive_dist.engine import _agreement
from contrastive_dist.testing import WorkerPool

MODES = ("gather", "ring")
PROMPT_S = 5.0
"""Every rank learns of the misuse within this."""
Loss = Callable[..., Tensor]
LOSSES: dict[str, Loss] = {
    "info_nce": lambda a, b, scale, bias, **options: info_nce(a, b, scale, **options),
    "nt_xent": lambda a, b, scale, bias, **options: nt_xent(a, b, scale, **options),
    "siglip": lambda a, b, scale, bias, **options: siglip(a, b, scale, bias, **options),
    "supcon": lambda a, b, scale, bias, **options: supcon(torch.stack([a, b], 1), torch.arange(a.shape[0]) % 2, scale,
                                                          **options),
    "dcl": lambda a, b, scale, bias, **options: dcl(a, b, scale, **options),
}


def _features(rank: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(rank)
    rows = (3, 0, 2)[rank]
    return (F.normalize(torch.randn(rows, 8, generator=generator), dim=-1).requires_grad_() for _ in range(2))


def _outcome(call: Callable[[], object]) -> tuple[str, str, float]:
    """``(exception type, message, seconds)`` of ``call`` (``("no error", "", s)`` if it returned)."""
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for comparison across ranks
        return type(error).__name__, str(error), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def _works(mode: str, group: Any = None) -> bool:
    """A good call of every loss, forward and backward, after the misuse: the group is whole."""
    for loss in LOSSES.values():
        a, b = _features(dist.get_rank())
        value = loss(a, b, torch.tensor(10.0), torch.tensor(-5.0), communication=mode, group=group)
        value.backward()
        if not math.isfinite(float(value.detach())):
            return False
    return True


def _assert_the_same_error_everywhere(per_rank: list[Any], kind: str, *needles: str) -> None:
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        assert outcome.pop("after") is True, f"rank {rank}: the next call failed"
        for case, (error, message, seconds) in outcome.items():
            assert error == kind, f"rank {rank} {case}: {error} {message}"
            assert all(needle in message for needle in needles), f"rank {rank} {case}: {message}"
            assert (error, message) == per_rank[0][case][:2], f"rank {rank} {case}: not the same error as rank 0"
            assert seconds < PROMPT_S, f"rank {rank} {case}: {seconds:.1f} s"


def _misused(rank: int, world_size: int, mode: str, misuse: str) -> dict[str, Any]:
    """Every loss (and one more call) with rank 1 (and 2) passing another scale and bias, or inputs on ``meta``."""
    a, b = _features(rank)
    scale, bias = torch.tensor(10.0), torch.tensor(-5.0)
    if misuse == "scalars":
        scale, bias = torch.tensor(10.0 + (rank == 1)), torch.tensor(-5.0 - 2 * (rank == 2))
        more = {"siglip bias": lambda: siglip(a, b, torch.tensor(10.0), bias, communication=mode)}
    else:  # a device type the gloo group does not serve (a CUDA input under gloo on a GPU-less host alike)
        a, b = (a.detach().to("meta"), b.detach().to("meta")) if rank == 1 else (a, b)
        more = {"all_gather": lambda: all_gather(a)}
    outcome: dict[str, Any] = {name: _outcome(lambda loss=loss: loss(a, b, scale, bias, communication=mode))
                               for name, loss in LOSSES.items()}
    outcome.update({name: _outcome(call) for name, call in more.items()})
    outcome["after"] = _works(mode)
    return outcome


MISUSES = {
    "scalars": ("the ranks passed different values of",),
    "device": ("on rank 1", "device type 'meta'", "does not serve"),
}


@pytest.mark.parametrize("misuse", sorted(MISUSES))
@pytest.mark.parametrize("mode", MODES)
def test_a_scale_bias_or_device_type_that_differs_between_ranks_raises_on_every_rank_before_any_device_work(
    pool: Callable[[int], WorkerPool], mode: str, misuse: str
) -> None:
    per_rank = pool(3).run(_misused, mode, misuse, timeout=60, return_exceptions=True)
    _assert_the_same_error_everywhere(per_rank, "ValueError", *MISUSES[misuse])
    if misuse == "scalars":
        assert "rank 1: logit_scale=11.0" in per_rank[0]["info_nce"][1], per_rank[0]["info_nce"][1]
        assert "rank 2: logit_bias=-7.0" in per_rank[0]["siglip bias"][1], per_rank[0]["siglip bias"][1]


def _a_call_that_leaves_before_its_exchange(rank: int, world_size: int, mode: str) -> list[tuple[str, str, float]]:
    """Rank 1's first call raises before its exchange (as a device error would), and the caller goes on."""
    a, b = _features(rank)
    exchange = _agreement.all_gather_single
    calls = 0

    def fails_once(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        if rank == 1 and calls == 1:
            raise RuntimeError("out of memory (injected)")
        exchange(*args, **kwargs)

    _agreement.all_gather_single = fails_once  # type: ignore[assignment]
    try:
        seen = [_outcome(lambda: info_nce(a, b, communication=mode).backward()) for _ in range(2 if rank == 1 else 1)]
    finally:
        _agreement.all_gather_single = exchange  # type: ignore[assignment]
    return [*seen, ("no error", "", 0.0) if _works(mode) else ("failed", "", 0.0)]


@pytest.mark.parametrize("mode", MODES)
def test_a_rank_whose_call_left_before_its_exchange_is_named_at_its_next_call(
    pool: Callable[[int], WorkerPool], mode: str
) -> None:
    zero, one, two = pool(3).run(_a_call_that_leaves_before_its_exchange, mode, timeout=60, return_exceptions=True)
    assert one[0][:2] == ("RuntimeError", "out of memory (injected)"), one
    # Rank 1's next call meets the others' first: every rank raises the same error there, naming who is behind.
    assert zero[0][:2] == one[1][:2] == two[0][:2], (zero, one, two)
    kind, message, _ = zero[0]
    assert kind == "ValueError" and "ranks [0, 2] are 1 call behind" in message, message
    calls = [int(line.split("its call ")[1].split()[0]) for line in message.splitlines()[1:]]
    assert calls[1] == calls[0] + 1 == calls[2] + 1 and "the next call works" in message, message
    assert max(zero[0][2], one[1][2], two[0][2]) < PROMPT_S
    assert zero[-1] == one[-1] == two[-1] == ("no error", "", 0.0)  # in step again


GROUP_TIMEOUT_S = 8.0
"""The timeout of the group the out-of-step cases break: what is left posted on it ends after this."""


def _out_of_step(rank: int, world_size: int, mode: str, misuse: str) -> dict[str, Any]:
    """One good step, then rank 1 skips its backward (or calls a barrier) on a group of its own."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    a, b = _features(rank)
    info_nce(a, b, communication=mode, group=group).backward()
    if misuse == "skipped backward":
        loss = info_nce(a, b, communication=mode, group=group)
        seen = _outcome(lambda: info_nce(a, b, communication=mode, group=group) if rank == 1 else loss.backward())
    elif rank == 1:
        seen = _outcome(lambda: dist.barrier(group=group))
    else:
        seen = _outcome(lambda: info_nce(a, b, communication=mode, group=group))
    # A later call on the broken group names the same cause at once.
    again = _outcome(lambda: info_nce(a, b, communication=mode, group=group)) if seen[0] == "PeerFailureError" else None
    dist.barrier()  # every rank has its outcome before any drops the broken group
    dist.destroy_process_group(group)
    return {"seen": seen, "again": again, "after": _works(mode)}


OUT_OF_STEP = {
    "skipped backward": ((0, 1, 2), ("rank 1 went on to a later call without the collective the others wait in",
                                     "rank 1: in agreement (info_nce)", "cannot be used again")),
    "barrier": ((0, 2), ("rank 1: in torch.distributed.barrier, called at", "rank 1 waits in a collective of its own",
                         "rank 1 is 1 call behind", "cannot be used again")),
}
"""Per misuse: the ranks that raise within seconds, and what their error says."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("misuse", sorted(OUT_OF_STEP))
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_skips_its_backward_or_calls_a_barrier_instead_is_named_within_seconds(
    pool: Callable[[int], WorkerPool], mode: str, misuse: str
) -> None:
    per_rank = pool(3).run(_out_of_step, mode, misuse, timeout=60, return_exceptions=True)
    assert all(isinstance(outcome, dict) and outcome["after"] for outcome in per_rank), per_rank
    named, needles = OUT_OF_STEP[misuse]
    for rank in named:
        kind, message, seconds = per_rank[rank]["seen"]
        assert kind == "PeerFailureError" and seconds < PROMPT_S, (rank, kind, message, seconds)
        assert message == per_rank[0]["seen"][1], f"rank {rank}: not the same error as rank 0"
        assert all(needle in message for needle in needles), message
        again = per_rank[rank]["again"]  # a later call on the broken group: the same error at once
        assert again[:2] == (kind, message) and again[2] < PROMPT_S, (rank, again)
    if misuse == "barrier":  # torch's barrier ends with torch's own error at the group's timeout (documented)
        kind, message, seconds = per_rank[1]["seen"]
        assert kind != "no error" and seconds >= GROUP_TIMEOUT_S * 0.9, per_rank[1]


def _one_rank_in_eval_mode(rank: int, world_size: int, mode: str, eval_rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    norm = SyncBatchNorm(8)
    a, b = _features(rank)

    def step() -> None:
        info_nce(norm(a.detach() + 1.0), b, communication=mode).backward()

    norm.train(rank != eval_rank)
    outcome: dict[str, Any] = {"step": _outcome(step)}
    norm.train()
    outcome["after"] = _outcome(step)[0] == "no error" and _works(mode)
    return outcome


@pytest.mark.parametrize("eval_rank", [1, 0])
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_in_eval_mode_with_sync_batchnorm_raises_on_every_rank_without_abort(
    pool: Callable[[int], WorkerPool], mode: str, eval_rank: int
) -> None:
    per_rank = pool(3).run(_one_rank_in_eval_mode, mode, eval_rank, timeout=60, return_exceptions=True)
    _assert_the_same_error_everywhere(per_rank, "ValueError", "from different operations",
                                      f"rank {eval_rank}: info_nce", "SyncBatchNorm in eval mode")
