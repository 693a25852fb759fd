"""Streams resumed mid-epoch on real webdataset tar shards and real gloo processes with DataLoader workers.

Three shards of 1, 13 and 7 samples. A run of 2 ranks × 2 workers (4 slots for 3 shards: one reads
nothing) stops after 2 steps; rank 0's state is resumed on 2 × 2, on 3 × 1 and on 1 × 0 (no worker),
each to the end of the epoch; from the 3 × 1 run, stopped after 2 more steps, a second resume on
1 × 0 finishes the epoch. Each time: every sample exactly once over the epoch, every rank the same
number of steps, the ranks' states equal, and the decoding stage (which counts its calls) never sees
a sample consumed before the resume. DataLoader workers cannot start in the test suite's daemonic
WorkerPool processes, so each layout is launched here (``torch.multiprocessing``), bounded in time.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from hypothesis import given, settings
from hypothesis import strategies as st
from spawned import launch_ranks
from torch.utils.data import DataLoader

from contrastive_dist import DistributedShardList, DistributedStreamingBatches, EmptySafeCollate

wds = pytest.importorskip("webdataset")

COUNTS, BATCH_SIZE, SEED = [1, 13, 7], 2, 5
EXAMPLE = (torch.zeros(2), 0)


class CountingDecode:
    """The decoding stage: a sample's id from its bytes, and one line per call in a file of this process."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, sample: dict) -> tuple[torch.Tensor, int]:
        sample_id = int(sample["cls"].decode())
        with open(Path(self.directory, f"decoded-{os.getpid()}.txt"), "a") as file:
            file.write(f"{sample_id}\n")
        return torch.tensor([float(sample_id), -float(sample_id)]), sample_id


def write_shards(directory: Path) -> list[str]:
    paths, next_id = [], 0
    for index, count in enumerate(COUNTS):
        path = directory / f"part-{index:03d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for _ in range(count):
                writer.write({"__key__": f"sample{next_id:06d}", "cls": str(next_id).encode()})
                next_id += 1
        paths.append(str(path))
    return paths


def stream(shards, num_workers, decoded_dir, *, seed=SEED, lookahead=1, caller_prefetch=0):
    shard_list = DistributedShardList(shards, seed=seed)
    dataset = shard_list.pipeline(wds.tarfile_to_samples(), wds.map(CountingDecode(decoded_dir)))
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=num_workers, collate_fn=EmptySafeCollate([EXAMPLE]),
                        multiprocessing_context="forkserver" if num_workers else None)
    return DistributedStreamingBatches(loader, lookahead=lookahead, caller_prefetch=caller_prefetch)


def run_segment(shards, *, num_workers, state, stop_after, lookahead, decoded_dir):
    """From ``state`` (None: a fresh epoch) to the epoch's end or ``stop_after`` steps: what this rank saw."""
    batches = stream(shards, num_workers, decoded_dir, lookahead=lookahead)
    if state is not None:
        batches.load_state_dict(state)
    steps = []
    start = 0 if state is None else state["step"]
    for step, (features, ids) in enumerate(batches, start=start):
        assert torch.equal(features[:, 0], ids.to(torch.float32))
        steps.append([step, ids.tolist(), list(batches.sizes(step))])
        if len(steps) == stop_after:
            break
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, batches.state_dict())
    return {"steps": steps, "states": states}


