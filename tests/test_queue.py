"""DistributedMemoryQueue: the same FIFO on every rank as in one process, checkpoints, clear errors."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
from outcomes import error_outcomes

from contrastive_dist import DistributedMemoryQueue
from contrastive_dist.testing import WorkerPool

SIZE, DIM = 10, 5
# Seven steps of uneven per-rank batches: some ranks empty, one global batch larger than the
# queue (12 > 10), and a short last one.
STEPS: dict[int, list[tuple[int, ...]]] = {
    1: [(6,), (6,), (3,), (0,), (4,), (12,), (1,)],
    2: [(3, 3), (0, 6), (2, 1), (5, 0), (1, 3), (7, 5), (0, 1)],
    3: [(3, 2, 1), (0, 4, 2), (2, 2, 2), (5, 0, 1), (1, 3, 0), (4, 4, 4), (1, 0, 0)],
}


def global_batches(world_size: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(world_size)
    return [torch.randn(sum(shards), DIM, generator=generator) for shards in STEPS[world_size]]


def reference_queue(batches: list[torch.Tensor], size: int) -> torch.Tensor:
    """One process, a Python list: push every row in order, keep the last ``size``, newest first."""
    pushed: list[torch.Tensor] = []
    for batch in batches:
        pushed.extend(batch)
    kept = pushed[-size:][::-1]
    return torch.stack(kept) if kept else torch.zeros(0, DIM)


def run_steps(rank: int, world_size: int, resume_at: int | None) -> list[torch.Tensor]:
    """Enqueue this rank's share of every step; optionally restart from a saved state at ``resume_at``."""
    queue = DistributedMemoryQueue(SIZE, DIM)
    states = []
    for step, (shards, batch) in enumerate(zip(STEPS[world_size], global_batches(world_size), strict=True)):
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save(queue.state_dict(), buffer)
            buffer.seek(0)
            queue = DistributedMemoryQueue(SIZE, DIM)
            queue.load_state_dict(torch.load(buffer))
        start = sum(shards[:rank])
        keys = batch[start : start + shards[rank]].requires_grad_()  # detached by the queue
        queue.enqueue(keys)
        states.append(queue.negatives.keys)
    return states


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_queue_after_uneven_steps_equals_the_single_process_queue_on_every_rank(
    pool: Callable[[int], WorkerPool], world_size: int
) -> None:
    batches = global_batches(world_size)
    for resume_at in (None, 4):
        per_rank = pool(world_size).run(run_steps, resume_at, timeout=60)
        for step in range(len(batches)):
            expected = reference_queue(batches[: step + 1], SIZE)
            for rank, states in enumerate(per_rank):
                assert torch.equal(states[step], expected), f"W={world_size} rank {rank} step {step} resume={resume_at}"
                assert not states[step].requires_grad


def test_single_process_queue_matches_the_list_reference_and_round_trips() -> None:
    generator = torch.Generator().manual_seed(0)
    queue = DistributedMemoryQueue(7, DIM)
    assert len(queue) == 0 and queue.negatives.keys.shape == (0, DIM)
    batches = [torch.randn(count, DIM, generator=generator, dtype=torch.float64) for count in (3, 0, 5, 9, 1, 2)]
    for index, batch in enumerate(batches):
        queue.enqueue(batch)
        expected = reference_queue([b.float() for b in batches[: index + 1]], 7)
        assert torch.equal(queue.negatives.keys, expected)
        assert len(queue) == expected.shape[0]
    snapshot = queue.negatives.keys
    queue.enqueue(torch.randn(2, DIM))
    assert not torch.equal(snapshot, queue.negatives.keys)  # a snapshot, not a view of the buffer
    restored = DistributedMemoryQueue(7, DIM)
    restored.load_state_dict(queue.state_dict())
    assert torch.equal(restored.negatives.keys, queue.negatives.keys)
    assert set(queue.state_dict()) == {"memory", "count"}
    assert "size=7, dim=5, count=7" in repr(queue)


