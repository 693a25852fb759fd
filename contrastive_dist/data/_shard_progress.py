"""How far one epoch of a sharded stream has come, per shard, and how the rest is dealt to (rank, worker) slots.

Each shard is *untouched* (0), *finished* (:data:`FINISHED`), or *in progress*: ``k > 0`` of its
samples consumed. That table is the whole dataset's progress whatever the layout that made it, so
it resumes on another number of ranks or workers: the epoch's *plan* lists the shards still to
read — the ones in progress first (with the samples to skip), then the untouched ones, both in
the epoch's shard order — and slot ``j`` of ``slots`` reads items ``j, j + slots, ...`` of it.
A fresh epoch's plan is the epoch's shard order, so a fresh epoch is dealt as it always was.
The state's checks (:func:`decode_progress`) refuse another shard list, seed or ``shuffle``, and
a count of consumed samples that the shard's file could not hold. The state also keeps the size of
each local shard in progress (``sizes``): a shard rewritten since no longer holds the samples its
count skips, which the reader finds (:mod:`~contrastive_dist.data._shard_reader`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FINISHED", "EpochShards", "decode_progress", "encode_progress", "file_size", "list_digests",
           "names_digest"]

FINISHED = -1
_SMALLEST_SAMPLE = 512  # bytes: one tar member's header, with no contents
FORMAT = "contrastive_dist.DistributedShardList"
VERSION = 1
_KEYS = ("format", "version", "epoch", "seed", "shuffle", "shards", "names", "progress")


class EpochShards:
    """The plan of one epoch and, as batches are consumed, its progress per shard.

    Args:
        order: the epoch's order of the shard indices.
        start: per shard, its progress when the epoch (re)started: 0, ``FINISHED`` or samples consumed.
        slots: the (rank, worker) slots reading the epoch.

    Example:
        >>> shards = EpochShards(order=[2, 0, 1, 3], start=[5, FINISHED, 0, 0], slots=2)
        >>> shards.plan(0), shards.plan(1)        # shard 0 (5 samples done) first, then the untouched 2 and 3
        ([(0, 5), (3, 0)], [(2, 0)])
        >>> shards.record(slot=0, shard=3, consumed=4)   # slot 0 has moved on to shard 3: shard 0 is finished
        >>> shards.progress
        [-1, -1, 0, 4]

    """

    def __init__(self, order: Sequence[int], start: Sequence[int], slots: int) -> None:
        started = [(index, start[index]) for index in order if start[index] > 0]
        self.items = started + [(index, 0) for index in order if start[index] == 0]
        self.progress = list(start)
        self.slots = slots
        self._cursors = [0] * slots  # per slot: the position in its plan of the shard it reads now

    def plan(self, slot: int) -> list[tuple[int, int]]:
        """``(shard, samples to skip)`` of each shard ``slot`` reads, in order."""
        return self.items[slot :: self.slots]

    def record(self, slot: int, shard: int, consumed: int) -> None:
        """``slot`` has consumed ``consumed`` samples of ``shard``; the shards before it in its plan are finished."""
        position = self._cursors[slot]
        while True:  # usually the shard it read before, or the next one
            item = slot + position * self.slots
            if item >= len(self.items):
                raise ValueError(f"slot {slot} reported shard {shard}, which is not in the rest of its plan")
            if self.items[item][0] == shard:
                break
            position += 1
        for earlier in range(self._cursors[slot], position):  # a slot reads its plan in order
            self.progress[self.items[slot + earlier * self.slots][0]] = FINISHED
        self._cursors[slot] = position
        self.progress[shard] = consumed

    def finish(self) -> None:
        """Every slot has read its whole plan: every shard is finished."""
        self.progress = [FINISHED] * len(self.progress)


def list_digests(shards: Sequence[Any]) -> tuple[int, int, int, int]:
    """What every rank's shard list must share, as 62-bit digests: ``(count, order, files, sizes)``.

    The names in order, the names as a set, and the names with the sizes of the local files: ranks
    whose lists differ are told whether in their order (an unsorted ``glob`` on two machines), in
    their files, or in the files' sizes (a shard rewritten on one machine's disk).
    """
    names = [os.path.basename(str(shard).rstrip("/")) for shard in shards]
    sizes = [file_size(shard) for shard in shards]
    return (len(shards), _digest(names), _digest(sorted(names)),
            _digest(sorted(zip(names, [-1 if size is None else size for size in sizes]))))


def _digest(value: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


def names_digest(shards: Sequence[Any]) -> str:
    """A digest of the shards' file names (not their directories: a dataset may move between runs)."""
    names = "\n".join(os.path.basename(str(shard).rstrip("/")) for shard in shards)
    return hashlib.blake2b(names.encode(), digest_size=16).hexdigest()


