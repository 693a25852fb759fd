"""Damaged tar shards: found wherever the damage is, raised or counted, and the intact rest read exactly once.

* The reproduction of a damaged header in the middle of a shard (junk or zeros; the first header
  block of the fifth member, or all of its headers), a shard streamed through a pipe, and a resume
  on the far side of the damage.
* A seeded fuzzer, in-process: random shards, 1-3 random corruptions each (junk, zeros, cuts aimed
  at headers, contents, padding, the end or anywhere) × ``raise`` / ``skip`` × the slots of 1-3
  ranks with 0 or 2 DataLoader workers, a resume in the middle for some. The reference
  (``tar_reference``) says which samples are readable without reading the damaged file with
  ``tarfile``: in ``skip`` mode every readable sample comes out exactly once, and a shard that lost
  one is named in a warning and counted; in ``raise`` mode a slot raises naming a damaged shard and
  its rank, or reads every sample of its shards. ``SHARD_FUZZ_CASES`` sets the number of cases
  (default 160); ``-s`` prints the totals.
* A few of those cases through real gloo ranks with 0 and 2 DataLoader workers, resumed on another
  number of workers: every rank raises the same error, or counts the same skips.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import re
import shutil
import tarfile
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from spawned import launch_ranks
from tar_reference import damage, readable_keys, text_of, write_shard
from torch.utils.data import DataLoader

from contrastive_dist import DistributedShardList, DistributedStreamingBatches, EmptySafeCollate

wds = pytest.importorskip("webdataset")

EXAMPLE = (torch.zeros(1), 0)
CASES = int(os.environ.get("SHARD_FUZZ_CASES", "160"))


def verify(samples):
    """The decoding stage: a sample is exactly what was written (its fields, its id, its text), or it raises."""
    for sample in samples:
        sample_id = int(sample["__key__"][1:])
        fields = sorted(key for key in sample if not key.startswith("__"))
        if fields != (["cls", "txt"] if text_of(sample_id) else ["cls"]) or int(sample["cls"]) != sample_id or (
                text_of(sample_id) and sample["txt"].decode() != text_of(sample_id)):
            raise ValueError(f"sample {sample['__key__']} is not what was written (fields {fields})")
        yield torch.tensor([float(sample_id)]), sample_id


def fresh_shards(directory: Path, rng: random.Random):
    """1-3 shards of 1-8 samples, the first always damaged, the others half the time; what the reference says."""
    directory.mkdir(parents=True, exist_ok=True)
    case = {"shards": [], "readable": set(), "shard_of": {}, "changed": set(), "corruptions": 0}
    first = 0
    for index in range(rng.randint(1, 3)):
        count = rng.randint(1, 8)
        path = directory / f"part-{index}.tar"
        members = write_shard(path, first, count)
        original = data = path.read_bytes()
        if index == 0 or rng.random() < 0.5:
            data, done = damage(original, members, rng)
            case["corruptions"] += len(done)
            path.write_bytes(data)
        case["readable"] |= {int(key[1:]) for key in readable_keys(original, data, members)}
        case["shard_of"].update({sample_id: str(path) for sample_id in range(first, first + count)})
        if data != original:
            case["changed"].add(str(path))
        case["shards"].append(str(path))
        first += count
    case["every"] = set(case["shard_of"])
    return case


def read_alone(path: str) -> set[int]:
    """What webdataset alone yields from one shard before it stops: the samples recovery adds are the others."""
    ids = set()
    try:
        for _, sample_id in verify(wds.tarfile_to_samples()(iter([{"url": path}]))):
            ids.add(sample_id)
    except Exception:  # noqa: BLE001 - unreadable from here on
        pass
    return ids


def read_slots(shards, slots, on_error, state=None):
    """Each of ``slots`` slots, read in this process: a list of ``slots`` replicas reads what each rank-worker does."""
    results = []
    for slot in range(slots):
        shard_list = DistributedShardList(shards, shuffle=True, seed=5, num_replicas=slots, rank=slot)
        if state is not None:
            shard_list.load_state_dict(state)
        ids, error = [], None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            try:
                for _, sample_id in shard_list.pipeline(wds.tarfile_to_samples(), verify, on_error=on_error):
                    ids.append(sample_id)
            except RuntimeError as raised:
                error = str(raised)
        results.append({"shards": shard_list.shards_for(), "ids": ids, "error": error,
                        "warned": [str(warning.message) for warning in caught
                                   if "on_error='skip'" in str(warning.message)]})
    return results


def first_part(shards, stop_after):
    """One slot under a DistributedStreamingBatches, ``on_error="skip"``, stopped after ``stop_after`` steps."""
    loader = DataLoader(DistributedShardList(shards, shuffle=True, seed=5).pipeline(
        wds.tarfile_to_samples(), verify, on_error="skip"), batch_size=2, collate_fn=EmptySafeCollate([EXAMPLE]))
    batches, ids = DistributedStreamingBatches(loader), []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        for step, (_, batch_ids) in enumerate(batches, start=1):
            ids += batch_ids.tolist()
            if step == stop_after:
                break
    state = batches.state_dict()
    return ids, state, batches.skipped(), [str(warning.message) for warning in caught]


def check_skip(case, ids, warned, skipped):
    """Every readable sample exactly once (a damaged one that still reads true may come too); a lost one counted.

    A lost sample's shard is named in a warning.
    """
    assert len(ids) == len(set(ids)), f"samples repeated: {sorted(ids)}"
    assert case["readable"] <= set(ids) <= case["every"], f"readable {sorted(case['readable'])}, read {sorted(ids)}"
    for sample_id in case["every"] - set(ids):
        assert skipped >= 1
        assert any(repr(case["shard_of"][sample_id]) in message for message in warned), (sample_id, warned)


def check_raise(case, results):
    """A slot raises naming a damaged shard and its rank, or reads every sample of its shards; none twice."""
    for slot, result in enumerate(results):
        ids = result["ids"]
        assert len(ids) == len(set(ids)) and set(ids) <= case["every"], ids
        if result["error"] is None:
            written = {sample_id for sample_id, path in case["shard_of"].items() if path in result["shards"]}
            assert set(ids) == written, f"slot {slot} read {sorted(ids)} of {sorted(written)} without an error"
        else:
            message = result["error"]
            assert f"on rank {slot}" in message, message
            named = re.search(r"shard '([^']+)'", message)
            assert named and named.group(1) in case["changed"], message
            at = re.search(r"damaged at byte (\d+)", message)
            assert at is None or int(at.group(1)) % 512 == 0, message


def run_case(directory: Path, seed: int, totals: Counter) -> None:
    """One fuzzer case: shards damaged at random, read in the mode, layout and resume the seed picks."""
    rng = random.Random(seed)
    case = fresh_shards(directory, rng)
    on_error = ("raise", "skip")[seed % 2]
    slots = (1 + seed // 2 % 3) * (1, 2)[seed // 6 % 2]  # 1-3 ranks × (0 workers: 1 slot each | 2 workers: 2)
    totals["cases"] += 1
    totals["corruptions"] += case["corruptions"]
    totals["damaged samples"] += len(case["every"] - case["readable"])
    if on_error == "raise":
        results = read_slots(case["shards"], slots, "raise")
        check_raise(case, results)
        totals["slots raised"] += sum(result["error"] is not None for result in results)
        return
    ids, warned, skipped, state = [], [], 0, None
    if seed % 3 == 0:  # resumed in the middle, on another layout
        ids, saved, skipped, warned = first_part(case["shards"], rng.randint(1, 3))
        state = saved["shards"]
        totals["resumed"] += 1
    results = read_slots(case["shards"], slots, "skip", state)
    ids += [sample_id for result in results for sample_id in result["ids"]]
    warned += [message for result in results for message in result["warned"]]
    check_skip(case, ids, warned, skipped + len(warned))
    totals["damaged samples that still read true"] += len(set(ids) - case["readable"])
    alone = set().union(*(read_alone(path) for path in case["shards"]))
    totals["recovered samples"] += len(set(ids) - alone)
    totals["skip cases with recovery"] += bool(set(ids) - alone)


def test_fuzzed_corruptions_never_lose_a_readable_sample_silently(tmp_path):
    totals: Counter = Counter()
    for seed in range(CASES):
        directory = tmp_path / f"case-{seed}"
        try:
            run_case(directory, seed, totals)
        except AssertionError as error:
            raise AssertionError(f"seed {seed}: {error}") from error
        shutil.rmtree(directory)
    print(f"\nshard fuzzer: {dict(totals)}")
    assert totals["cases"] == CASES and totals["corruptions"] >= CASES


def eight_samples(path: Path, region: str, fill: str) -> tarfile.TarInfo:
    """The issue's shard: 8 samples by webdataset's writer, the headers of the fifth member overwritten; that member.

    ``region``: its first header block (webdataset's writer puts a pax header first), or all its headers.
    """
    with wds.TarWriter(str(path)) as writer:
        for sample_id in range(8):
            writer.write({"__key__": f"s{sample_id:03d}", "cls": sample_id})
    with tarfile.open(path) as archive:
        fifth = archive.getmembers()[4]
    length = 512 if region == "first block" else fifth.offset_data - fifth.offset
    data = bytearray(path.read_bytes())
    data[fifth.offset : fifth.offset + length] = bytes(length) if fill == "zeros" else b"\x07" * length
    path.write_bytes(bytes(data))
    return fifth


def issue_stream(shards, on_error, state=None):
    dataset = DistributedShardList(shards, shuffle=False).pipeline(
        wds.tarfile_to_samples(), wds.decode(), wds.to_tuple("cls"), on_error=on_error)
    batches = DistributedStreamingBatches(DataLoader(dataset, batch_size=2, collate_fn=EmptySafeCollate([(0,)])))
    if state is not None:
        batches.load_state_dict(state)
    return batches


@pytest.mark.parametrize("fill", ["junk", "zeros"])
@pytest.mark.parametrize("region", ["first block", "all headers"])
def test_a_damaged_header_mid_shard_raises_or_is_counted_and_the_rest_read_on(tmp_path, region, fill):
    path = tmp_path / "part.tar"
    fifth = eight_samples(path, region, fill)
    with pytest.raises(RuntimeError, match=rf"cannot read shard '{re.escape(str(path))}' \(after 4 of its samples\) "
                                           rf"on rank 0: the tar is damaged at byte {fifth.offset}: "):
        list(issue_stream([str(path)], "raise"))
    batches = issue_stream([str(path)], "skip")
    with pytest.warns(RuntimeWarning, match=rf"skipped the damaged part of shard .* at byte {fifth.offset}") as caught:
        ids = [value for (classes,) in batches for value in classes.tolist()]
    # Only the pax header lost: the member's own header is found by the scan, and the sample is read.
    assert ids == ([0, 1, 2, 3, 4, 5, 6, 7] if region == "first block" else [0, 1, 2, 3, 5, 6, 7])
    assert batches.skipped() == 1 and len([w for w in caught if "on_error='skip'" in str(w.message)]) == 1


@pytest.mark.parametrize("stop_after", [1, 2, 3])
def test_a_resume_across_the_damage_reads_every_sample_once_and_counts_it_once(tmp_path, stop_after):
    path = tmp_path / "part.tar"
    eight_samples(path, "all headers", "junk")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        first = issue_stream([str(path)], "skip")
        ids = []
        for step, (classes,) in enumerate(first, start=1):
            ids += classes.tolist()
            if step == stop_after:
                break
        rest = issue_stream([str(path)], "skip", first.state_dict())
        ids += [value for (classes,) in rest for value in classes.tolist()]
    assert ids == [0, 1, 2, 3, 5, 6, 7] and rest.skipped() == 1
    assert 1 <= len([w for w in caught if "on_error='skip'" in str(w.message)]) <= 2  # read again after the resume


def test_a_streamed_shard_read_short_of_its_stream_raises_or_is_counted(tmp_path):
    path = tmp_path / "part.tar"
    eight_samples(path, "all headers", "zeros")
    url = f"pipe:cat {path}"  # .tar at the end: a tar streamed through a pipe, checked to its end
    with pytest.raises(RuntimeError, match=r"cannot read shard 'pipe:cat .*' \(after 4 of its samples\) on rank 0: "
                                           r"the tar is damaged \d+ bytes after where it stopped"):
        list(issue_stream([url], "raise"))
    batches = issue_stream([url], "skip")
    with pytest.warns(RuntimeWarning, match="skipped the damaged part of shard 'pipe:cat"):
        ids = [value for (classes,) in batches for value in classes.tolist()]
    assert ids == [0, 1, 2, 3] and batches.skipped() == 1  # a stream is not read again: its rest is lost, counted


WORLD = 3
GLOO_CASES = [(on_error, workers, resume) for workers in (0, 2) for on_error, resume in
              (("raise", False), ("skip", False), ("skip", True))]


def gloo_segment(shards, on_error, workers, state=None, stop_after=None):
    """This rank's part of one stream over ``shards``: its ids, the skips, the error, the state."""
    dataset = DistributedShardList(shards, shuffle=True, seed=5).pipeline(wds.tarfile_to_samples(), verify,
                                                                          on_error=on_error)
    loader = DataLoader(dataset, batch_size=2, num_workers=workers, collate_fn=EmptySafeCollate([EXAMPLE]),
                        multiprocessing_context="forkserver" if workers else None)
    batches = DistributedStreamingBatches(loader)
    if state is not None:
        batches.load_state_dict(state)
    ids, error = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            for step, (_, batch_ids) in enumerate(batches, start=1):
                ids += batch_ids.tolist()
                if step == stop_after:
                    break
        except RuntimeError as raised:
            error = str(raised)
    return {"ids": ids, "skipped": batches.skipped(), "error": error, "state": batches.state_dict()}


def gloo_rank(rank, store_path, out_dir, cases):
    torch.set_num_threads(1)
    torch_mp.set_forkserver_preload(["torch", "webdataset", "contrastive_dist", __name__])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    results = []
    for shards, (on_error, workers, resume) in cases:
        if not resume:
            results.append([gloo_segment(shards, on_error, workers)])
            continue
        first = gloo_segment(shards, on_error, workers, stop_after=1)
        states = [None] * WORLD
        dist.all_gather_object(states, first["state"])
        results.append([first, gloo_segment(shards, on_error, 2 - workers, state=states[0])])  # other workers
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(400)
def test_fuzzed_corruptions_on_gloo_ranks_with_workers_and_resumes(tmp_path):
    cases, references = [], []
    for index, grid in enumerate(GLOO_CASES):
        case = fresh_shards(tmp_path / f"case-{index}", random.Random(10_000 + index))
        cases.append((case["shards"], grid))
        references.append(case)
    ranks = launch_ranks(gloo_rank, (str(tmp_path / "store"), str(tmp_path), cases), WORLD, tmp_path, timeout=360)
    for index, ((on_error, _, resume), case) in enumerate(zip(GLOO_CASES, references)):
        segments = [[rank[index][part] for rank in ranks] for part in range(1 + resume)]
        for parts in segments:
            assert len({part["error"] for part in parts}) == 1, (index, parts)  # every rank the same error, or none
            assert len({part["skipped"] for part in parts}) == 1, (index, parts)  # and the same skips
        ids = [sample_id for parts in segments for part in parts for sample_id in part["ids"]]
        error = segments[-1][0]["error"]
        if on_error == "raise" and error is not None:
            named = re.search(r"cannot read shard '([^']+)'|of shard '([^']+)'", error)
            assert named and (named.group(1) or named.group(2)) in case["changed"], error
            assert len(ids) == len(set(ids)) and set(ids) <= case["every"]
        elif on_error == "raise":
            assert sorted(ids) == sorted(case["every"]), (index, ids)
        else:
            assert error is None, error
            skipped = segments[-1][0]["skipped"]
            assert len(ids) == len(set(ids)) and case["readable"] <= set(ids) <= case["every"], (index, ids)
            assert skipped >= 1 or set(ids) == case["every"], (index, skipped)
