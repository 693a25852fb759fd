"""DistributedBatchSampler + EmptySafeCollate on real gloo processes: coverage, step counts, exact eval."""

from __future__ import annotations

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
