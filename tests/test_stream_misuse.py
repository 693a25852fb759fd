"""Streams over real webdataset shards refuse what would read samples twice or lose them without a word.

* Ranks whose shard lists differ (another order, another file, one more shard, a file of another size)
  raise the same ``ValueError`` on every rank as the stream starts, within seconds; the same list then works.
* A resumed shard in progress that was rewritten since its state was saved, or that ends before the
  samples its state says were consumed, raises an error naming it, or with ``on_error="skip"`` is
  warned about, counted and skipped; a hand-made state that says more samples were consumed than
  the file could hold does not load.
* A tar whose second half is zeros is damaged there, not complete: raised, or warned about and counted,
  read from a local file or streamed through a pipe.
"""

from __future__ import annotations

import re
import shutil
import tarfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from contrastive_dist import DistributedShardList, DistributedStreamingBatches, EmptySafeCollate
from contrastive_dist.testing import WorkerPool

wds = pytest.importorskip("webdataset")

COUNTS = (5, 3, 6, 4)


def write_shards(directory: Path, counts: tuple[int, ...] = COUNTS) -> list[str]:
    """Shards of ``counts`` samples (ids unique across them), each sample's id in its ``cls``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, next_id = [], 0
    for index, count in enumerate(counts):
        path = directory / f"part-{index}.tar"
        with wds.TarWriter(str(path)) as writer:
            for _ in range(count):
                writer.write({"__key__": f"s{next_id:04d}", "cls": next_id, "txt": "x" * 700})
                next_id += 1
        paths.append(str(path))
    return paths


def stream(shards: list[str], on_error: str = "raise", *, shuffle: bool = False) -> DistributedStreamingBatches:
    dataset = DistributedShardList(shards, shuffle=shuffle, seed=3).pipeline(
        wds.tarfile_to_samples(), wds.decode(), wds.to_tuple("cls"), on_error=on_error)
    return DistributedStreamingBatches(DataLoader(dataset, batch_size=2, collate_fn=EmptySafeCollate([(0,)])))


def ids_of(batches: DistributedStreamingBatches, stop_after: int | None = None) -> list[int]:
    ids: list[int] = []
    for step, (classes,) in enumerate(batches, start=1):
        ids += classes.tolist()
        if step == stop_after:
            break
    return ids


def _differing_lists(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    shards = sorted(str(path) for path in Path(directory, "a").glob("*.tar"))
    resized = [str(Path(directory, "b", Path(shard).name)) for shard in shards]  # part-2.tar bigger on "b"
    lists = {
        "order": shards[::-1] if rank == 1 else shards,
        "other file": [*shards[:-1], str(Path(directory, "b", "part-9.tar"))] if rank == 1 else shards,
        "one more shard": shards + [str(Path(directory, "b", "part-9.tar"))] if rank == 1 else shards,
        "size": resized if rank == 1 else shards,
    }
    outcome: dict[str, Any] = {}
    for case, own in lists.items():
        start = time.monotonic()
        try:
            ids_of(stream(own))
            outcome[case] = ("no error", "", 0.0)
        except ValueError as error:
            outcome[case] = (type(error).__name__, str(error), time.monotonic() - start)
    outcome["after"] = ids_of(stream(shards))  # the same list on every rank works
    return outcome


def test_ranks_whose_shard_lists_differ_raise_the_same_error_as_the_stream_starts(
    pool: Callable[[int], WorkerPool], tmp_path: Path
) -> None:
    shards = write_shards(tmp_path / "a")
    copies = tmp_path / "b"
    shutil.copytree(tmp_path / "a", copies)
    write_shards(copies / "bigger", (COUNTS[2] + 1,))
    (copies / "bigger" / "part-0.tar").replace(copies / "part-2.tar")  # the same name, another size
    shutil.copy(shards[0], copies / "part-9.tar")
    per_rank = pool(2).run(_differing_lists, str(tmp_path), timeout=60, return_exceptions=True)
    explained = {"order": "the same files as rank 0's in another order", "other file": "other files than rank 0's",
                 "one more shard": "rank 1: 5 shards", "size": "the same file names as rank 0's, some of another size"}
    assert all(isinstance(outcome, dict) for outcome in per_rank), per_rank
    assert sorted(sum((outcome.pop("after") for outcome in per_rank), [])) == list(range(sum(COUNTS)))
    for rank, outcome in enumerate(per_rank):
        for case, (kind, message, seconds) in outcome.items():
            assert kind == "ValueError" and "every rank must stream the same list of shards" in message, (case, message)
            assert explained[case] in message and "rank 0: 4 shards\n" in message, (case, message)
            assert (kind, message) == per_rank[0][case][:2] and seconds < 5.0, (rank, case)


def _resumed(shards: list[str], on_error: str, state: dict[str, Any]) -> tuple[list[int], int, list[str], str]:
    """The rest of the epoch from ``state``: ids, skips, the skip warnings, and the error (or "")."""
    batches = stream(shards, on_error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        batches.load_state_dict(state)
        try:
            ids = ids_of(batches)
        except RuntimeError as error:
            return [], batches.skipped(), [], str(error)
    return ids, batches.skipped(), [str(w.message) for w in caught if "on_error='skip'" in str(w.message)], ""


def _saved_mid_shard(shards: list[str]) -> tuple[dict[str, Any], list[int], int]:
    """A state saved in the middle of the first shard; the ids read, and that shard's samples consumed."""
    first = stream(shards)
    ids = ids_of(first, stop_after=1)
    state = first.state_dict()
    consumed = state["shards"]["progress"][0]
    assert consumed == 2 and state["shards"]["sizes"] == {"0": Path(shards[0]).stat().st_size}, state
    return state, ids, consumed