def file_size(shard: Any) -> int | None:
    """The size in bytes of ``shard`` if it is a local file; else None."""
    path = os.fspath(shard) if isinstance(shard, (str, os.PathLike)) else None
    return os.path.getsize(path) if path is not None and os.path.isfile(path) else None


def encode_progress(progress: Sequence[int], *, epoch: int, seed: int, shuffle: bool,
                    shards: Sequence[Any]) -> dict[str, Any]:
    """The state of a shard list: its progress per shard, what fixes the epoch's order, the sizes in progress."""
    sizes = {str(index): file_size(shards[index]) for index, done in enumerate(progress) if done > 0}
    return {"format": FORMAT, "version": VERSION, "epoch": epoch, "seed": seed, "shuffle": shuffle,
            "shards": len(shards), "names": names_digest(shards), "progress": list(progress),
            "sizes": {index: size for index, size in sizes.items() if size is not None}}


def decode_progress(state: object, *, seed: int, shuffle: bool,
                    shards: Sequence[Any]) -> tuple[int, list[int], dict[int, int]]:
    """Check ``state`` against a shard list: ``(epoch, progress, saved sizes)``, or a ``ValueError`` saying why not.

    A state saved before sizes were kept loads with none.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"cannot resume: expected a dict made by DistributedShardList.state_dict(), got "
                         f"{type(state).__name__}")
    missing = [key for key in _KEYS if key not in state]
    if missing:
        raise ValueError(f"cannot resume: the shard state lacks {missing}; expected a dict made by "
                         f"DistributedShardList.state_dict(), got the keys {sorted(map(str, state))}")
    if state["format"] != FORMAT or state["version"] != VERSION:
        raise ValueError(f"cannot resume: expected a shard state of format {FORMAT!r} version {VERSION}, got "
                         f"{state['format']!r} version {state['version']!r}")
    if state["shards"] != len(shards) or state["names"] != names_digest(shards):
        raise ValueError(f"cannot resume: the state was saved for another list of shards ({state['shards']!r} shards, "
                         f"names digest {state['names']!r}), this one has {len(shards)} (digest "
                         f"{names_digest(shards)!r}); pass the same shard files in the same order")
    if state["seed"] != seed:
        raise ValueError(f"cannot resume: the state was saved with seed={state['seed']!r}, this shard list has "
                         f"seed={seed}; the epoch's shard order would differ: pass seed={state['seed']!r}")
    if state["shuffle"] is not shuffle:
        raise ValueError(f"cannot resume: the state was saved with shuffle={state['shuffle']!r}, this shard list has "
                         f"shuffle={shuffle}")
    epoch, progress = state["epoch"], state["progress"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise ValueError(f"cannot resume: the shard state's 'epoch' must be an int in [0, 2**63), got {epoch!r}")
    if (not isinstance(progress, Sequence) or len(progress) != len(shards)
            or any(isinstance(value, bool) or not isinstance(value, int) or value < FINISHED for value in progress)):
        raise ValueError(f"cannot resume: the shard state's 'progress' must hold one int >= {FINISHED} per shard "
                         f"({len(shards)}), got {str(progress)[:200]}")
    sizes = _saved_sizes(state.get("sizes", {}), progress)
    for index, done in enumerate(progress):
        size = file_size(shards[index]) if done > 0 else None
        if size is not None and sizes.get(index, size) == size and done > size // _SMALLEST_SAMPLE:
            raise ValueError(f"cannot resume: the shard state says {done} samples of shard {str(shards[index])!r} "
                             f"were consumed, but its {size} bytes hold at most {size // _SMALLEST_SAMPLE}: the state "
                             "was not made by state_dict() for these files")
    return epoch, list(progress), sizes


def _saved_sizes(saved: object, progress: Sequence[int]) -> dict[int, int]:
    """The saved sizes of the shards in progress, by index; a ``ValueError`` for anything else."""
    if not isinstance(saved, Mapping) or any(
            not str(key).isdigit() or not int(key) < len(progress) or progress[int(key)] <= 0
            or isinstance(size, bool) or not isinstance(size, int) or size < 0 for key, size in saved.items()):
        raise ValueError(f"cannot resume: the shard state's 'sizes' must map the index of each shard in progress to "
                         f"its size in bytes, got {str(saved)[:200]}")
    return {int(key): size for key, size in saved.items()}
