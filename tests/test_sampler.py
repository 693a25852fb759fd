"""DistributedBatchSampler and EmptySafeCollate on one process, ranks simulated by explicit ``rank=``."""

from __future__ import annotations

import pickle
from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from permutation_reference import reference_order
from torch.utils.data import DataLoader

from contrastive_dist import DistributedBatchSampler, EmptySafeCollate

FAST = settings(max_examples=200, deadline=None)


def all_ranks(length: int, world: int, batch: int, *, shuffle: bool, seed: int = 0, epoch: int = 0):
    samplers = [
        DistributedBatchSampler(length, batch, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        for rank in range(world)
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return samplers


def reference_epoch(length: int, world: int, batch: int, *, shuffle: bool, seed: int, epoch: int):
    """Obviously-correct layout: per step, the global slice dealt out in rank order, extra rows first."""
    if shuffle:
        order = reference_order(length, seed, epoch)  # one position at a time, plain Python
    else:
        order = list(range(length))
    global_batch = batch * world
    steps = []
    for begin in range(0, length, global_batch):
        chunk = order[begin : begin + global_batch]
        per_rank = [[] for _ in range(world)]
        counts = [0] * world
        for position in range(len(chunk)):
            counts[position % world] += 1  # deal one by one: the first ranks get the extra ones
        cursor = 0
        for rank in range(world):
            per_rank[rank] = chunk[cursor : cursor + counts[rank]]
            cursor += counts[rank]
        steps.append(per_rank)
    return steps


layouts = st.tuples(
    st.integers(1, 5000), st.integers(1, 8), st.integers(1, 64), st.booleans(), st.integers(0, 5), st.integers(0, 99)
)


@FAST
@given(layouts)
def test_epoch_layout_matches_reference(layout):
    length, world, batch, shuffle, epoch, seed = layout
    samplers = all_ranks(length, world, batch, shuffle=shuffle, seed=seed, epoch=epoch)
    batches = [list(sampler) for sampler in samplers]
    expected = reference_epoch(length, world, batch, shuffle=shuffle, seed=seed, epoch=epoch)
    steps = len(expected)
    assert all(len(sampler) == steps for sampler in samplers)
    assert all(len(per_rank) == steps for per_rank in batches)
    seen = []
    for step in range(steps):
        sizes = tuple(len(batches[rank][step]) for rank in range(world))
        assert max(sizes) - min(sizes) <= 1
        assert list(sizes) == sorted(sizes, reverse=True)
        assert all(sampler.sizes(step) == sizes for sampler in samplers)
        assert [batches[rank][step] for rank in range(world)] == expected[step]
        for rank in range(world):
            seen.extend(batches[rank][step])
    assert sorted(seen) == list(range(length))
    if not shuffle:
        assert seen == list(range(length))
    # Determinism: a second sampler built the same way (another "process") gives the same batches.
    again = all_ranks(length, world, batch, shuffle=shuffle, seed=seed, epoch=epoch)
    assert [list(sampler) for sampler in again] == batches


@FAST
@given(st.integers(2, 5000), st.integers(1, 8), st.integers(1, 64), st.integers(0, 50))
def test_each_epoch_has_a_new_order(length, world, batch, epoch):
    sampler = DistributedBatchSampler(length, batch, num_replicas=world, rank=0, seed=3)
    others = all_ranks(length, world, batch, shuffle=True, seed=3)

    def global_order(epoch_: int) -> list[int]:
        for other in others:
            other.set_epoch(epoch_)
        per_rank = [list(other) for other in others]
        return [index for step in zip(*per_rank, strict=True) for part in step for index in part]

    first, second = global_order(epoch), global_order(epoch + 1)
    # Two permutations of >= 2 items from different seeds: equal only by (rare) chance, and
    # never for a length where a collision would be probable.
    if length >= 8:
        assert first != second
    assert sorted(first) == sorted(second) == list(range(length))
    sampler.set_epoch(epoch)
    assert [index for part in sampler for index in part] == [
        index for part in all_ranks(length, world, batch, shuffle=True, seed=3, epoch=epoch)[0] for index in part
    ]


@FAST
@given(layouts, st.data())
def test_resume_from_any_step_gives_the_rest_of_the_epoch(layout, data):
    length, world, batch, shuffle, epoch, seed = layout
    rank = data.draw(st.integers(0, world - 1))
    sampler = DistributedBatchSampler(length, batch, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    full = list(sampler)
    done = data.draw(st.integers(0, len(full)))
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(done)]
    state = pickle.loads(pickle.dumps(sampler.state_dict()))
    assert (state["epoch"], state["step"], state["seed"]) == (epoch, done, seed)
    assert state["consumed"] == min(done * batch * world, length)

    resumed = DistributedBatchSampler(length, batch, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state and resumed.first_step == done
    resumed.set_epoch(epoch)  # what a training loop does before iterating: must keep the resume point
    assert head + list(resumed) == full
    # The resume is used once: the next iteration is a full epoch again.
    assert list(resumed) == full and resumed.first_step == 0

    # A fresh iter() after a partial one starts a full epoch (DataLoader never exhausts us).
    partial = iter(sampler)
    for _ in range(done):
        next(partial)
    assert list(sampler) == full


def reference_rest(order: list[int], consumed: int, world: int, batch: int) -> list[list[list[int]]]:
    """The rest of an epoch's order, from ``consumed`` on, cut into global batches of world × batch, dealt out."""
    steps = []
    for begin in range(consumed, len(order), world * batch):
        chunk = order[begin : begin + world * batch]
        counts = [len(chunk) // world + (rank < len(chunk) % world) for rank in range(world)]
        steps.append([chunk[sum(counts[:rank]) : sum(counts[: rank + 1])] for rank in range(world)])
    return steps


small_layouts = st.tuples(st.integers(1, 6), st.integers(1, 9))  # (num_replicas, batch_size)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 300), small_layouts, small_layouts, small_layouts, st.booleans(), st.integers(0, 3), st.data())
def test_resume_on_other_layouts_continues_the_order_every_sample_once(length, first, second, third, shuffle,
                                                                          epoch, data):
    """Save on one layout, resume on another, save again mid-epoch, resume on a third: the epoch's order, once."""
    order = reference_order(length, 9, epoch) if shuffle else list(range(length))
    seen: list[int] = []
    state = None
    for world, batch in (first, second, third):
        samplers = all_ranks(length, world, batch, shuffle=shuffle, seed=9)
        for sampler in samplers:
            if state is not None:
                sampler.load_state_dict(state)
            sampler.set_epoch(epoch)
        start = samplers[0].first_step
        consumed = 0 if state is None else state["consumed"]
        expected = reference_rest(order, consumed, world, batch)
        assert all(len(sampler) == start + len(expected) for sampler in samplers)  # equal step counts
        steps = data.draw(st.integers(0, len(expected))) if (world, batch) != third else len(expected)
        iterators = [iter(sampler) for sampler in samplers]
        for offset in range(steps):
            per_rank = [next(iterator) for iterator in iterators]
            assert per_rank == expected[offset]
            assert all(sampler.sizes(start + offset) == tuple(map(len, per_rank)) for sampler in samplers)
            seen += [index for part in per_rank for index in part]
        states = [pickle.loads(pickle.dumps(sampler.state_dict())) for sampler in samplers]
        assert all(other == states[0] for other in states)  # no rank in it: any rank's state loads anywhere
        state = states[0]
        assert (state["step"], state["consumed"]) == (start + steps, len(seen))
    assert seen == order  # every sample once, in the epoch's order, whatever the layouts


@FAST
@given(st.integers(1, 400), small_layouts, small_layouts, st.integers(0, 4), st.data())
def test_the_same_global_batch_size_on_another_layout_gives_the_same_global_batches(length, first, other, epoch,
                                                                                     data):
    world, batch = first
    global_batch = world * batch
    # Another layout of the same global batch size: another number of ranks whose batch divides it.
    world_b = other[0]
    if global_batch % world_b:
        world_b = 1
    batch_b = global_batch // world_b
    uninterrupted = [[index for part in step for index in part]
                     for step in zip(*(list(s) for s in all_ranks(length, world, batch, shuffle=True, seed=4,
                                                                   epoch=epoch)), strict=True)]
    done = data.draw(st.integers(0, len(uninterrupted)))
    samplers = all_ranks(length, world, batch, shuffle=True, seed=4, epoch=epoch)
    iterators = [iter(sampler) for sampler in samplers]
    for _ in range(done):
        [next(iterator) for iterator in iterators]
    resumed = all_ranks(length, world_b, batch_b, shuffle=True, seed=4)
    for sampler in resumed:
        sampler.load_state_dict(samplers[0].state_dict())
    assert all(len(sampler) == len(uninterrupted) for sampler in resumed)
    rest = [[index for part in step for index in part] for step in zip(*map(list, resumed), strict=True)]
    assert rest == uninterrupted[done:]
    assert all(sampler.sizes(0) == resumed[0].sizes(0) for sampler in resumed)  # the grid of a fresh epoch


def test_a_state_saved_before_the_layout_free_format_still_loads():
    # Version 1 saved the step and the layout instead of the samples consumed.
    old = {"epoch": 2, "step": 3, "seed": 5, "length": 50, "batch_size": 4, "num_replicas": 2, "shuffle": True}
    reference = all_ranks(50, 2, 4, shuffle=True, seed=5, epoch=2)
    order = [index for step in zip(*map(list, reference), strict=True) for part in step for index in part]
    resumed = all_ranks(50, 3, 2, shuffle=True, seed=5)  # another layout: global batch 6
    for sampler in resumed:
        sampler.load_state_dict(old)
    assert resumed[0].state_dict()["consumed"] == 24 and len(resumed[0]) == 3 + 5
    assert [index for step in zip(*map(list, resumed), strict=True) for part in step for index in part] == order[24:]
    with pytest.raises(ValueError, match=r"'step' must be an int in \[0, 7\], got 8"):
        resumed[0].load_state_dict({**old, "step": 8})


def test_the_step_a_loop_finished_gives_the_state_to_resume_from():
    sampler = DistributedBatchSampler(30, 4, num_replicas=2, rank=0, seed=1)
    iterator = iter(sampler)
    for _ in range(3):  # what a loader with workers asks for ahead of the loop
        next(iterator)
    assert sampler.state_dict()["step"] == 3 and sampler.state_dict(step=1)["consumed"] == 8
    assert sampler.state_dict(step=len(sampler))["consumed"] == 30
    with pytest.raises(ValueError, match=r"step must be an int in \[0, 4\], got 5"):
        sampler.state_dict(step=5)
    elsewhere = DistributedBatchSampler(30, 5, num_replicas=3, rank=2, seed=1)
    elsewhere.load_state_dict(sampler.state_dict(step=1))  # 8 consumed: off the new grid of 15
    assert (elsewhere.first_step, len(elsewhere), elsewhere.sizes(1), elsewhere.sizes(2)) == (1, 3, (5, 5, 5),
                                                                                                (3, 2, 2))
    with pytest.raises(ValueError, match=r"step must be an int in \[1, 3\) \(this epoch resumed at step 1\)"):
        elsewhere.sizes(0)


STATE = DistributedBatchSampler(40, 4, num_replicas=2, rank=0, seed=3).state_dict(step=2)


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({**STATE, "length": 41}, "saved for a dataset of 41 samples, this sampler has 40"),
        ({**STATE, "seed": 4}, "saved with seed=4, this sampler has seed=3.*pass seed=4"),
        ({**STATE, "shuffle": False}, "saved with shuffle=False, this sampler has shuffle=True"),
        ({**STATE, "consumed": 41}, r"'consumed' must be an int in \[0, 40\], got 41"),
        ({**STATE, "consumed": -1}, r"'consumed' must be an int in \[0, 40\], got -1"),
        ({**STATE, "step": 0}, r"'step' must be an int in \[1, 16\], got 0"),  # samples consumed in no step
        ({**STATE, "step": 17}, r"'step' must be an int in \[1, 16\], got 17"),  # a step took no sample
        ({**STATE, "epoch": "1"}, r"'epoch' must be an int in \[0, 9223372036854775807\], got '1'"),
        ({**STATE, "consumed": 2.0}, r"'consumed' must be an int"),
        ({**STATE, "version": 3}, "format 'contrastive_dist.DistributedBatchSampler' version 2, got .* version 3"),
        ({**STATE, "format": "something else"}, "got 'something else' version 2"),
        ({key: value for key, value in STATE.items() if key != "consumed"}, r"lacks \['consumed'\]"),
        ({"epoch": 0}, "lacks .*made by DistributedBatchSampler.state_dict"),
        ([1, 2], r"expected a dict made by DistributedBatchSampler.state_dict\(\), got list"),
    ],
)
def test_a_state_that_cannot_be_honoured_is_refused_saying_what_differs(state, message):
    sampler = DistributedBatchSampler(40, 5, num_replicas=3, rank=1, seed=3)  # another layout is fine
    with pytest.raises(ValueError, match="cannot resume: .*" + message):
        sampler.load_state_dict(state)
    assert sampler.first_step == 0 and list(sampler)  # a refused state leaves the sampler as it was


def test_dataset_smaller_than_world():
    samplers = all_ranks(3, 8, 4, shuffle=True, seed=1)
    batches = [list(sampler) for sampler in samplers]
    assert [len(per_rank) for per_rank in batches] == [1] * 8
    assert [len(per_rank[0]) for per_rank in batches] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert samplers[5].sizes(0) == (1, 1, 1, 0, 0, 0, 0, 0)


def test_dataloader_runs_two_full_epochs_and_stops_at_len():
    dataset = list(range(21))
    sampler = DistributedBatchSampler(dataset, 4, num_replicas=2, rank=1, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([batch.tolist() for batch in loader])
        assert len(epochs[-1]) == len(loader) == 3
    assert epochs[0] != epochs[1]
    assert [len(batch) for batch in epochs[0]] == [4, 4, 2]


def test_dataloader_with_workers_and_empty_rank():
    dataset = [(torch.full((2,), float(i)), i) for i in range(5)]
    sampler = DistributedBatchSampler(dataset, 1, num_replicas=3, rank=2, shuffle=False)  # sizes (1,1,1), (1,1,0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset), num_workers=1)
    (_, first_ids), (features, ids) = list(loader)
    assert first_ids.tolist() == [2]
    assert features.shape == (0, 2) and features.dtype == torch.float32
    assert ids.shape == (0,) and ids.dtype == torch.int64


@pytest.mark.parametrize(
    ("arguments", "options", "error", "message"),
    [
        ((0, 4), {}, ValueError, "at least one sample"),
        (([], 4), {}, ValueError, "at least one sample"),
        ((10, 0), {}, ValueError, "batch_size must be >= 1"),
        ((10, 2.0), {}, TypeError, "batch_size must be an int"),
        ((10, True), {}, TypeError, "batch_size must be an int"),
        ((10, 2), {"num_replicas": 0, "rank": 0}, ValueError, "num_replicas must be >= 1"),
        ((10, 2), {"num_replicas": 2, "rank": 2}, ValueError, r"rank must be in \[0, num_replicas=2\)"),
        ((10, 2), {"num_replicas": 2, "rank": -1}, ValueError, "rank must be >= 0"),
        ((10, 2), {"shuffle": 1}, TypeError, "shuffle must be a bool"),
        ((10, 2), {"seed": "0"}, TypeError, "seed must be an int"),
        ((10, 2), {"seed": 2**70}, ValueError, r"seed must be <= 9223372036854775807 \(a signed 64-bit int\)"),
        ((10, 2), {"seed": -(2**63) - 1}, ValueError, "seed must be >= -9223372036854775808"),
        ((2**62 + 1, 2), {}, ValueError, r"length must be at most 2\*\*62"),
        ((object(), 2), {}, TypeError, "dataset with len"),
    ],
)
def test_invalid_arguments(arguments, options, error, message):
    with pytest.raises(error, match=message):
        DistributedBatchSampler(*arguments, **options)


def test_defaults_without_process_group_and_bad_calls():
    sampler = DistributedBatchSampler(range(7), 3)
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (1, 0, 3)
    assert sampler.sampler is sampler
    with pytest.raises(ValueError, match=r"step must be an int in \[0, 3\)"):
        sampler.sizes(3)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        sampler.set_epoch(-1)
    state = sampler.state_dict()
    other = DistributedBatchSampler(7, 2)
    other.load_state_dict(state)  # another batch size loads: the state holds samples consumed, not a layout
    assert len(other) == 4


def test_seed_range_is_checked_at_construction_and_its_ends_iterate():
    for seed in (2**63 - 1, -(2**63)):  # the whole signed 64-bit range works, epochs up to 2**63 - 1 too
        sampler = DistributedBatchSampler(10, 3, num_replicas=2, rank=1, seed=seed)
        sampler.set_epoch(2**63 - 1)
        assert [len(batch) for batch in sampler] == [3, 2]
    with pytest.raises(ValueError, match="epoch must be <= 9223372036854775807"):
        sampler.set_epoch(2**63)
    with pytest.raises(ValueError, match=r"'seed' must be an int in \[-9223372036854775808, 9223372036854775807\]"):
        sampler.load_state_dict({**sampler.state_dict(), "seed": 2**70})


def test_set_epoch_to_another_epoch_drops_a_loaded_state():
    sampler = DistributedBatchSampler(50, 4, num_replicas=2, rank=0, seed=5)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "step": 3, "consumed": 24})
    sampler.set_epoch(4)
    reference = DistributedBatchSampler(50, 4, num_replicas=2, rank=0, seed=5)
    reference.set_epoch(4)
    assert list(sampler) == list(reference)
    # Lightning's order when it resumes: iter() first, set_epoch() before the first batch.
    sampler.set_epoch(0)
    iterator = iter(sampler)
    sampler.set_epoch(4)
    assert list(iterator) == list(reference)


Pair = namedtuple("Pair", ["image", "label"])


def test_empty_safe_collate_structures():
    sample = {
        "image": torch.ones(3, 4, 4, dtype=torch.float16),
        "label": 3,
        "score": 0.5,
        "caption": "a cat",
        "parts": (torch.zeros(2, dtype=torch.bool), [torch.arange(3), 1]),
        "pair": Pair(torch.ones(2), 1),
    }
    dataset = [sample, sample]
    collate = EmptySafeCollate(dataset)
    empty = collate([])
    full = collate(dataset)
    assert set(empty) == set(full)

    def check(empty_part, full_part):
        if isinstance(full_part, torch.Tensor):
            assert empty_part.shape == (0, *full_part.shape[1:])
            assert empty_part.dtype == full_part.dtype
        elif isinstance(full_part, dict):
            for key in full_part:
                check(empty_part[key], full_part[key])
        elif full_part and isinstance(full_part[0], str):
            assert empty_part == []
        else:
            assert type(empty_part) is type(full_part) and len(empty_part) == len(full_part)
            for a, b in zip(empty_part, full_part, strict=True):
                check(a, b)

    check(empty, full)
    assert empty["label"].dtype == torch.int64 and empty["score"].dtype == torch.float64
    # Fresh tensors each call, and picklable for DataLoader workers.
    assert collate([])["image"] is not empty["image"]
    assert pickle.loads(pickle.dumps(collate))([])["image"].shape == (0, 3, 4, 4)


def test_empty_safe_collate_custom_collate_and_errors():
    def stack_first(samples):
        return torch.stack([sample[0] for sample in samples])

    dataset = [(torch.ones(5), "x")] * 3
    assert EmptySafeCollate(dataset, stack_first)([]).shape == (0, 5)
    assert EmptySafeCollate(dataset, stack_first)(dataset).shape == (3, 5)
    with pytest.raises(ValueError, match="at least one sample"):
        EmptySafeCollate([])
    with pytest.raises(TypeError, match="collate_fn must be callable"):
        EmptySafeCollate(dataset, "stack")
    with pytest.raises(ValueError, match="0-d tensor"):
        EmptySafeCollate(dataset, lambda samples: torch.tensor(1.0))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_resumes_what_it_yielded_whatever_its_workers_prefetched(num_workers):
    # A DataLoader with workers calls iter() on the sampler twice before its first batch, and asks for
    # batches ahead of the loop: the loaded state must survive the first, the saved one ignore the second.
    from contrastive_dist.data._resumable_loader import ResumableLoader

    data = list(range(37))
    uninterrupted = [batch.tolist() for batch in DataLoader(data, batch_sampler=DistributedBatchSampler(37, 4, seed=2))]
    loader = ResumableLoader(data, batch_sampler=DistributedBatchSampler(37, 4, seed=2), num_workers=num_workers,
                             persistent_workers=num_workers > 0)
    batches = iter(loader)
    head = [next(batches).tolist() for _ in range(3)]
    state = loader.state_dict()
    assert (state["step"], state["consumed"]) == (3, 12)
    resumed = ResumableLoader(data, batch_sampler=DistributedBatchSampler(37, 6, seed=2), num_workers=num_workers)
    resumed.load_state_dict(state)
    rest = [batch.tolist() for batch in resumed]
    assert [len(batch) for batch in rest] == [6, 6, 6, 6, 1]
    assert sum(head + rest, []) == sum(uninterrupted, [])  # the epoch's order, each sample once
    assert resumed.state_dict()["consumed"] == 37
    with pytest.raises(TypeError, match="batch_sampler must be a DistributedBatchSampler"):
        ResumableLoader(data, batch_size=4)
    fixed = ResumableLoader(data, batch_sampler=DistributedBatchSampler(37, 6, seed=2), fixed_epoch_length=True)
    with pytest.raises(ValueError, match="12 of its 37 samples were consumed in 3 step.*after 8 steps.*at the 7 steps"):
        fixed.load_state_dict(state)


class VersionOneSampler(DistributedBatchSampler):
    """The sampler as it saved itself before the layout-free state: the step it handed out, and its layout."""

    def state_dict(self, step=None):
        state = super().state_dict(step)
        return {key: state[key] for key in ("epoch", "step", "seed", "length", "batch_size", "num_replicas", "shuffle")}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_checkpoint_of_the_stateful_dataloader_it_replaces_still_loads(num_workers):
    # distributed_loader returned torchdata's StatefulDataLoader around a version-1 sampler; such checkpoints load.
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    from contrastive_dist.data._resumable_loader import ResumableLoader

    data = list(range(37))
    order = [index for batch in DistributedBatchSampler(37, 4, seed=2) for index in batch]
    old = stateful_dataloader.StatefulDataLoader(data, batch_sampler=VersionOneSampler(37, 4, seed=2),
                                                 num_workers=num_workers)
    batches = iter(old)
    head = [index for _ in range(3) for index in next(batches).tolist()]  # workers have asked for more than 3
    resumed = ResumableLoader(data, batch_sampler=DistributedBatchSampler(37, 6, seed=2))
    resumed.load_state_dict(old.state_dict())
    assert head + [index for batch in resumed for index in batch.tolist()] == order
    with pytest.raises(ValueError, match="looks like torchdata's StatefulDataLoader's, but .*KeyError"):
        resumed.load_state_dict({"_num_yielded": 3, "_index_sampler_state": {}})
