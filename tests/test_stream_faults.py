"""Corrupt webdataset shards on real gloo processes: every rank raises the same error, or skips the unreadable.

One launch of 3 ranks runs every scenario, bounded in time (DataLoader workers cannot start inside
the suite's daemonic WorkerPool processes); the tests below check parts of what the ranks wrote.

* ``on_error="raise"``: for each fault (a tar cut inside a member, one cut inside a header, random
  bytes, an empty file, a missing file), without and with 2 DataLoader workers, rank 1's second
  shard is the bad one. Every rank raises the same ``RuntimeError`` naming rank 1, the shard, the
  worker and the original error (chained on rank 1 only), within seconds of the fault (measured
  from the moment the first stage raised, noted by a test-side stage), and the group still works.
* ``on_error="skip"``: every fault at once plus a sample its decoding stage refuses, 2 workers per
  rank: every sample whose file is intact is used exactly once (a cut member's sample too, read
  again from the intact members), every rank counts
  the same 6 skips; then a run stopped after 3 steps and resumed with 1 worker, the same.
* ``on_error`` that differs between ranks: the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import tarfile
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from hypothesis import given, settings
from hypothesis import strategies as st
from spawned import launch_ranks
from tar_reference import intact, members_of
from torch.utils.data import DataLoader

from contrastive_dist import DistributedShardList, DistributedStreamingBatches, EmptySafeCollate

wds = pytest.importorskip("webdataset")

WORLD, BATCH_SIZE, PER_SHARD = 3, 2, 4
FAULTS = ("cut inside a member", "cut inside a header", "random bytes", "empty file", "missing file")
EXAMPLE = (torch.zeros(2), 0)
REFUSED_ID = 13  # the decoding stage raises on this sample: a sample-level fault


def write_shard(path: Path, first_id: int, count: int = PER_SHARD) -> str:
    with wds.TarWriter(str(path)) as writer:
        for sample_id in range(first_id, first_id + count):
            writer.write({"__key__": f"s{sample_id:06d}", "cls": sample_id, "txt": f"caption {sample_id} " * 40})
    return str(path)


def break_shard(path: str, fault: str) -> None:
    """Damage a written shard in place: every fault but the cut ones makes it unreadable from its first byte."""
    with tarfile.open(path) as archive:
        members = archive.getmembers()
    data = Path(path).read_bytes()
    third_text = [member for member in members if member.name.endswith(".txt")][2]
    cuts = {"cut inside a member": third_text.offset_data + third_text.size // 2,
            "cut inside a header": members[6].offset + 100}  # the header of sample 3's first file
    if fault in cuts:
        Path(path).write_bytes(data[: cuts[fault]])
    elif fault == "random bytes":
        Path(path).write_bytes(random.Random(0).randbytes(len(data)))
    elif fault == "empty file":
        Path(path).write_bytes(b"")
    else:
        os.remove(path)


def readable_ids(path: str, original: bytes) -> list[int]:
    """The samples whose ``cls`` file (all the decoding reads) is intact: the reference for "every readable sample"."""
    damaged = Path(path).read_bytes() if os.path.exists(path) else b""
    return [int(member.key[1:]) for member in members_of(original)
            if member.name.endswith(".cls") and intact(original, damaged, member)]


class TimedFirstStage:
    """webdataset's first stage; notes in a file when it raised (the moment a rank's loader failed)."""

    def __init__(self, directory: str) -> None:
        self.directory, self.stage = directory, wds.tarfile_to_samples()

    def __call__(self, sources):
        try:
            yield from self.stage(sources)
        except Exception:
            Path(self.directory, f"failed-{os.getpid()}-{time.monotonic_ns()}").write_text(repr(time.time()))
            raise


def to_pair(sample: dict) -> tuple[torch.Tensor, int]:
    sample_id = sample["cls"]
    if sample_id == REFUSED_ID:
        raise ValueError(f"cannot decode sample {sample_id}")
    return torch.tensor([float(sample_id), -float(sample_id)]), sample_id


def stream(shards, *, num_workers, on_error, shuffle, directory, state=None):
    shard_list = DistributedShardList(shards, shuffle=shuffle, seed=3)
    dataset = shard_list.pipeline(TimedFirstStage(directory), wds.decode(), wds.map(to_pair), on_error=on_error)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, num_workers=num_workers, collate_fn=EmptySafeCollate([EXAMPLE]),
                        multiprocessing_context="forkserver" if num_workers else None)
    batches = DistributedStreamingBatches(loader)
    if state is not None:
        batches.load_state_dict(state)
    return batches


def raise_scenario(shards, num_workers, directory):
    """Iterate until the error: its text, when this rank raised, and what it was chained to."""
    dist.barrier()  # every rank starts together: the time to raise is the error's, not a rank's late start
    steps = 0
    try:
        for _ in stream(shards, num_workers=num_workers, on_error="raise", shuffle=False, directory=directory):
            steps += 1
        outcome = {"message": "no error"}
    except RuntimeError as error:
        cause = error.__cause__
        outcome = {"message": str(error), "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}
    outcome.update(raised_at=time.time(), steps=steps)
    dist.barrier()  # the group still works: no rank was left inside a collective
    return outcome


def skip_segment(shards, num_workers, directory, state=None, stop_after=None):
    """Iterate with on_error="skip" to the end or ``stop_after`` steps: ids, skips, and the state, on this rank."""
    batches = stream(shards, num_workers=num_workers, on_error="skip", shuffle=True, directory=directory, state=state)
    ids, steps = [], 0
    with warnings.catch_warnings(record=True) as caught:  # the main process's warnings (0 workers)
        warnings.simplefilter("always", RuntimeWarning)
        for _, batch_ids in batches:
            ids += batch_ids.tolist()
            steps += 1
            if steps == stop_after:
                break
    warned = [str(warning.message) for warning in caught if "on_error='skip'" in str(warning.message)]
    return {"ids": ids, "steps": steps, "skipped": batches.skipped(), "state": batches.state_dict(), "warned": warned}


def mixed_on_error(rank, directory):
    shards = [str(Path(directory, "unused.tar"))]
    try:
        next(iter(stream(shards, num_workers=0, on_error="skip" if rank == 2 else "raise", shuffle=False,
                         directory=directory)))
    except ValueError as error:
        return str(error)
    return "no error"


def rank_main(rank, store_path, out_dir, raise_cases, skip_shards):
    torch.set_num_threads(1)
    torch_mp.set_forkserver_preload(["torch", "webdataset", "contrastive_dist", __name__])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    alone = skip_segment(skip_shards, 0, out_dir)
    whole = skip_segment(skip_shards, 2, out_dir)  # first with workers: the forkservers start before any timing
    first = skip_segment(skip_shards, 2, out_dir, stop_after=3)
    states = [None] * WORLD
    dist.all_gather_object(states, first["state"])
    rest = skip_segment(skip_shards, 1, out_dir, state=states[0])  # rank 0's state, on every rank
    results = {"skip": {"alone": alone, "whole": whole, "first": first, "rest": rest, "states_equal": states}}
    results["raise"] = [raise_scenario(*case) for case in raise_cases]
    results["mixed"] = mixed_on_error(rank, out_dir)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def launch(directory: Path, raise_cases: list, skip_shards: list[str], timeout: float) -> list[dict]:
    args = (str(directory / "store"), str(directory), raise_cases, skip_shards)
    return launch_ranks(rank_main, args, WORLD, directory, timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Write the shards, launch the ranks once; what every rank wrote, and the cases it ran."""
    root = tmp_path_factory.mktemp("faults")
    raise_cases, expected = [], []
    for num_workers in (0, 2):
        for fault in FAULTS:
            directory = root / f"raise-{num_workers}-{FAULTS.index(fault)}"
            directory.mkdir()
            slots = WORLD * max(1, num_workers)
            # Shard 1 + slots is rank 1's (worker 0's) second shard: it fails after a step or more of data.
            shards = [write_shard(directory / f"part-{index:02d}.tar", 100 * index) for index in range(2 * slots)]
            bad = shards[1 + slots]
            break_shard(bad, fault)
            raise_cases.append((shards, num_workers, str(directory)))
            expected.append((fault, num_workers, bad))
    skip_dir = root / "skip"
    skip_dir.mkdir()
    skip_shards = [write_shard(skip_dir / f"part-{index:02d}.tar", 100 * index) for index in range(12)]
    skip_shards[0] = write_shard(skip_dir / "part-00.tar", REFUSED_ID - 2)  # holds the refused sample
    originals = [Path(path).read_bytes() for path in skip_shards]
    for index, fault in zip((1, 4, 6, 9, 10), FAULTS):
        break_shard(skip_shards[index], fault)
    readable = sorted(sample for path, original in zip(skip_shards, originals)
                      for sample in readable_ids(path, original) if sample != REFUSED_ID)
    ranks = launch(root, raise_cases, skip_shards, timeout=400)
    return {"ranks": ranks, "expected": expected, "readable": readable, "root": root}


