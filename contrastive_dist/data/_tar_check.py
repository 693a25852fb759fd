"""Where a tar shard is damaged, found from its own headers, and the readable rest of it.

Python's ``tarfile`` (so webdataset) reads a tar as complete when a header in the middle is
invalid, zeroed or cut: it stops there without a word. :func:`inspect_tar` reads a local tar's
headers with ``tarfile`` itself (never its contents), notes where it stopped, and asks for what a
complete tar holds there: two or more zero blocks, to the end of the file (a whole number of
blocks), and no more zeros than the end-of-archive blocks and the padding to tar's record of
10240 bytes (:data:`MAX_END`, what ``tarfile``, GNU tar and bsdtar write): a longer run of zeros is
members zeroed (a file whose second half was lost to zeros), not the end.
Wherever the chain breaks before that, the shard is *damaged* there; the walk goes on at the next
512-byte block that is a valid header (tar members start on 512-byte boundaries), so that the
members after the damage are found too. :func:`write_members` writes those intact members as one
tar, which a first stage can read in place of the shard; :func:`check_stream_rest` asks the same
of a streamed shard: what is left of its stream once the reader stopped must be zeros. A member's
span starts at its first header, extended ones (pax, GNU long names) included: a valid header
(its checksum right) found by the scan is read with whatever of it follows.
"""

from __future__ import annotations

import os
import tarfile
from typing import IO, Any, NamedTuple

__all__ = ["BLOCK", "MAX_END", "Damage", "TarLayout", "check_stream_rest", "end_problem", "inspect_tar", "local_tar",
           "write_members", "zeros_from"]

BLOCK = 512
RECORD = 20 * BLOCK
"""Tar's record: a tar written by ``tarfile``, GNU tar or bsdtar is padded with zeros to a whole number of them."""
MAX_END = 2 * BLOCK + RECORD - BLOCK
"""The most zeros a complete tar ends with: its two end-of-archive blocks and the padding to the next record."""
_CHUNK = 1 << 16
_ZEROS = bytes(BLOCK)


class Damage(NamedTuple):
    """Bytes of a shard no reader gets past: at ``offset``, for ``reason``; readable again at ``resync`` (or never)."""

    offset: int
    reason: str
    resync: int | None

    def describe(self) -> str:
        """One line: where, what, and where reading went on."""
        after = f"; the next valid header is at byte {self.resync}" if self.resync is not None else ""
        return f"at byte {self.offset}: {self.reason}{after}"


class TarLayout(NamedTuple):
    """A local tar's intact members as ``(start, end)`` byte spans (its extension headers included), its damages."""

    size: int
    members: list[tuple[int, int]]
    damages: list[Damage]

    def read_on(self) -> list[tuple[int, int]]:
        """The intact members to read a damaged tar on from: all of them, if any lies after its first damage."""
        first = self.damages[0].offset
        return self.members if any(start > first for start, _ in self.members) else []


def local_tar(shard: Any) -> str | None:
    """The path of ``shard`` if it is a local, uncompressed ``.tar`` file; else None."""
    path = os.fspath(shard) if isinstance(shard, (str, os.PathLike)) else None
    return path if path is not None and path.endswith(".tar") and os.path.isfile(path) else None


def inspect_tar(path: str) -> TarLayout:
    """Walk the headers of the tar at ``path``: its intact members and where it is damaged (none: complete).

    Example:
        >>> import io, tarfile, tempfile
        >>> with tempfile.NamedTemporaryFile(suffix=".tar") as file:
        ...     with tarfile.open(fileobj=file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        ...         for name in ("a.txt", "b.txt", "c.txt"):
        ...             info = tarfile.TarInfo(name)
        ...             info.size = 3
        ...             tar.addfile(info, io.BytesIO(b"abc"))
        ...     _ = file.seek(1024); _ = file.write(bytes(512)); _ = file.flush()   # zero the second header
        ...     layout = inspect_tar(file.name)
        >>> layout.members
        [(0, 1024), (2048, 3072)]
        >>> layout.damages
        [Damage(offset=1024, reason='a zero block (the end of a tar) with data after it', resync=2048)]

    """
    size = os.path.getsize(path)
    members: list[tuple[int, int]] = []
    damages: list[Damage] = []
    with open(path, "rb") as file:
        start = 0
        while True:
            stop, reason = _read_chain(file, start, size, members)
            if reason is None:
                reason = _why_it_stopped(file, stop, size)
                if reason is None:
                    return TarLayout(size, members, damages)
            resync = _next_header(file, stop + BLOCK, size)
            damages.append(Damage(stop, reason, resync))
            if resync is None:
                return TarLayout(size, members, damages)
            start = resync


