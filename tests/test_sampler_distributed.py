"""DistributedBatchSampler + EmptySafeCollate on real gloo processes: coverage, steps, exact eval, resume."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from contrastive_dist import DistributedBatchSampler, EmptySafeCollate, all_gather


class IdDataset(Dataset):
    """Sample i: (features (3,) float32 built from i, the id i as an int, a dict with a (2, 2) tensor)."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        value = float(index)
        return torch.tensor([value, value**2, -value]), index, {"pair": torch.full((2, 2), value)}


def _epochs_of_ids(rank, world_size, length, batch_size, epochs):
    """Per epoch: the global ids gathered at every step, with and without ``sizes=``."""
    dataset = IdDataset(length)
    sampler = DistributedBatchSampler(dataset, batch_size, seed=11)  # rank and world from the group
    assert (sampler.rank, sampler.num_replicas) == (rank, world_size)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))
    report = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        steps = 0
        gathered_ids = []
        local_sizes = []
        for step, (features, ids, extra) in enumerate(loader):
            local_sizes.append(ids.shape[0])
            assert features.shape == (ids.shape[0], 3) and extra["pair"].shape == (ids.shape[0], 2, 2)
            assert torch.equal(features[:, 0], ids.to(torch.float32))
            with_exchange = all_gather(ids)
            with_sizes = all_gather(ids, sizes=sampler.sizes(step))
            assert torch.equal(with_exchange.tensor, with_sizes.tensor)
            assert with_exchange.sizes == sampler.sizes(step)
            # Rows come in rank order, so this rank's ids sit at its offset.
            offset = with_sizes.offset
            assert torch.equal(with_sizes.tensor[offset : offset + ids.shape[0]], ids)
            gathered_ids.append(with_sizes.tensor.tolist())
            steps += 1
        # Ranks agree on the number of steps (a mismatch would already have hung the gathers).
        counts = [None] * world_size
        dist.all_gather_object(counts, steps)
        report.append({"steps": steps, "all_steps": counts, "ids": gathered_ids, "local_sizes": local_sizes})
    return report


def test_every_sample_once_per_epoch_on_three_ranks(pool):
    for length, batch_size, last_sizes in ((100, 8, (2, 1, 1)), (49, 8, (1, 0, 0)), (2, 4, (1, 1, 0))):
        reports = pool(3).run(_epochs_of_ids, length, batch_size, 2)
        steps = -(-length // (3 * batch_size))
        orders = []
        for epoch in range(2):
            per_rank = [report[epoch] for report in reports]
            assert all(part["steps"] == steps and part["all_steps"] == [steps] * 3 for part in per_rank)
            # Every rank gathered the same global batches; over the epoch they are range(length) exactly once.
            assert all(part["ids"] == per_rank[0]["ids"] for part in per_rank)
            flat = [index for step_ids in per_rank[0]["ids"] for index in step_ids]
            assert sorted(flat) == list(range(length))
            assert tuple(part["local_sizes"][-1] for part in per_rank) == last_sizes
            orders.append(flat)
        if length > 2:
            assert orders[0] != orders[1]


def _exact_validation_metrics(rank, world_size, length, batch_size):
    """Sum, mean and max of a per-sample score over a validation set split with shuffle=False."""
    dataset = IdDataset(length)
    sampler = DistributedBatchSampler(dataset, batch_size, shuffle=False)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))
    total = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    maximum = torch.full((), -float("inf"), dtype=torch.float64)
    for features, _, _ in loader:
        score = torch.sin(features.to(torch.float64)).sum(dim=1)
        total += score.sum()
        count += score.shape[0]
        if score.numel():
            maximum = torch.maximum(maximum, score.max())
    dist.all_reduce(total)
    dist.all_reduce(count)
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX)
    return total.item(), count.item(), maximum.item()


def test_validation_metrics_on_three_ranks_equal_single_process(pool):
    for length, batch_size in ((100, 8), (49, 8), (7, 5), (1, 3)):
        results = pool(3).run(_exact_validation_metrics, length, batch_size)
        # Single-process float64 reference, one sample at a time.
        scores = []
        for index in range(length):
            features = IdDataset(length)[index][0].to(torch.float64)
            scores.append(sum(torch.sin(value).item() for value in features))
        reference = (sum(scores), float(length), max(scores))
        for total, count, maximum in results:
            assert count == reference[1]
            assert abs(total - reference[0]) <= 1e-9 * max(1.0, abs(reference[0]))
            assert maximum == reference[2]
            assert abs(total / count - reference[0] / reference[1]) <= 1e-12 * max(1.0, abs(reference[0]))