@pytest.mark.timeout(500)
def test_a_corrupt_shard_stops_every_rank_with_the_same_error_naming_the_rank_the_shard_and_the_cause(runs):
    originals = {"cut inside a member": "ReadError: ", "cut inside a header": "the tar is damaged at byte ",
                 "random bytes": "ReadError: ", "empty file": "ReadError: ", "missing file": "FileNotFoundError: "}
    seconds = {0: [], 2: []}
    for index, (fault, num_workers, bad) in enumerate(runs["expected"]):
        outcomes = [rank["raise"][index] for rank in runs["ranks"]]
        message = outcomes[0]["message"]
        assert all(outcome["message"] == message for outcome in outcomes), (fault, num_workers)  # the same error
        where = "in DataLoader worker 0 of rank 1" if num_workers else "on rank 1"
        assert message.startswith("the data loader of rank 1 raised at step "), message
        assert f"cannot read shard {bad!r}" in message and where in message, message
        assert originals[fault] in message, (fault, message)
        assert "on_error='skip'" in message
        assert outcomes[1]["cause"] is not None and originals[fault] in outcomes[1]["cause"]  # chained on rank 1
        assert outcomes[0]["cause"] is None and outcomes[2]["cause"] is None
        assert len({outcome["steps"] for outcome in outcomes}) == 1 and outcomes[0]["steps"] >= 1
        directory = Path(runs["root"], f"raise-{num_workers}-{FAULTS.index(fault)}")
        failed_at = [float(path.read_text()) for path in directory.glob("failed-*")]
        assert len(failed_at) == 1, (fault, num_workers)  # one first stage raised, once
        seconds[num_workers].append(max(outcome["raised_at"] for outcome in outcomes) - failed_at[0])
    rounded = {workers: [round(value, 2) for value in values] for workers, values in seconds.items()}
    print(f"\nseconds from the fault to every rank raised, per fault {list(FAULTS)}: no workers {rounded[0]}, "
          f"2 workers {rounded[2]}")
    assert max(seconds[0] + seconds[2]) <= 10, seconds  # no rank waits for a timeout: bounded by the 10 s