@pytest.mark.parametrize("shorter", [True, False])
def test_a_shard_in_progress_rewritten_since_its_state_is_refused_or_skipped_and_counted(
    tmp_path: Path, shorter: bool
) -> None:
    shards = write_shards(tmp_path)
    state, ids, _ = _saved_mid_shard(shards)
    write_shards(tmp_path / "new", (1 if shorter else COUNTS[0] + 2,))
    (tmp_path / "new" / "part-0.tar").replace(shards[0])  # rewritten: shorter than its offset, or longer
    got, skipped, warned, error = _resumed(shards, "raise", state)
    assert error.startswith("the data loader of rank 0 raised at step 1") and "cannot resume shard" in error, error
    assert f"{shards[0]!r} on rank 0: it holds" in error and "when the state was saved" in error, error
    got, skipped, warned, error = _resumed(shards, "skip", state)
    assert error == "" and skipped == 1 and len(warned) == 1 and "rewritten since" in warned[0], (error, warned)
    assert ids == [0, 1] and sorted(got) == list(range(COUNTS[0], sum(COUNTS))), "the other shards, every sample once"


def test_a_state_that_consumed_more_than_a_shard_holds_is_refused_or_skipped_and_counted(tmp_path: Path) -> None:
    shards = write_shards(tmp_path)
    state, ids, _ = _saved_mid_shard(shards)
    absurd = {**state, "shards": {**state["shards"], "progress": [10**6, *state["shards"]["progress"][1:]]}}
    with pytest.raises(ValueError, match=r"says 1000000 samples of shard .* were consumed, but its \d+ bytes hold at "
                                         r"most \d+: the state was not made by state_dict\(\)"):
        stream(shards).load_state_dict(absurd)
    # Within what the file could hold, but more than it does: found where the shard ends.
    handmade = {**state, "shards": {**state["shards"], "progress": [COUNTS[0] + 3, *state["shards"]["progress"][1:]]}}
    got, skipped, warned, error = _resumed(shards, "raise", handmade)
    assert f"cannot read shard {shards[0]!r} on rank 0: it ended after 5 samples, but the resumed state says 8" in error
    got, skipped, warned, error = _resumed(shards, "skip", handmade)
    assert error == "" and skipped == 1 and "is not the file the state counted in" in warned[0], (error, warned)
    assert sorted(got) == list(range(COUNTS[0], sum(COUNTS)))


def _second_half_zeroed(path: Path) -> tuple[int, int]:
    """Zero a shard from its middle member on, to the end; that member's offset and the samples before it."""
    with tarfile.open(path) as archive:
        members = archive.getmembers()
    middle = members[len(members) // 2]
    data = bytearray(path.read_bytes())
    data[middle.offset :] = bytes(len(data) - middle.offset)
    path.write_bytes(bytes(data))
    return middle.offset, len({member.name.split(".")[0] for member in members[: len(members) // 2]})


@pytest.mark.parametrize("piped", [False, True])
def test_a_tar_whose_second_half_is_zeros_is_damaged_there_not_complete(tmp_path: Path, piped: bool) -> None:
    (path,) = write_shards(tmp_path, (12,))
    offset, before = _second_half_zeroed(Path(path))
    url = f"pipe:cat {path}" if piped else path
    expected = rf"cannot read shard '{re.escape(url)}' \(after {before} of its samples\) on rank 0: the tar is damaged "
    with pytest.raises(RuntimeError, match=expected + r".*zeros.*more than a complete tar ends with"):
        ids_of(stream([url]))
    batches = stream([url], "skip")
    with pytest.warns(RuntimeWarning, match=rf"skipped the damaged part of shard '{re.escape(url)}'"):
        assert ids_of(batches) == list(range(before))
    assert batches.skipped() == 1
    if not piped:
        assert f"at byte {offset}: " in str(pytest.raises(RuntimeError, ids_of, stream([url])).value)