def test_invalid_construction_and_keys_raise() -> None:
    for args, error in (((0, 4), ValueError), ((4, -1), ValueError), ((2.0, 4), TypeError), ((True, 4), TypeError)):
        with pytest.raises(error, match="must be a positive int"):
            DistributedMemoryQueue(*args)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="floating-point"):
        DistributedMemoryQueue(4, 4, dtype=torch.int64)
    queue = DistributedMemoryQueue(4, 4)
    with pytest.raises(ValueError, match=r"shape \(n, 4\).*got \(2, 3\)"):
        queue.enqueue(torch.randn(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        queue.enqueue(torch.ones(2, 4, dtype=torch.long))


GOOD_STATE = {"memory": torch.arange(16.0).view(4, 4), "count": torch.tensor(3)}
BAD_STATES = {
    "a larger queue": ({"memory": torch.zeros(5, 4)}, r"float32 of shape \(4, 4\).*got torch.float32 of shape \(5, 4"),
    "another dim": ({"memory": torch.zeros(4, 3)}, r"\(4, 4\) for this queue \(size=4, dim=4\), got .* \(4, 3\)"),
    "another dtype": ({"memory": torch.zeros(4, 4, dtype=torch.float64)}, r"be torch.float32 .* got torch.float64"),
    "count too large": ({"count": torch.tensor(9)}, r"count must be one integer in \[0, 4\], got 9"),
    "negative count": ({"count": torch.tensor(-1)}, r"in \[0, 4\], got -1"),
    "fractional count": ({"count": torch.tensor(2.5)}, r"in \[0, 4\], got 2.5"),
    "count of two values": ({"count": torch.tensor([1, 2])}, r"got a tensor of shape \(2,\)"),
    "NaN key": ({"memory": GOOD_STATE["memory"].clone().index_fill_(0, torch.tensor([2]), float("nan"))},
                "must be finite"),
    "infinite key": ({"memory": GOOD_STATE["memory"].clone().index_fill_(0, torch.tensor([0]), float("inf"))},
                     "must be finite"),
}


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_a_saved_state_it_cannot_hold_exactly_is_refused_and_leaves_the_queue_as_it_was(case: str) -> None:
    change, message = BAD_STATES[case]
    queue = DistributedMemoryQueue(4, 4)
    queue.load_state_dict(GOOD_STATE)
    before = {name: value.clone() for name, value in queue.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        queue.load_state_dict({**GOOD_STATE, **change})
    assert all(torch.equal(queue.state_dict()[name], value) for name, value in before.items())


def test_what_a_saved_state_may_hold() -> None:
    queue = DistributedMemoryQueue(4, 4)
    # An integral float count is exact; NaN beyond the count is never read (the unfilled rows).
    unused_nan = GOOD_STATE["memory"].clone().index_fill_(0, torch.tensor([3]), float("nan"))
    queue.load_state_dict({"memory": unused_nan, "count": torch.tensor(3.0)})
    assert len(queue) == 3 and torch.equal(queue.negatives.keys, GOOD_STATE["memory"][:3])
    with pytest.raises(TypeError, match="holds tensors memory"):
        queue.load_state_dict({"memory": GOOD_STATE["memory"], "count": 3})  # type: ignore[dict-item]
    with pytest.raises(RuntimeError, match="Missing key"):  # torch's own strict check
        queue.load_state_dict({"memory": GOOD_STATE["memory"]})


def test_non_finite_keys_are_refused_in_one_process() -> None:
    queue = DistributedMemoryQueue(4, 2)
    queue.enqueue(torch.ones(1, 2))
    for keys in (torch.tensor([[0.0, float("nan")]]), torch.tensor([[float("-inf"), 1.0]]),
                 torch.tensor([[1e300, 0.0]], dtype=torch.float64)):  # finite in float64, inf as float32
        with pytest.raises(ValueError, match=r"finite, got NaN or infinite values in the keys of rank\(s\) \[0"):
            queue.enqueue(keys)
    assert len(queue) == 1 and torch.equal(queue.negatives.keys, torch.ones(1, 2))


def _mismatch_on_rank_one(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    checks = {
        # Rank 1's queue was built with another dim (and its keys fit it): the gather disagrees.
        "queue dim": lambda: DistributedMemoryQueue(SIZE, 6 if rank == 1 else DIM).enqueue(
            torch.randn(2, 6 if rank == 1 else DIM)
        ),
        # Rank 1 passes keys that do not fit its queue.
        "keys shape": lambda: DistributedMemoryQueue(SIZE, DIM).enqueue(torch.randn(2, DIM + 1 if rank == 1 else DIM)),
        # Rank 2's second key is NaN: every rank holds the gathered rows and refuses them alike.
        "NaN key": lambda: DistributedMemoryQueue(SIZE, DIM).enqueue(
            torch.randn(2, DIM).index_fill_(0, torch.tensor([1]), float("nan") if rank == 2 else 0.0)
        ),
    }
    outcome = error_outcomes(checks)
    queue = DistributedMemoryQueue(SIZE, DIM)
    queue.enqueue(torch.randn(rank, DIM))  # the group still works
    outcome["after"] = ("count", str(len(queue)))
    return outcome


def test_dim_mismatch_raises_on_every_rank(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_mismatch_on_rank_one, timeout=20, return_exceptions=True)
    for rank, outcome in enumerate(per_rank):
        assert isinstance(outcome, dict), f"rank {rank}: {outcome!r}"
        assert outcome["after"] == ("count", "3")
        assert outcome["queue dim"][0] == "ValueError" and "do not agree" in outcome["queue dim"][1], outcome
        assert outcome["keys shape"][0] == "ValueError" and "(on rank 1;" in outcome["keys shape"][1], outcome
        assert outcome["NaN key"] == ("ValueError", per_rank[0]["NaN key"][1]), outcome
        assert "keys of rank(s) [2]" in outcome["NaN key"][1], outcome


class _MoCoLike(torch.nn.Module):
    """An encoder with its queue as a submodule, as a user would hold it (DDP broadcasts its buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, DIM)
        self.queue = DistributedMemoryQueue(7, DIM, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.encoder(x), dim=-1)


TRAIN_STEPS = [(2, 1, 0), (0, 3, 2), (1, 1, 1), (4, 0, 1), (1, 0, 0)]


def _training_data() -> tuple[_MoCoLike, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(3)
    model = _MoCoLike().double()
    batches = [(torch.randn(sum(s), 4, dtype=torch.float64), torch.randn(sum(s), 4, dtype=torch.float64))
               for s in TRAIN_STEPS]
    return model, batches


def _train(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from contrastive_dist import info_nce

    model, batches = _training_data()
    steps = TRAIN_STEPS if world_size > 1 else [(sum(shards),) for shards in TRAIN_STEPS]
    trained = torch.nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for shards, (x_query, x_key) in zip(steps, batches, strict=True):
        start, stop = sum(shards[:rank]), sum(shards[: rank + 1])
        queries = trained(x_query[start:stop])
        with torch.no_grad():
            keys = model(x_key[start:stop])  # a key encoder without gradient (MoCo uses a momentum copy)
        optimizer.zero_grad()
        info_nce(queries, keys, 5.0, symmetric=False, negatives=model.queue.negatives, chunk_size=2).backward()
        optimizer.step()
        model.queue.enqueue(keys)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_ddp_training_with_the_queue_matches_one_process(pool: Callable[[int], WorkerPool]) -> None:
    expected = _train(0, 1)
    assert len(expected["queue.memory"]) == 7 and int(expected["queue.count"]) == 7
    for rank, state in enumerate(pool(3).run(_train, timeout=60)):
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-10, atol=1e-10, msg=f"rank {rank} {name}")