def _read_chain(file: IO[bytes], start: int, size: int, members: list[tuple[int, int]]) -> tuple[int, str | None]:
    """Read members from ``start`` on with ``tarfile`` itself, into ``members``: where it stopped, and why if it raised.

    ``tarfile`` is the judge of what it reads: the members it returns are the ones a first stage
    built on it reads, and where it stops silently is where such a stage ends the shard.
    """
    file.seek(start)
    try:
        archive = tarfile.open(fileobj=file, mode="r:")
    except Exception as error:  # noqa: BLE001 - anything tarfile raises on the header at start: damage there
        return start, _error(error)
    try:
        while (info := archive.next()) is not None:
            end = info.offset_data + -(-info.size // BLOCK) * BLOCK
            if info.offset_data + info.size > size:
                return info.offset, f"member {info.name!r} of {info.size} bytes runs past the end of the file ({size})"
            members.append((info.offset, end))
            archive.members.clear()  # type: ignore[attr-defined]  # one member at a time: a shard may hold millions
    except Exception as error:  # noqa: BLE001 - as above, for a later header
        return archive.offset, _error(error)
    return archive.offset, None


def _why_it_stopped(file: IO[bytes], offset: int, size: int) -> str | None:
    """Why ``tarfile`` stopped without a word at ``offset``: None at a complete tar's end (zeros to the end)."""
    if offset >= size:
        return "the file ends without tar's end-of-archive blocks (cut short)"
    file.seek(offset)
    block = file.read(BLOCK)
    if block == _ZEROS:
        if not zeros_from(file, offset, size):
            return "a zero block (the end of a tar) with data after it"
        if size % BLOCK or size - offset < 2 * BLOCK:  # a tar is whole blocks, and ends with two zero blocks
            return f"the file ends inside tar's end-of-archive blocks ({size} bytes): cut short"
        problem = end_problem(size - offset)
        return None if problem is None else f"{size - offset} bytes of zeros to the end of the file, {problem}"
    if len(block) < BLOCK:
        return f"the file ends inside a tar header ({size} bytes)"
    try:
        tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError as error:
        return f"not a valid tar header ({_error(error)})"
    return "a header whose extended header cannot be read"


def end_problem(zeros: int) -> str | None:
    """What is wrong with ``zeros`` zero bytes at the end of a tar, after its last member: None if nothing."""
    if zeros <= MAX_END:
        return None
    return (f"more than a complete tar ends with (its end-of-archive blocks and the padding to a record: at most "
            f"{MAX_END} bytes): the members there were zeroed")


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def zeros_from(file: IO[bytes], offset: int, size: int) -> bool:
    """Whether ``file`` holds only zeros from ``offset`` to ``size``."""
    file.seek(offset)
    while offset < size:
        chunk = file.read(min(_CHUNK, size - offset))
        if not chunk or chunk.count(0) != len(chunk):
            return not chunk
        offset += len(chunk)
    return True


def _next_header(file: IO[bytes], offset: int, size: int) -> int | None:
    """The first 512-byte-aligned block at or after ``offset`` that is a valid, complete tar header; None if none."""
    while offset < size:
        file.seek(offset)
        chunk = file.read(min(_CHUNK, size - offset))
        for start in range(0, len(chunk) - BLOCK + 1, BLOCK):
            # A valid header's checksum field holds octal digits, spaces or NULs: a cheap test before parsing.
            field = chunk[start + 148 : start + 156]
            if field.strip(b" \0").isdigit() and _valid_header(chunk[start : start + BLOCK], offset + start, size):
                return offset + start
        if len(chunk) < BLOCK:
            return None
        offset += len(chunk) - len(chunk) % BLOCK
    return None


def _valid_header(block: bytes, offset: int, size: int) -> bool:
    """Whether ``block`` is a tar header (its checksum right) whose member fits in the file."""
    try:
        info = tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
    except tarfile.HeaderError:
        return False
    return offset + BLOCK + info.size <= size


def write_members(path: str, members: list[tuple[int, int]], target: IO[bytes]) -> None:
    """Write the spans ``members`` of the tar at ``path`` to ``target``, then tar's two end-of-archive blocks."""
    with open(path, "rb") as file:
        for start, end in members:
            file.seek(start)
            left = end - start
            while left:
                chunk = file.read(min(_CHUNK, left)) or bytes(left)  # a cut in the last padding: zeros, as it was
                target.write(chunk)
                left -= len(chunk)
    target.write(bytes(2 * BLOCK))


def check_stream_rest(stream: Any) -> str | None:
    """Read what is left of a shard's stream after its reader stopped: None if only zeros, else what was there."""
    read = getattr(stream, "read", None)
    if not callable(read):
        return None
    try:
        where = stream.tell()
    except (AttributeError, OSError, ValueError):
        where = None
    left, first = 0, None
    try:
        while True:
            chunk = read(_CHUNK)
            if not chunk:
                break
            if first is None and chunk.count(0) != len(chunk):
                first = left + len(chunk) - len(chunk.lstrip(b"\0"))
            left += len(chunk)
    except (OSError, ValueError):  # closed, or not readable any more: nothing to tell
        return None
    if first is None:  # zeros only: the end, unless more than a complete tar ends with
        problem = end_problem(left)
        return None if problem is None else f"where the reader stopped: the {left} bytes left are zeros, {problem}"
    at = f"at byte {where + first} of the stream" if where is not None else f"{first} bytes after where it stopped"
    return (f"{at}: the reader stopped with {left} bytes of the stream unread that are not tar's zero blocks (a "
            "header there is invalid or zeroed, so tarfile ended the shard early)")
