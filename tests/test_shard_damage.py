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

import os
import random
import re
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
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
