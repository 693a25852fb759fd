"""A peer that vanished is named: real gloo processes, a rank that dies or hangs in the middle of a step.

A rank that exits between the loss's forward and its backward (as after an out-of-memory error) must
leave every other rank with a :class:`PeerFailureError` that names the operation, the rank that died
and where to look, chained to gloo's own error where this rank's transfer failed, within seconds, not
the process group's timeout. Here the survivors exit after their error; ``test_kill_matrix.py`` kills
on up to 5 ranks, with survivors that stay alive after their error.

A rank that stays alive but never joins is only found by the process group's ``timeout=``: the others
get the same named error once it has passed.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from contrastive_dist import SyncBatchNorm, info_nce
from contrastive_dist.engine._faults import PeerFailureError, is_transport_failure, naming_peers
from contrastive_dist.testing import RemoteError, WorkerPool

DYING_RANK = 1
FIRST_SURVIVOR, LAST_SURVIVOR = 2, 0  # the first exits after its error, the last then fails again
SIZES = (3, 2, 4)  # rows per rank; the gather and the ring both talk to every rank at W = 3


def _record(out_dir: str, rank: int, entry: dict[str, object]) -> None:
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(entry))


def _dies_between_forward_and_backward(rank: int, world_size: int, out_dir: str, case: str) -> None:
    """One step; the dying rank exits after the forward; the others record their error and exit too.

    The last survivor first waits until the other has exited after its error, and tries another step
    on the broken group: its second error must still name the rank that died, not the one that left.
    """
    torch.manual_seed(rank)

    def forward() -> torch.Tensor:
        if case == "SyncBatchNorm":
            return SyncBatchNorm(4)(torch.randn(SIZES[rank], 4, 3, requires_grad=True)).square().sum()
        image = torch.randn(SIZES[rank], 8, requires_grad=True)
        text = torch.randn(SIZES[rank], 8, requires_grad=True)
        return info_nce(image, text, communication=case)

    loss = forward()
    if rank == DYING_RANK:
        _record(out_dir, rank, {"died_at": time.time()})
        os._exit(17)  # as a process does after an uncaught error (out of memory in the backward, say)
    start = time.monotonic()
    entry = _outcome(loss.backward)
    entry.update(seconds=time.monotonic() - start, stopped_at=time.time())
    if rank == LAST_SURVIVOR:
        other = Path(out_dir, f"rank{FIRST_SURVIVOR}.json")
        deadline = time.monotonic() + 30.0
        while not other.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # it exits right after writing its record
        entry["again"] = _outcome(forward)
    _record(out_dir, rank, entry)
    os._exit(0)  # a training script ends on such an error: its connections close, freeing its peers


def _outcome(call: Callable[[], object]) -> dict[str, object]:
    """What ``call`` raised (its type, message, suspects, cause), or ``{"error": None}``."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - recorded for the test, whatever it is
        cause = error.__cause__
        return {
            "error": type(error).__name__,
            "message": str(error),
            "suspects": list(getattr(error, "suspects", [])),
            "timed_out": getattr(error, "timed_out", None),
            "cause": f"{type(cause).__name__}: {cause}" if cause is not None else None,
        }
    return {"error": None}


OPERATIONS = {
    "gather": "gather backward (reduce-scatter of the gradient rows)",
    "ring": "ring step",
    "SyncBatchNorm": "SyncBatchNorm backward (sum of the gradient statistics)",
}
PROCESS_GROUP_TIMEOUT_S = 60.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", sorted(OPERATIONS))
def test_a_rank_that_exits_between_forward_and_backward_is_named_on_every_other_rank(tmp_path: Path, case: str) -> None:
    with WorkerPool(len(SIZES), timeout=PROCESS_GROUP_TIMEOUT_S) as pool:
        outcomes = pool.run(
            _dies_between_forward_and_backward, str(tmp_path), case, timeout=120, return_exceptions=True
        )
    assert all(isinstance(outcome, RemoteError) and "died" in str(outcome) for outcome in outcomes), outcomes
    assert "exit code 17" in str(outcomes[DYING_RANK])
    records = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(len(SIZES))}
    died_at = records.pop(DYING_RANK)["died_at"]
    for rank, record in records.items():
        assert record["error"] == "PeerFailureError", (rank, record)
        message = record["message"]
        assert message.startswith(OPERATIONS[case]) and f"failed on rank {rank} of 3" in message, message
        assert "rank 1 is gone" in message and "own first error is the cause" in message, message
        # A rank whose own transfer failed quotes the transport; one that waited on a live peer learnt it
        # through the store.
        assert "Transport error:" in message or "through the process group's store" in message, message
        assert record["timed_out"] is False, record
        if record["cause"] is not None:
            assert record["cause"].startswith("RuntimeError") and "peer" in record["cause"].lower(), record
        # Found by the closed connection and the roll call, not by the process group's timeout.
        assert record["seconds"] < PROCESS_GROUP_TIMEOUT_S / 2, record
    # Every survivor names the dead rank alone, whichever peer its own transfer waited on.
    named = [record["suspects"] for record in records.values()]
    assert named == [[DYING_RANK]] * len(records), named
    # Failing again on the broken group, after the other survivor left: still the rank that died.
    again = records[LAST_SURVIVOR]["again"]
    assert again["error"] == "PeerFailureError" and again["suspects"] == [DYING_RANK], again
    assert "rank 1 is gone" in again["message"], again
    stopped = max(record["stopped_at"] for record in records.values()) - died_at
    print(
        f"{case}: every rank stopped {stopped:.2f} s after rank {DYING_RANK} exited; "
        f"errors after {[round(r['seconds'], 2) for r in records.values()]} s"
    )


