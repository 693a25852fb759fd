"""One slot's shards read through the first stage: where each sample comes from, what to skip, what failed.

:class:`SlotReader` hands the slot's shards (its plan) to the first stage one after another,
follows each sample's shard (``__url__``) through the plan, counts the samples of every shard, and
drops the ones a resumed state says were consumed already: read from the tar file, never decoded.

A shard that cannot be read (a missing or empty file, random bytes, a tar cut inside a member: any
exception out of the first stage) raises an error that names it, the slot's DataLoader worker and
rank, and the original exception; with ``on_error="skip"`` it is skipped from there on with one
warning, and the first stage starts again at the slot's next shard. A first stage that groups
files into samples (webdataset's) holds the last complete sample when the damage is read: that
sample is lost with the rest of the shard. Python's ``tarfile``, so webdataset, ends a tar cut
inside a header *silently*, as if it were complete; so when the first stage asks for the next
shard, a local ``.tar`` file it has just read is checked to end as tars do, with zero blocks.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from contrastive_dist.data._shard_progress import FINISHED

__all__ = ["ON_ERROR", "SlotReader", "check_on_error"]

ON_ERROR = ("raise", "skip")
_BLOCK = 512  # tar's block: a complete tar ends with blocks of zeros


def check_on_error(on_error: object) -> str:
    """``on_error`` if it is one of :data:`ON_ERROR`; else a ``ValueError`` naming them."""
    if not isinstance(on_error, str) or on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
    return on_error


class SlotReader:
    """The samples of one slot's plan out of ``first_stage``; see the module docstring.

    Args:
        shards: the shard names of the whole list.
        plan: ``(shard index, samples to skip)`` per shard of this slot, in order.
        slot: the (rank, worker) slot.
        first_stage: turns ``{"url": shard}`` dicts into samples naming their shard in ``__url__``.
        on_error: ``"raise"`` or ``"skip"`` an unreadable shard or sample.
        where: which worker of which rank reads, for the messages.

    """

    def __init__(self, shards: Sequence[Any], plan: list[tuple[int, int]], slot: int,
                 first_stage: Callable[[Iterator[Any]], Iterator[Any]], *, on_error: str, where: str) -> None:
        self.shards, self.plan, self.slot = shards, plan, slot
        self.first_stage, self.on_error, self.where = first_stage, on_error, where
        self.item = 0  # the plan's item whose samples come now
        self.read = 0  # samples of that shard read so far, skipped ones included
        self.handed = -1  # the plan's item last handed to the first stage: the shard it reads
        self.source: dict[str, Any] = {}  # what it was handed, which it may add the opened stream to
        # Position of the last sample let through (its shard, the samples of it read), and its key.
        self.shard, self.consumed, self.key = (plan[0][0] if plan else -1), 0, None
        self.skipped = 0  # unreadable shards and samples skipped since the position was last taken
        self.passed = 0  # samples let through

    def samples(self) -> Generator[Any, None, None]:
        """The slot's samples, past the consumed ones; an unreadable shard raises or is skipped."""
        start = 0
        while start < len(self.plan):
            stream = iter(self.first_stage(self._sources(start)))
            while True:
                try:
                    sample = next(stream)
                except StopIteration:
                    return
                except Exception as error:  # noqa: BLE001 - whatever the first stage raised: its shard is unreadable
                    if self.handed < start:  # it failed before reading a shard: not a shard's fault
                        raise
                    self._unreadable(self.handed, error)
                    start = self.handed + 1  # a fresh first stage, from the next shard on
                    break
                if self._let_through(sample):
                    yield sample

    def unprocessable(self, error: Exception) -> None:
        """A later stage raised on the sample let through last: raise, or warn and count it skipped."""
        what = (f"the sample with key {self.key!r} (number {self.consumed} of shard {self._name(self.shard)!r}) "
                f"{self.where}: {_describe(error)}")
        if self.on_error == "raise":
            raise RuntimeError(f"a stage raised on {what}") from error
        warnings.warn(f"on_error='skip': skipped {what}", RuntimeWarning, stacklevel=2)
        self.skipped += 1

    def take_skipped(self) -> int:
        """The shards and samples skipped since the last call."""
        skipped, self.skipped = self.skipped, 0
        return skipped

    def _sources(self, start: int) -> Iterator[dict[str, Any]]:
        for item in range(start, len(self.plan)):
            index, skip = self.plan[item]
            self.handed, self.source = item, {"url": self.shards[index], **({"skip": skip} if skip else {})}
            yield self.source
            _check_tar_end(self.shards[index])  # the next shard is asked for: this one was read to its end

    def _let_through(self, sample: Any) -> bool:
        url = sample.get("__url__") if isinstance(sample, dict) else None
        if url is None:
            raise TypeError("the first stage after the shard list must yield samples that name their shard in "
                            f"'__url__' (webdataset.tarfile_to_samples() does), got {type(sample).__name__} "
                            f"{str(sample)[:100]}")
        if url != self.shards[self.plan[self.item][0]]:
            self.item, self.read = self._find(url), 0  # a new shard (any in between held no sample)
        self.read += 1
        if self.read <= self.plan[self.item][1]:
            return False  # consumed before the resume: read past it, never decoded
        self.shard, self.consumed = self.plan[self.item][0], self.read
        self.key, self.passed = sample.get("__key__"), self.passed + 1
        return True

    def _find(self, url: Any) -> int:
        for item in range(self.item + 1, len(self.plan)):
            if self.shards[self.plan[item][0]] == url:
                return item
        raise ValueError(f"a sample of {url!r} came after shard {self.shards[self.plan[self.item][0]]!r}, but it is "
                         f"not one of this slot's next shards: the first stage must read the shards it is given, in "
                         f"order, and name each sample's shard in '__url__' as it was given")

    def _unreadable(self, item: int, error: Exception) -> None:
        index = self.plan[item][0]
        read = self.read if item == self.item else 0  # no sample of it came out
        what = f"shard {self._name(index)!r} (after {read} of its samples) {self.where}: {_describe(error)}"
        if self.on_error == "raise":
            raise RuntimeError(f"cannot read {what}") from error
        warnings.warn(f"on_error='skip': skipped the rest of {what}", RuntimeWarning, stacklevel=2)
        close = getattr(self.source.get("stream"), "close", None)  # the file webdataset opened for it: left open
        if callable(close):
            close()
        self.skipped += 1
        self.shard, self.consumed = index, FINISHED  # the slot is past it: a resume does not read it again

    def _name(self, index: int) -> str:
        return str(self.shards[index]) if index >= 0 else "?"


def _check_tar_end(shard: Any) -> None:
    """Raise ``EOFError`` if ``shard`` is a local ``.tar`` file whose last (partial) block holds data: cut short."""
    path = os.fspath(shard) if isinstance(shard, (str, os.PathLike)) else None
    if path is None or not path.endswith(".tar") or not os.path.isfile(path):
        return
    size = os.path.getsize(path)
    tail = size % _BLOCK or _BLOCK
    with open(path, "rb") as file:
        file.seek(max(0, size - tail))
        last = file.read(tail)
    if last.strip(b"\0"):
        raise EOFError(f"the file ends inside a tar member or header ({size} bytes, its last {len(last)} not "
                       "zeros): it was cut short; tarfile stops there silently, as if the shard were complete")


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text[:400]}{' ...' if len(text) > 400 else ''}"