def refused(shards, state, decoded_dir):
    """Wrong resumes, each expected to raise before the first step: their messages, on this rank."""
    messages = []
    for shard_list, bad in ((shards[:2], state), (shards, {**state, "shards": {**state["shards"], "seed": 9}}),
                            (shards, {**state, "shards": {**state["shards"], "progress": [0, "x", 0]}}),
                            (shards, {**state, "step": 0})):
        batches = stream(shard_list, 0, decoded_dir)
        try:
            batches.load_state_dict(bad)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def rank_main(rank, world_size, store_path, out_dir, segments):
    torch.set_num_threads(1)
    torch_mp.set_forkserver_preload(["torch", "webdataset", "contrastive_dist", __name__])
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, options in segments:
        if name == "refused":
            results[name] = refused(**options)
            continue
        state = options.pop("state")
        state = results[state]["states"][0] if isinstance(state, str) else state  # rank 0's, on every rank
        results[name] = run_segment(**options, state=state)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(tmp_path: Path, world_size: int, segments: list, timeout: float) -> list[dict]:
    out = tmp_path / f"launch{world_size}-{time.monotonic_ns()}"
    out.mkdir()
    return launch_ranks(rank_main, (world_size, str(out / "store"), str(out), segments), world_size, out, timeout)


def consumed(ranks: list[dict], name: str) -> list[int]:
    """Ids of every rank's batches of segment ``name``, after checking equal steps, sizes and states."""
    segments = [rank[name] for rank in ranks]
    numbers = [[step for step, _, _ in segment["steps"]] for segment in segments]
    assert all(rank_numbers == numbers[0] for rank_numbers in numbers), numbers  # equal step counts
    for index, (step, _, sizes) in enumerate(segments[0]["steps"]):
        assert [len(segment["steps"][index][1]) for segment in segments] == sizes, (name, step)
    states = segments[0]["states"]
    assert all(state == states[0] for state in states), name  # any rank's state describes the whole dataset
    return [sample for segment in segments for _, ids, _ in segment["steps"] for sample in ids]


def decoded(directory: Path) -> list[int]:
    return sorted(int(line) for path in directory.glob("decoded-*.txt") for line in path.read_text().split())


@pytest.mark.timeout(600)
def test_a_stream_saved_mid_epoch_resumes_on_other_layouts_every_sample_once_without_decoding_it_again(tmp_path):
    shards = write_shards(tmp_path)
    every = list(range(sum(COUNTS)))
    dirs = {name: tmp_path / name for name in ("first", "same", "three", "three_stop", "alone", "second", "refused")}
    for directory in dirs.values():
        directory.mkdir()

    def segment(name, **options):
        return name, {"shards": shards, "decoded_dir": str(dirs[name]), "lookahead": 1, "stop_after": None, **options}

    two = launch(tmp_path, 2, [segment("first", num_workers=2, state=None, stop_after=2),
                               segment("same", num_workers=2, state="first")], timeout=180)
    saved = two[0]["first"]["states"][0]
    first = consumed(two, "first")
    progress = saved["shards"]["progress"]
    assert saved["step"] == 2 and 0 < len(first) < len(every) and any(value > 0 for value in progress), saved
    three = launch(tmp_path, 3, [segment("three", num_workers=1, state=saved, lookahead=2),
                                 segment("three_stop", num_workers=1, state=saved, stop_after=2),
                                 ("refused", {"shards": shards, "state": saved, "decoded_dir": str(dirs["refused"])})],
                   timeout=180)
    again = three[0]["three_stop"]["states"][0]
    alone = launch(tmp_path, 1, [segment("alone", num_workers=0, state=saved),
                                 segment("second", num_workers=0, state=again)], timeout=180)

    assert sorted(first + consumed(two, "same")) == every
    assert sorted(first + consumed(three, "three")) == every
    assert sorted(first + consumed(alone, "alone")) == every
    assert sorted(first + consumed(three, "three_stop") + consumed(alone, "second")) == every  # resumed twice
    for name, ranks in (("same", two), ("three", three), ("alone", alone), ("second", alone)):
        # The decoding stage saw exactly what the resumed run consumed: nothing consumed before was decoded.
        assert decoded(dirs[name]) == sorted(consumed(ranks, name)), name
        end = ranks[0][name]["states"][0]
        assert end["finished"] and set(end["shards"]["progress"]) == {-1}
    assert three[0]["three"]["steps"][0][0] == 2  # the steps keep their numbers: sizes(step) as Lightning asks
    assert any(not ids for rank in three for _, ids, _ in rank["three"]["steps"])  # a rank ran out: padded

    expected = ["saved for another list of shards (3 shards", "saved with seed=9, this shard list has seed=5",
                "'progress' must hold one int >= -1 per shard", "says 0 steps were consumed, its shard progress"]
    for rank in three:
        assert all(cause in message for cause, message in zip(expected, rank["refused"], strict=True)), rank["refused"]