# -- resume on another number of ranks ----------------------------------------------------------------

RESUME_LENGTH, RESUME_SEED, RESUME_LR, RESUME_SCALE = 37, 3, 0.5, 3.0  # global batch 12: 12, 12, 12, 1


def resume_point(index: int) -> torch.Tensor:
    return torch.tensor([index / RESUME_LENGTH, (index % 5) - 2.0], dtype=torch.float64)


def resume_towers(weights):
    """Two float64 linear towers, seeded, or loaded from ``weights`` (a list of parameter lists)."""
    torch.manual_seed(0)
    image, text = torch.nn.Linear(2, 3).double(), torch.nn.Linear(2, 3).double()
    if weights is not None:
        with torch.no_grad():
            for parameter, values in zip([*image.parameters(), *text.parameters()], weights, strict=True):
                parameter.copy_(torch.tensor(values, dtype=torch.float64).view_as(parameter))
    return image, text


def _train_segment(rank, world_size, batch_size, state, weights, steps):
    """From ``state`` (None: a fresh epoch), train ``steps`` steps (None: to the epoch's end) as DDP does.

    Returns the ids of this rank per step, the state any rank would save, and the weights.
    """
    from contrastive_dist import DistributedInfoNCE

    image, text = resume_towers(weights)
    parameters = [*image.parameters(), *text.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=RESUME_LR)
    dataset = [(resume_point(index), index) for index in range(RESUME_LENGTH)]
    sampler = DistributedBatchSampler(RESUME_LENGTH, batch_size, seed=RESUME_SEED)
    if state is not None:
        sampler.load_state_dict(state)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))
    seen, loss_fn = [], DistributedInfoNCE()
    for step, (points, ids) in enumerate(loader, start=sampler.first_step):
        if steps is not None and len(seen) == steps:
            break
        seen.append((step, ids.tolist(), sampler.sizes(step)))
        loss = loss_fn(image(points), text(points.flip(1)), RESUME_SCALE, sizes=sampler.sizes(step))
        optimizer.zero_grad()
        loss.backward()
        for parameter in parameters:  # what DDP does: the mean of the ranks' gradients
            dist.all_reduce(parameter.grad)
            parameter.grad /= world_size
        optimizer.step()
    saved = sampler.state_dict(step=sampler.first_step + len(seen))
    return seen, saved, [parameter.detach().flatten().tolist() for parameter in parameters]


def _resume_reference():
    """One process, float64, a plain loop and a plain CLIP loss over the epoch's global batches of 12."""
    import torch.nn.functional as F

    image, text = resume_towers(None)
    parameters = [*image.parameters(), *text.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=RESUME_LR)
    order = []
    for global_batch in DistributedBatchSampler(RESUME_LENGTH, 12, num_replicas=1, rank=0, seed=RESUME_SEED):
        order.append(global_batch)
        points = torch.stack([resume_point(index) for index in global_batch])
        logits = RESUME_SCALE * image(points) @ text(points.flip(1)).T
        labels = torch.arange(len(global_batch))
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return order, [parameter.detach().flatten().tolist() for parameter in parameters]


def test_resume_on_three_ranks_and_on_one_trains_to_the_weights_of_an_uninterrupted_run(pool):
    reference_order, reference_weights = _resume_reference()
    # 2 ranks × 6 for 1 step, saved mid-epoch, then the rest of the epoch on 3 × 4, on 1 × 12 (the same global
    # batch: the same batches, so the same weights), and on 3 × 5 (another: still every sample once).
    first = pool(2).run(_train_segment, 6, None, None, 1, timeout=120)
    saved = first[0][1]
    assert all(result[1] == saved for result in first) and saved["consumed"] == 12  # any rank's state
    for world, batch, same_global_batch in ((3, 4, True), (1, 12, True), (3, 5, False)):
        rest = pool(world).run(_train_segment, batch, saved, first[0][2], None, timeout=120)
        steps = [[entry for entry in result[0]] for result in rest]
        assert all([entry[0] for entry in rank_steps] == [entry[0] for entry in steps[0]] for rank_steps in steps)
        assert steps[0][0][0] == 1  # the epoch continues at its step 1
        global_batches = [[entry[1] for entry in first[rank][0]] for rank in range(2)]
        global_batches = [sum((part[0] for part in global_batches), [])]
        global_batches += [sum((rank_steps[index][1] for rank_steps in steps), []) for index in range(len(steps[0]))]
        assert sorted(sum(global_batches, [])) == list(range(RESUME_LENGTH))  # every sample exactly once
        assert all(rest_result[1]["consumed"] == RESUME_LENGTH for rest_result in rest)
        if same_global_batch:
            assert global_batches == reference_order
            assert steps[0][-1][2] == ((1, 0, 0) if world == 3 else (1,))  # the uneven last step, empty ranks
            for _, _, weights in rest:
                got = [value for tensor in weights for value in tensor]
                expected = [value for tensor in reference_weights for value in tensor]
                assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)


