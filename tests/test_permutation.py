"""The constant-memory order of DistributedBatchSampler: bijection, reference, statistics against randperm."""

from __future__ import annotations

import math

import pytest
import torch
from permutation_reference import reference_order

from contrastive_dist.data._permutation import Permutation, _walk_into_range

Z_LIMIT = 5.0  # a true random permutation exceeds 5 standard deviations with probability ~6e-7


def test_every_length_up_to_ten_thousand_is_a_bijection():
    """All 10⁴ lengths at once per cipher width: one tabulated cipher pass, then the module's own walk."""
    for seed, epoch in ((0, 0), (-(2**63), 2**63 - 1)):
        for bits in range(2, 15):
            lengths = torch.tensor([n for n in range(1, 10_001) if max(2, (n - 1).bit_length()) == bits])
            order = Permutation(int(lengths[0]), seed, epoch)
            table = order._encipher(torch.arange(2**bits))
            assert torch.equal(table.sort().values, torch.arange(2**bits))  # the cipher itself
            # Lengths in chunks of about 2·10⁶ positions (memory): each position walks with its own bound.
            for chunk in torch.split(lengths, max(1, 2_000_000 // int(lengths[-1]))):
                bound = torch.repeat_interleave(chunk, chunk)
                starts = torch.cumsum(chunk, 0) - chunk
                positions = torch.arange(bound.numel()) - torch.repeat_interleave(starts, chunk)
                values = _walk_into_range(table.__getitem__, positions, bound)
                if order.swap_first_two:
                    values = torch.where((values < 2) & (bound >= 2), 1 - values, values)
                assert bool((values < bound).all())
                hits = torch.bincount(values + torch.repeat_interleave(starts, chunk), minlength=bound.numel())
                assert bool((hits == 1).all()), f"not a bijection for a length among {chunk.tolist()[:3]}..."
            # The same walk is what Permutation.__call__ does, length by length.
            for length in lengths[:: max(1, len(lengths) // 7)].tolist():
                whole = Permutation(length, seed, epoch)(torch.arange(length))
                assert torch.equal(whole.sort().values, torch.arange(length))


@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 15, 16, 17, 100, 1000, 4097])
def test_matches_the_plain_python_reference(length):
    for seed, epoch in ((0, 0), (7, 3), (-5, 11), (2**63 - 1, 2**63 - 1)):
        order = Permutation(length, seed, epoch)
        assert order(torch.arange(length)).tolist() == reference_order(length, seed, epoch)
        # Any positions, any shape, any order: the same values as the whole order.
        positions = torch.randint(0, length, (3, 5), generator=torch.Generator().manual_seed(length))
        expected = reference_order(length, seed, epoch)
        assert order(positions).tolist() == [[expected[p] for p in row] for row in positions]


def test_random_lengths_up_to_ten_million_are_bijections():
    generator = torch.Generator().manual_seed(2024)
    exponents = torch.rand(14, generator=generator, dtype=torch.float64) * 2 + 4  # 10⁴ .. 10⁶
    lengths = [int(10**e) for e in exponents] + [2**20, 2**20 + 1, 3_000_017, 10**7]
    for index, length in enumerate(lengths):
        order = Permutation(length, seed=index, epoch=1)
        hits = torch.zeros(length, dtype=torch.int32)
        for positions in torch.arange(length).split(2_000_000):
            values = order(positions)
            assert int(values.min()) >= 0 and int(values.max()) < length
            hits.index_add_(0, values, torch.ones_like(values, dtype=torch.int32))
        assert bool((hits == 1).all()), f"length {length} is not a bijection"


def test_huge_lengths_stay_in_range_and_agree_across_calls():
    for length in (2_000_000_000, 2**31, 2**31 + 1, 2**62):
        order = Permutation(length, seed=3, epoch=2)
        positions = torch.cat([torch.arange(4096), torch.arange(length - 4096, length)])
        values = order(positions)
        assert int(values.min()) >= 0 and int(values.max()) < length
        assert values.unique().numel() == positions.numel()
        assert torch.equal(order(positions[4000:4200]), values[4000:4200])  # position by position


@pytest.mark.parametrize(
    ("arguments", "options", "error", "message"),
    [
        ((0, 1), {}, ValueError, r"length must be in \[1, 2\*\*62\]"),
        ((2**62 + 1, 1), {}, ValueError, r"length must be in \[1, 2\*\*62\]"),
        ((10, 2**63), {}, ValueError, "seed must fit in a signed 64-bit int"),
        ((10, -(2**63) - 1), {}, ValueError, "seed must fit in a signed 64-bit int"),
        ((10, 1.0), {}, TypeError, "seed must be an int"),
        ((10, 1, -1), {}, ValueError, r"epoch must be in \[0, 2\*\*63 - 1\]"),
        ((10, 1), {"rounds": 16}, ValueError, r"rounds must be in \[1, 15\]"),
    ],
)
def test_invalid_arguments(arguments, options, error, message):
    with pytest.raises(error, match=message):
        Permutation(*arguments, **options)


def test_invalid_positions():
    order = Permutation(10, 0)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 10\)"):
        order(torch.tensor([3, 10]))
    with pytest.raises(TypeError, match="int64 tensor"):
        order(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="torch.Tensor"):
        order([1, 2])  # type: ignore[arg-type]


# ---- statistics: each check runs on this order, on torch.randperm, and on a weak order it must reject


def _correlation_z(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation times sqrt(n): about N(0, 1) for independent uniform orders."""
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()) * math.sqrt(a.numel()))


def _order_z_scores(order: torch.Tensor, other_epoch: torch.Tensor) -> dict[str, float]:
    n = order.numel()
    identity = torch.arange(n)
    ascents = int((order[1:] > order[:-1]).sum())  # mean (n-1)/2, variance (n+1)/12
    return {
        "identity": _correlation_z(identity, order),
        **{f"lag {lag}": _correlation_z(order[:-lag], order[lag:]) for lag in (1, 2, 3, 64)},
        "next epoch": _correlation_z(order, other_epoch),
        "ascents": (ascents - (n - 1) / 2) / math.sqrt((n + 1) / 12),
    }


def _chi_square_z(counts: torch.Tensor, degrees: int) -> float:
    """Wilson-Hilferty: a chi-square statistic with ``degrees`` degrees of freedom as an N(0, 1) score."""
    expected = counts.sum() / counts.numel()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    scale = 2 / (9 * degrees)
    return ((statistic / degrees) ** (1 / 3) - (1 - scale)) / math.sqrt(scale)


LENGTH = 100_003


def test_orders_are_uncorrelated_like_randperm():
    positions = torch.arange(LENGTH)
    shift = torch.Generator().manual_seed(1)
    candidates = {
        "permutation": lambda epoch: Permutation(LENGTH, 5, epoch)(positions),
        "randperm": lambda epoch: torch.randperm(LENGTH, generator=torch.Generator().manual_seed(epoch)),
        # Weak: a random rotation looks uniform position by position but is perfectly ordered locally.
        "rotation": lambda epoch: (positions + torch.randint(LENGTH, (), generator=shift)) % LENGTH,
    }
    for name, draw in candidates.items():
        for epoch in range(3):
            scores = _order_z_scores(draw(epoch), draw(epoch + 1))
            worst = max(abs(score) for score in scores.values())
            if name == "rotation":
                assert worst > 100, scores
            else:
                assert worst < Z_LIMIT, (name, epoch, scores)


def _over_epochs(length: int, epochs: int, draw) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Counts over epochs: where each element lands, which ordered pair opens the order, even orders."""
    where = torch.zeros(length, length)
    pairs = torch.zeros(length, length)
    even = 0
    positions = torch.arange(length)
    for epoch in range(epochs):
        order = draw(epoch)
        where[positions, order] += 1
        pairs[order[0], order[1]] += 1
        even += _is_even(order.tolist())
    return where, pairs, even


def _is_even(order: list[int]) -> bool:
    seen, cycles = [False] * len(order), 0
    for start in range(len(order)):
        if not seen[start]:
            cycles += 1
            while not seen[start]:
                seen[start], start = True, order[start]
    return (len(order) - cycles) % 2 == 0


@pytest.mark.parametrize("length", [3, 5, 10, 16, 37])
def test_position_pair_and_parity_distributions_are_uniform_over_epochs(length):
    epochs = 1200
    candidates = {
        "permutation": lambda epoch: Permutation(length, 9, epoch)(torch.arange(length)),
        "randperm": lambda epoch: torch.randperm(length, generator=torch.Generator().manual_seed(epoch)),
        "2 rounds": lambda epoch: Permutation(length, 9, epoch, rounds=2)(torch.arange(length)),
    }
    for name, draw in candidates.items():
        where, pairs, even = _over_epochs(length, epochs, draw)
        off_diagonal = pairs[~torch.eye(length, dtype=torch.bool)]
        scores = {
            "position": _chi_square_z(where, (length - 1) ** 2),
            "first pair": _chi_square_z(off_diagonal, length * (length - 1) - 1),
            "parity": (even - epochs / 2) / math.sqrt(epochs / 4),
        }
        if name == "2 rounds":
            if length != 16:  # (16 items: 2 rounds of 2-bit halves happen to spread positions evenly)
                assert max(abs(score) for score in scores.values()) > Z_LIMIT, scores
        else:
            assert max(abs(score) for score in scores.values()) < Z_LIMIT, (name, scores)


def test_fixed_points_follow_poisson_one_like_randperm():
    length, epochs = 1000, 300
    positions = torch.arange(length)
    counts = [int((Permutation(length, 2, epoch)(positions) == positions).sum()) for epoch in range(epochs)]
    mean = sum(counts) / epochs
    variance = sum((count - mean) ** 2 for count in counts) / (epochs - 1)
    assert abs(mean - 1) < Z_LIMIT / math.sqrt(epochs)  # Poisson(1): mean 1, variance 1
    assert 0.6 < variance < 1.5