def test_one_process_caller_prefetch_and_epoch_boundaries(tmp_path):
    shards = write_shards(tmp_path)
    # A caller that fetches one batch ahead of its step, as Lightning does: the state leaves it out.
    batches = stream(shards, 0, str(tmp_path), caller_prefetch=1)
    iterator = iter(batches)
    held = [next(iterator)[1].tolist() for _ in range(4)]  # steps 0-2 done, step 3 fetched ahead
    state = batches.state_dict()
    assert state["step"] == 3 and not state["finished"]
    resumed = stream(shards, 0, str(tmp_path))
    resumed.load_state_dict(state)
    rest = [ids.tolist() for _, ids in resumed]
    assert rest[0] == held[3] and sorted(sum(held[:3] + rest, [])) == list(range(sum(COUNTS)))
    assert resumed.state_dict()["finished"]
    # The end of an epoch resumes as an empty epoch; the next epoch is a full one.
    again = stream(shards, 0, str(tmp_path))
    again.load_state_dict(resumed.state_dict())
    assert list(again) == []
    again.set_epoch(1)
    assert sorted(sample for _, ids in again for sample in ids.tolist()) == list(range(sum(COUNTS)))
    # A loader whose batches carry no position resumes only at an epoch's start or end.
    plain = DistributedStreamingBatches([torch.arange(3)], empty_batch=lambda: torch.zeros(0, dtype=torch.int64))
    next(iter(plain))
    with pytest.raises(ValueError, match="cannot resume mid-epoch: .*do not say where in the stream"):
        DistributedStreamingBatches([], empty_batch=list).load_state_dict({**plain.state_dict(), "finished": False})
    with pytest.raises(ValueError, match="expected a dict made by DistributedStreamingBatches.state_dict"):
        again.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="caller_prefetch must be an int >= 0"):
        DistributedStreamingBatches([], empty_batch=list, caller_prefetch=-1)
    with pytest.raises(ValueError, match="shards must be distinct"):
        DistributedShardList([shards[0], shards[0]])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=9), st.lists(st.integers(1, 7), min_size=3, max_size=3),
       st.booleans(), st.data())
def test_the_rest_of_an_epoch_dealt_to_any_slots_reads_every_sample_once(sizes, slot_counts, shuffle, data):
    """Shards of ``sizes`` samples; slots read a prefix of their plan, twice saved and dealt to other slot counts."""
    shard_list = DistributedShardList([f"s{index}.tar" for index in range(len(sizes))], shuffle=shuffle, seed=2,
                                      num_replicas=1, rank=0)
    shard_list.set_epoch(data.draw(st.integers(0, 3)))
    read: list[tuple[int, int]] = []  # (shard, sample index within it)
    for layout, slots in enumerate(slot_counts):
        shards = shard_list.begin_epoch(slots, resume=layout > 0)
        last = layout == len(slot_counts) - 1
        for slot in range(slots):
            samples = [(shard, index) for shard, skip in shards.plan(slot) for index in range(skip, sizes[shard])]
            taken = len(samples) if last else data.draw(st.integers(0, len(samples)))
            read += samples[:taken]
            if taken:  # what the slot's last consumed batch reports: its shard, and the samples of it read
                shard, index = samples[taken - 1]
                shards.record(slot, shard, index + 1)
        state = shard_list.state_dict()
        shard_list = DistributedShardList(shard_list.shards, shuffle=shuffle, seed=2, num_replicas=1, rank=0)
        shard_list.load_state_dict(state)
    assert sorted(read) == [(shard, index) for shard, size in enumerate(sizes) for index in range(size)]