@pytest.mark.timeout(500)
def test_on_error_skip_uses_every_readable_sample_once_and_every_rank_counts_the_same_skips(runs):
    readable, ranks = runs["readable"], runs["ranks"]
    for name in ("alone", "whole"):
        segments = [rank["skip"][name] for rank in ranks]
        assert sorted(sample for segment in segments for sample in segment["ids"]) == readable, name
        assert [segment["skipped"] for segment in segments] == [6] * WORLD, name  # 5 shards and 1 sample
        assert len({segment["steps"] for segment in segments}) == 1
    warned = [message for rank in ranks for message in rank["skip"]["alone"]["warned"]]
    assert len(warned) == 6, warned  # one warning per skip, naming it
    assert sum("skipped the rest of shard" in message or "skipped the damaged part of shard" in message
               for message in warned) == 5
    assert any(f"key 's{REFUSED_ID:06d}'" in message and "ValueError: cannot decode" in message for message in warned)
    # Stopped after 3 steps, resumed with another number of workers: still exactly once, and 6 skips in all.
    first = [rank["skip"]["first"] for rank in ranks]
    rest = [rank["skip"]["rest"] for rank in ranks]
    assert all(segment["steps"] == 3 for segment in first)
    consumed = [sample for segment in first + rest for sample in segment["ids"]]
    assert sorted(consumed) == readable
    assert len({segment["skipped"] for segment in first}) == 1 and first[0]["state"]["skipped"] == first[0]["skipped"]
    assert all(state == ranks[0]["skip"]["states_equal"][0] for state in ranks[0]["skip"]["states_equal"])
    assert [segment["skipped"] for segment in rest] == [6] * WORLD
    assert all(segment["state"]["finished"] for segment in rest)


