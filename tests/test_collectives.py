"""Tensor-parallel group collectives: forward values and backward pairs on real gloo processes."""

from __future__ import annotations

import pytest
import torch

from contrastive_dist import copy_to_group, gather_from_group, reduce_from_group, scatter_to_group


def replicated(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, length, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def check_pairs(rank: int, world_size: int) -> list[str]:
    failures = []
    weights = torch.arange(1.0, world_size + 1, dtype=torch.float64)  # a different loss per rank
    for length in (1, world_size, 2 * world_size + 1, 7):
        full = replicated(length)
        # scatter: this rank's tensor_split slice; its backward gathers every rank's slice gradient.
        x = full.clone().requires_grad_(True)
        piece = scatter_to_group(x, dim=1)
        expected_piece = full.tensor_split(world_size, dim=1)[rank]
        if not torch.equal(piece.detach(), expected_piece):
            failures.append(f"scatter forward, length {length}")
        (piece * weights[rank]).sum().backward()
        expected_grad = torch.cat(
            [torch.full_like(p, float(weights[r])) for r, p in enumerate(full.tensor_split(world_size, dim=1))], dim=1
        )
        if not torch.equal(x.grad, expected_grad):
            failures.append(f"scatter backward, length {length}")
        # gather: the inverse; its backward keeps this rank's slice of the (replicated) gradient.
        local = expected_piece.clone().requires_grad_(True)
        whole = gather_from_group(local, dim=1)
        if not torch.equal(whole.detach(), full):
            failures.append(f"gather forward, length {length}")
        upstream = torch.randn(full.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        (whole * upstream).sum().backward()
        if not torch.equal(local.grad, upstream.tensor_split(world_size, dim=1)[rank]):
            failures.append(f"gather backward, length {length}")
    # reduce: all-reduce forward, identity backward; copy: identity forward, all-reduce backward.
    y = torch.full((3,), float(rank + 1), dtype=torch.float64, requires_grad=True)
    total = reduce_from_group(y)
    if total.tolist() != [world_size * (world_size + 1) / 2] * 3:
        failures.append(f"reduce forward {total.tolist()}")
    (total * weights[rank]).sum().backward()
    if y.grad.tolist() != [float(weights[rank])] * 3:
        failures.append("reduce backward")
    z = torch.ones(3, dtype=torch.float64, requires_grad=True)
    copied = copy_to_group(z)
    if not torch.equal(copied.detach(), z.detach()):
        failures.append("copy forward")
    (copied * weights[rank]).sum().backward()
    if z.grad.tolist() != [float(weights.sum())] * 3:
        failures.append("copy backward")
    return failures


@pytest.mark.parametrize("world_size", [2, 3])
def test_forward_and_backward_pairs(pool, world_size):
    assert pool(world_size).run(check_pairs) == [[]] * world_size


def test_one_process_is_the_identity():
    x = torch.randn(2, 5, requires_grad=True)
    for op in (copy_to_group, reduce_from_group):
        assert op(x) is x
    assert scatter_to_group(x, dim=1) is x and gather_from_group(x) is x
    with pytest.raises(ValueError, match="out of range"):
        scatter_to_group(x, dim=2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        gather_from_group([1, 2])  # type: ignore[arg-type]


def check_uneven_gather_and_subgroup(rank: int, world_size: int) -> list[str]:
    """gather_from_group with any per-rank lengths (one empty), in the world and in a subgroup."""
    import torch.distributed as dist

    failures = []
    lengths = [3, 0, 2, 1][:world_size]
    full = replicated(sum(lengths))
    start = sum(lengths[:rank])
    local = full.narrow(1, start, lengths[rank]).clone().requires_grad_(True)
    whole = gather_from_group(local, dim=1)
    if not torch.equal(whole.detach(), full):
        failures.append("uneven gather forward")
    upstream = torch.randn(full.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (whole * upstream).sum().backward()
    if not torch.equal(local.grad, upstream.narrow(1, start, lengths[rank])):
        failures.append("uneven gather backward")
    members = [1, 2, 3]
    group = dist.new_group(members)
    if rank in members:
        position = members.index(rank)
        piece = scatter_to_group(replicated(5, seed=1), dim=1, group=group)
        if not torch.equal(piece, replicated(5, seed=1).tensor_split(3, dim=1)[position]):
            failures.append("subgroup scatter")
        if not torch.equal(gather_from_group(piece, dim=1, group=group), replicated(5, seed=1)):
            failures.append("subgroup gather")
        total = reduce_from_group(torch.ones(2, dtype=torch.float64), group=group)
        if total.tolist() != [3.0, 3.0]:
            failures.append(f"subgroup reduce {total.tolist()}")
    dist.barrier()
    return failures


def test_uneven_lengths_and_a_subgroup(pool):
    assert pool(4).run(check_uneven_gather_and_subgroup) == [[]] * 4
