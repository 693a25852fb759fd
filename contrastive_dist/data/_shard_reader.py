"""One slot's shards read through the first stage: where each sample comes from, what to skip, what failed.

:class:`SlotReader` hands the slot's shards (its plan) to the first stage one after another,
follows each sample's shard (``__url__``) through the plan, counts the samples of every shard, and
drops the ones a resumed state says were consumed already: read from the tar file, never decoded.

A shard that cannot be read (a missing or empty file, random bytes, a tar cut inside a member: any
exception out of the first stage) raises an error that names it, the slot's DataLoader worker and
rank, and the original exception; with ``on_error="skip"`` it is skipped from there on with one
warning, and the first stage starts again at the slot's next shard.

Python's ``tarfile``, so webdataset, ends a shard *silently* at a header that is invalid, zeroed or
cut. So every shard is checked to have been read to its end when the first stage asks for the next
one (:mod:`~contrastive_dist.data._tar_check`): a local ``.tar`` by walking its headers, a streamed
``.tar`` by reading what is left of its stream, which must be zeros. Damage found either way, or
behind an exception out of the first stage, is an error naming the shard, the byte and the rank;
with ``on_error="skip"`` it is warned about and counted (once per damaged place), and the intact
members of a local tar are read on from a copy of them (a temporary file), so that only the samples
of damaged members are lost. The damage takes one sample's place in the shard's count, the same at
every reading, so a resume past it neither reads a sample twice nor counts the damage again.

A resumed shard in progress must be the file its state counted in: one whose size changed since
the state was saved was rewritten, and one that ends before the samples its state says were
consumed is not that file either. Both raise an error naming the shard, or with ``on_error="skip"``
are warned about, counted and skipped.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from contrastive_dist.data._shard_progress import FINISHED, file_size
from contrastive_dist.data._tar_check import check_stream_rest, inspect_tar, local_tar, write_members
from contrastive_dist.data._tar_quick import reads_to_end

__all__ = ["ON_ERROR", "SlotReader", "check_on_error"]

ON_ERROR = ("raise", "skip")


def check_on_error(on_error: object) -> str:
    """``on_error`` if it is one of :data:`ON_ERROR`; else a ``ValueError`` naming them."""
    if not isinstance(on_error, str) or on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {list(ON_ERROR)}, got {on_error!r}")
    return on_error


class _Damaged(Exception):
    """A shard found damaged (on_error="raise"): raised through the first stage, then as a ``RuntimeError``."""


class SlotReader:
    """The samples of one slot's plan out of ``first_stage``; see the module docstring.

    Args:
        shards: the shard names of the whole list.
        plan: ``(shard index, samples to skip)`` per shard of this slot, in order.
        slot: the (rank, worker) slot.
        first_stage: turns ``{"url": shard}`` dicts into samples naming their shard in ``__url__``.
        on_error: ``"raise"`` or ``"skip"`` an unreadable shard or sample.
        where: which worker of which rank reads, for the messages.
        saved_sizes: the size of each shard in progress when the resumed state was saved, by index.

    """

    def __init__(self, shards: Sequence[Any], plan: list[tuple[int, int]], slot: int,
                 first_stage: Callable[[Iterator[Any]], Iterator[Any]], *, on_error: str, where: str,
                 saved_sizes: dict[int, int] | None = None) -> None:
        self.shards, self.plan, self.slot = shards, plan, slot
        self.saved_sizes = saved_sizes or {}
        self.first_stage, self.on_error, self.where = first_stage, on_error, where
        self.item = 0  # the plan's item whose samples come now
        self.read = 0  # samples of that shard read so far, skipped ones and damaged places included
        self.original = 0  # of those, the ones out of the shard itself (not out of a copy of its intact members)
        self.copied = 0  # samples out of the copy of its intact members
        self.copies: dict[str, int] = {}  # each such copy, and the plan's item it stands for
        self.handed = -1  # the plan's item last handed to the first stage: the shard it reads
        self.source: dict[str, Any] = {}  # what it was handed, which it may add the opened stream to
        # Position of the last sample let through (its shard, the samples of it read), and its key.
        self.shard, self.consumed, self.key = (plan[0][0] if plan else -1), 0, None
        self.skipped = 0  # unreadable shards and samples skipped since the position was last taken
        self.passed = 0  # samples let through

    def samples(self) -> Generator[Any, None, None]:
        """The slot's samples, past the consumed ones; an unreadable shard raises or is skipped."""
        start, copy = 0, None
        try:
            self.plan = [item for item in self.plan if not self._rewritten(*item)]
            while start < len(self.plan):
                stream = iter(self.first_stage(self._sources(start, copy)))
                while True:
                    try:
                        sample = next(stream)
                    except StopIteration:
                        return
                    except Exception as error:  # noqa: BLE001 - whatever the first stage raised: its shard is unreadable
                        if self.handed < start:  # it failed before reading a shard: not a shard's fault
                            raise
                        start, copy = self._after_error(self.handed, error)
                        break
                    if self._let_through(sample):
                        yield sample
        finally:
            for path in self.copies:
                _remove(path)

    def _rewritten(self, index: int, skip: int) -> bool:
        """Whether a shard in progress changed size since its state was saved (raised, or warned and counted)."""
        saved, now = self.saved_sizes.get(index), file_size(self.shards[index])
        if not skip or saved is None or now == saved:
            return False
        self._not_resumable(index, RuntimeError, f"it holds {now} bytes, but {saved} when the state was saved, so it "
                            f"was rewritten since and its {skip} consumed samples cannot be told apart")
        return True

    def _short(self, item: int) -> None:
        """A shard that ended before the samples its resumed state says were consumed: raise, or warn and count."""
        index, skip = self.plan[item]
        read = self.read if item == self.item else 0
        if read < skip:
            self._not_resumable(index, _Damaged, f"it ended after {read} samples, but the resumed state says {skip} "
                                "were consumed, so it is not the file the state counted in")

    def _not_resumable(self, index: int, kind: type[Exception], why: str) -> None:
        what = f"shard {self._name(index)!r} {self.where}: {why}"
        if self.on_error == "raise":
            raise kind(f"cannot resume {what}" if kind is RuntimeError else what)
        warnings.warn(f"on_error='skip': skipped {what}", RuntimeWarning, stacklevel=4)
        self.skipped += 1
        self.shard, self.consumed = index, FINISHED

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

    def _sources(self, start: int, copy: str | None) -> Iterator[dict[str, Any]]:
        for item in range(start, len(self.plan)):
            index, skip = self.plan[item]
            url = copy if item == start and copy is not None else self.shards[index]
            while url is not None:
                self.handed = item
                self.source = {"url": url, **({"skip": skip} if skip and url not in self.copies else {})}
                yield self.source
                url = self._after_end(item)  # the next shard is asked for: was this one read to its end?

    def _after_end(self, item: int) -> str | None:
        """Check the shard of ``item`` was read to its end; damage raises, or gives the copy to read on from."""
        shard = self.shards[self.plan[item][0]]
        path = local_tar(shard)
        copied = self.source["url"] in self.copies
        rest = (check_stream_rest(self.source.get("stream"))
                if not copied and path is None and str(shard).endswith(".tar") else None)
        self._close_stream()  # the first stage is done with it (webdataset leaves it open)
        if copied:
            _remove(self.source["url"])  # a copy holds intact members only
            return None
        if path is not None and not reads_to_end(path):
            layout = inspect_tar(path)
            if layout.damages:
                return self._damaged(item, [damage.describe() for damage in layout.damages], path,
                                     layout.read_on())
        if rest is not None:
            return self._damaged(item, [rest], None, [])
        self._short(item)
        return None

    def _damaged(self, item: int, damages: list[str], path: str | None, members: list[tuple[int, int]]) -> str | None:
        """Damage in the shard of ``item``: raise, or warn, count, and return a copy of its intact members (or None)."""
        self._enter(item)
        self.read += 1
        index, skip = self.plan[item]
        if self.read > skip:  # else a resumed state is past it: warned and counted when it was read
            what = (f"shard {self._name(index)!r} (after {self.original} of its samples) {self.where}: "
                    f"the tar is damaged {'; and '.join(damages)}")
            if self.on_error == "raise":
                raise _Damaged(what)
            warnings.warn(f"on_error='skip': skipped the damaged part of {what}"
                          f"{'; reading on from the intact members after it' if members else ''}",
                          RuntimeWarning, stacklevel=2)
            self.skipped += len(damages)
            self.shard, self.consumed = index, self.read
        if path is None or not members:
            return None
        descriptor, copy = tempfile.mkstemp(suffix=".tar", prefix=f"{os.path.basename(path)}.intact-")
        with os.fdopen(descriptor, "wb") as target:
            write_members(path, members, target)
        self.copies[copy] = item
        return copy

    def _after_error(self, item: int, error: Exception) -> tuple[int, str | None]:
        """The first stage raised on the shard of ``item``: raise, or skip its rest or its damaged part (and go on)."""
        self._close_stream()
        if isinstance(error, _Damaged):
            raise RuntimeError(f"cannot read {error}") from error
        path = local_tar(self.shards[self.plan[item][0]]) if self.source["url"] not in self.copies else None
        layout = inspect_tar(path) if path is not None else None
        damages = [damage.describe() for damage in layout.damages] if layout is not None else []
        if damages and self.on_error == "skip":
            # Read on from all its intact members: the first stage may have held back a complete sample it lost.
            copy = self._damaged(item, [*damages[:-1], f"{damages[-1]} ({_describe(error)})"], path,
                                 layout.members if layout is not None else [])
            if copy is not None:
                return item, copy
            self.shard, self.consumed = self.plan[item][0], FINISHED
            return item + 1, None
        self._unreadable(item, error, f" (the tar is damaged {'; and '.join(damages)})" if damages else "")
        return item + 1, None

    def _let_through(self, sample: Any) -> bool:
        url = sample.get("__url__") if isinstance(sample, dict) else None
        if url is None:
            raise TypeError("the first stage after the shard list must yield samples that name their shard in "
                            f"'__url__' (webdataset.tarfile_to_samples() does), got {type(sample).__name__} "
                            f"{str(sample)[:100]}")
        if url in self.copies:  # out of the copy of a damaged shard's intact members: it stands for the shard
            self._enter(self.copies[url])
            sample["__url__"] = self.shards[self.plan[self.item][0]]
            self.copied += 1
            if self.copied <= self.original:
                return False  # read out of the shard itself already, before its damage
        else:
            if url != self.shards[self.plan[self.item][0]]:
                self._enter(self._find(url))  # a new shard (any in between held no sample)
            self.original += 1
        self.read += 1
        if self.read <= self.plan[self.item][1]:
            return False  # consumed before the resume: read past it, never decoded
        self.shard, self.consumed = self.plan[self.item][0], self.read
        self.key, self.passed = sample.get("__key__"), self.passed + 1
        return True

    def _enter(self, item: int) -> None:
        if item != self.item:
            self.item, self.read, self.original, self.copied = item, 0, 0, 0

    def _find(self, url: Any) -> int:
        for item in range(self.item + 1, len(self.plan)):
            if self.shards[self.plan[item][0]] == url:
                return item
        raise ValueError(f"a sample of {url!r} came after shard {self.shards[self.plan[self.item][0]]!r}, but it is "
                         f"not one of this slot's next shards: the first stage must read the shards it is given, in "
                         f"order, and name each sample's shard in '__url__' as it was given")

    def _unreadable(self, item: int, error: Exception, damage: str = "") -> None:
        index = self.plan[item][0]
        read = self.read if item == self.item else 0  # no sample of it came out
        what = f"shard {self._name(index)!r} (after {read} of its samples) {self.where}: {_describe(error)}{damage}"
        if self.on_error == "raise":
            raise RuntimeError(f"cannot read {what}") from error
        warnings.warn(f"on_error='skip': skipped the rest of {what}", RuntimeWarning, stacklevel=2)
        self.skipped += 1
        self.shard, self.consumed = index, FINISHED  # the slot is past it: a resume does not read it again

    def _close_stream(self) -> None:
        close = getattr(self.source.get("stream"), "close", None)  # the file webdataset opened for it: left open
        if callable(close):
            close()

    def _name(self, index: int) -> str:
        return str(self.shards[index]) if index >= 0 else "?"


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text[:400]}{' ...' if len(text) > 400 else ''}"