def test_ranks_that_disagree_on_on_error_all_raise_the_same_value_error(runs):
    messages = [rank["mixed"] for rank in runs["ranks"]]
    assert len(set(messages)) == 1, messages
    assert "same lookahead, epoch, number of workers, on_error" in messages[0]
    assert "rank 2: lookahead=1 epoch=0 workers=1 on_error='skip'" in messages[0]


def test_pipeline_options_are_checked(tmp_path):
    shard_list = DistributedShardList([write_shard(tmp_path / "part.tar", 0)])
    with pytest.raises(ValueError, match=r"on_error must be one of \['raise', 'skip'\], got 'ignore'"):
        shard_list.pipeline(wds.tarfile_to_samples(), on_error="ignore")


class MemoryShards:
    """A first stage over in-memory shards: ``{name: (ids, fails_after)}``; a shard raises after ``fails_after``."""

    def __init__(self, shards: dict[str, tuple[list[int], int | None]]) -> None:
        self.shards = shards

    def __call__(self, sources):
        for source in sources:
            ids, fails_after = self.shards[source["url"]]
            for position, sample_id in enumerate(ids):
                if position == fails_after:
                    raise OSError(f"{source['url']} is damaged")
                yield {"__url__": source["url"], "__key__": str(sample_id), "id": sample_id}
            if fails_after == len(ids):
                raise OSError(f"{source['url']} ends too early")


def refuse(refused: set[int]):
    def decode(samples):
        for sample in samples:
            if sample["id"] in refused:
                raise ValueError(f"cannot decode {sample['id']}")
            yield torch.tensor([float(sample["id"])]), sample["id"]
    return decode


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_skips_are_counted_once_and_readable_samples_used_once_across_random_resumes(data):
    sizes = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    shards, readable, faults, first_id = {}, [], 0, 0
    for index, size in enumerate(sizes):
        ids = list(range(first_id, first_id + size))
        first_id += size
        fails_after = data.draw(st.one_of(st.none(), st.integers(0, size)))
        shards[f"s{index}.tar"] = (ids, fails_after)
        readable += ids if fails_after is None else ids[:fails_after]
        faults += fails_after is not None
    refused = set(data.draw(st.lists(st.sampled_from(readable), unique=True, max_size=3))) if readable else set()
    batch_size = data.draw(st.integers(1, 3))
    consumed, state = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        while True:  # stop after a random number of steps, save, resume: to the end of the epoch
            shard_list = DistributedShardList(list(shards), shuffle=True, seed=1)
            dataset = shard_list.pipeline(MemoryShards(shards), refuse(refused), on_error="skip")
            loader = DataLoader(dataset, batch_size=batch_size, collate_fn=EmptySafeCollate([(torch.zeros(1), 0)]))
            batches = DistributedStreamingBatches(loader)
            if state is not None:
                batches.load_state_dict(state)
            stop_after = data.draw(st.one_of(st.none(), st.integers(1, 4)))
            for step, (_, ids) in enumerate(batches, start=1):
                consumed += ids.tolist()
                if step == stop_after:
                    break
            state = batches.state_dict()
            if state["finished"]:
                break
    assert sorted(consumed) == sorted(set(readable) - refused)
    assert batches.skipped() == state["skipped"] == faults + len(refused)


def test_a_state_saved_before_skips_were_counted_loads_with_none(tmp_path):
    shard_list = DistributedShardList([write_shard(tmp_path / "part.tar", 0)])
    loader = DataLoader(shard_list.pipeline(wds.tarfile_to_samples(), wds.decode(), wds.map(to_pair)),
                        batch_size=BATCH_SIZE, collate_fn=EmptySafeCollate([EXAMPLE]))
    batches = DistributedStreamingBatches(loader)
    state = batches.state_dict()
    batches.load_state_dict({key: value for key, value in state.items() if key != "skipped"})
    assert [ids.tolist() for _, ids in batches] == [[0, 1], [2, 3]] and batches.skipped() == 0
    with pytest.raises(ValueError, match="'skipped' must be an int in"):
        batches.load_state_dict({**state, "skipped": -1})