HANG_TIMEOUT_S = 6.0


def _never_joins_the_backward(rank: int, world_size: int) -> dict[str, object]:
    """Rank 1 stays alive but skips the backward; on a group of its own, so the pool's group stays whole."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    image, text = (torch.randn(SIZES[rank], 8, requires_grad=True) for _ in range(2))
    loss = info_nce(image, text, group=group)
    outcome: dict[str, object] = {}
    if rank == DYING_RANK:
        time.sleep(HANG_TIMEOUT_S + 4.0)  # alive, busy elsewhere: its peers time out meanwhile
    else:
        start = time.monotonic()
        try:
            loss.backward()
        except PeerFailureError as error:
            outcome = {
                "message": str(error),
                "suspects": list(error.suspects),
                "timed_out": error.timed_out,
                "cause": str(error.__cause__),
            }
        outcome["seconds"] = time.monotonic() - start
    del loss, image, text
    # Every rank keeps the timed-out group, and so answers its roll calls, until all have their outcome
    # (a barrier of the pool's own group): a survivor whose transfer times out later than another's (a
    # send to a rank that stopped on its own error) would otherwise find that rank gone, and name it.
    dist.barrier()
    # The timed-out group is useless now; every rank drops it (no collective: safe on a broken group).
    dist.destroy_process_group(group)
    return outcome


@pytest.mark.timeout(180)
def test_a_rank_that_stays_alive_but_never_joins_is_named_after_the_process_group_timeout(
    pool: Callable[[int], WorkerPool],
) -> None:
    outcomes = pool(3).run(_never_joins_the_backward, timeout=90)
    for rank, outcome in enumerate(outcomes):
        if rank == DYING_RANK:
            continue
        message = outcome["message"]
        assert outcome["timed_out"] is True and DYING_RANK in outcome["suspects"], outcome
        assert (
            message.startswith("gather backward") and "did not take part within the process group's timeout" in message
        )
        assert "init_process_group(timeout=...)" in message and "py-spy" in message, message
        assert "Timed out" in outcome["cause"] or "timeout" in outcome["cause"].lower(), outcome
        # Bounded by the group's timeout, and not much longer (one timeout, not one per operation).
        assert HANG_TIMEOUT_S * 0.9 <= outcome["seconds"] < HANG_TIMEOUT_S * 3, outcome


def test_only_transport_failures_are_translated_and_named_with_the_group_ranks() -> None:
    assert is_transport_failure(RuntimeError("[pair.cc:545] Read error [127.0.0.1]:58593: Connection reset by peer"))
    assert is_transport_failure(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert is_transport_failure(dist.DistBackendError("NCCL watchdog"))
    assert not is_transport_failure(RuntimeError("Tensors must be contiguous"))
    assert not is_transport_failure(ValueError("connection closed by peer"))  # not the transport's kind
    with pytest.raises(RuntimeError, match="contiguous") as raised:
        with naming_peers("gather", None):
            raise RuntimeError("Tensors must be contiguous")
    assert type(raised.value) is RuntimeError  # passed through unchanged
    error = PeerFailureError("m", operation="ring step 2 of 3", rank=0, suspects=(1,), timed_out=False)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.operation, copy.rank, copy.suspects, copy.timed_out, str(copy)) == (
        "ring step 2 of 3",
        0,
        (1,),
        False,
        "m",
    )