def _load_before_the_first_step(rank, world_size, state, length, seed):
    """Load ``state`` into this rank's sampler; the error message, or the first batch if none."""
    sampler = DistributedBatchSampler(length, 4, seed=seed)
    try:
        sampler.load_state_dict(state)
    except ValueError as error:
        return f"ValueError: {error}"
    return next(iter(sampler))


def test_a_resume_under_the_wrong_conditions_raises_the_same_error_on_every_rank_before_the_first_step(pool):
    state = DistributedBatchSampler(RESUME_LENGTH, 6, num_replicas=2, rank=0, seed=RESUME_SEED).state_dict(step=1)
    cases = [(state, RESUME_LENGTH + 1, RESUME_SEED, "saved for a dataset of 37 samples, this sampler has 38"),
             (state, RESUME_LENGTH, RESUME_SEED + 1, "saved with seed=3, this sampler has seed=4"),
             ({**state, "consumed": "12"}, RESUME_LENGTH, RESUME_SEED, "'consumed' must be an int"),
             ({**state, "step": 13}, RESUME_LENGTH, RESUME_SEED, r"'step' must be an int in \[1, 12\], got 13")]
    for bad, length, seed, message in cases:
        outcomes = pool(3).run(_load_before_the_first_step, bad, length, seed, timeout=60)
        assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
        assert isinstance(outcomes[0], str) and outcomes[0].startswith("ValueError: cannot resume")
        assert re.search(message, outcomes[0]), outcomes[0]


def _first_batch_after_loading(rank, world_size, states, epochs):
    """Load ``states[rank]`` (None: none), set ``epochs[rank]``; the first batch's error, or the batch."""
    sampler = DistributedBatchSampler(RESUME_LENGTH, 4, seed=RESUME_SEED)
    sampler.set_epoch(epochs[rank])
    if states[rank] is not None:
        sampler.load_state_dict(states[rank])
    loader = DataLoader(range(RESUME_LENGTH), batch_sampler=sampler)
    try:
        return next(iter(loader)).tolist()
    except ValueError as error:
        return f"ValueError: {error}"


def test_ranks_that_load_different_states_raise_the_same_error_before_the_first_step(pool):
    saved = DistributedBatchSampler(RESUME_LENGTH, 4, num_replicas=3, rank=0, seed=RESUME_SEED)
    at_one, at_two = saved.state_dict(step=1), saved.state_dict(step=2)
    cases = [((at_two, at_one, at_two), (0, 0, 0), "rank 1: consumed=12, step=1"),  # one rank a step behind
             ((at_one, at_one, None), (0, 0, 0), "rank 2: consumed=0, step=0"),  # one rank loaded none
             ((None, None, None), (0, 1, 0), "rank 1: epoch=1")]  # one rank in another epoch
    for states, epochs, rank_line in cases:
        outcomes = pool(3).run(_first_batch_after_loading, states, epochs, timeout=60)
        assert all(outcome == outcomes[0] for outcome in outcomes), outcomes
        assert isinstance(outcomes[0], str) and outcomes[0].startswith(
            "ValueError: DistributedBatchSampler: every rank must start the epoch at the same step"), outcomes[0]
        assert rank_line in outcomes[0], outcomes[0]
    same = pool(3).run(_first_batch_after_loading, (at_one, at_one, at_one), (0, 0, 0), timeout=60)
    assert all(isinstance(batch, list) and len(batch) == 4 for batch in same), same  # the same state: no error
