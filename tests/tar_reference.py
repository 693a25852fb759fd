"""Shards whose samples check themselves, damaged at random, and which of their samples are still readable.

The reference does not read the damaged file with ``tarfile`` (the code under test does): a sample
is *readable* when every byte of each of its members (the member's headers, the pax ones included,
and its contents) is where it was written and unchanged. Damage anywhere else (padding, the
end-of-archive blocks) loses nothing. ``headers`` parses a tar block by block with the format's
checksum, to tell where the member headers are in an intact shard.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

BLOCK = 512
CORRUPTIONS = ("junk", "zeros", "cut")
TARGETS = ("header", "payload", "padding", "end", "anywhere")


class Member(NamedTuple):
    """One file of a shard as written: where its first header starts, where its contents start, how long they are."""

    name: str
    start: int
    data: int
    size: int

    @property
    def key(self) -> str:
        """The sample it belongs to (webdataset's: the name up to its first dot)."""
        return self.name.split(".")[0]


def text_of(sample_id: int) -> str:
    """The ``txt`` of sample ``sample_id`` (none for every third): long enough to span blocks, and checkable."""
    return "" if sample_id % 3 == 0 else (f"{sample_id}:" + "abcdefghij" * 40)[: 17 + (sample_id * 37) % 900]


def write_shard(path: Path, first_id: int, count: int) -> list[Member]:
    """Write ``count`` samples with webdataset's writer; the members as written, from the tar's own headers."""
    import webdataset as wds

    with wds.TarWriter(str(path)) as writer:
        for sample_id in range(first_id, first_id + count):
            sample = {"__key__": f"s{sample_id:06d}", "cls": sample_id}
            if text_of(sample_id):
                sample["txt"] = text_of(sample_id)
            writer.write(sample)
    return members_of(path.read_bytes())


def checksum_ok(block: bytes) -> bool:
    """Whether ``block`` is a tar header: its checksum field is the sum of its bytes, that field counted as spaces."""
    field = block[148:156].replace(b"\0", b" ").strip()
    if not field or any(digit not in b"01234567" for digit in field):
        return False
    return int(field, 8) == sum(block[:148]) + 8 * 32 + sum(block[156:])


def members_of(data: bytes) -> list[Member]:
    """The members of an intact tar, block by block: pax / long-name headers (types x, g, L, K) join the next."""
    members, offset, first = [], 0, None
    while offset + BLOCK <= len(data) and checksum_ok(data[offset : offset + BLOCK]):
        block = data[offset : offset + BLOCK]
        size = int(block[124:136].replace(b"\0", b" ").strip() or b"0", 8)
        name = block[:100].rstrip(b"\0").decode()
        first = offset if first is None else first
        if block[156:157] not in (b"x", b"g", b"L", b"K"):
            members.append(Member(name, first, offset + BLOCK, size))
            first = None
        offset += BLOCK + -(-size // BLOCK) * BLOCK
    return members


def intact(original: bytes, damaged: bytes, member: Member) -> bool:
    """Whether every byte of ``member`` (its headers and contents) is unchanged in ``damaged``."""
    return damaged[member.start : member.data + member.size] == original[member.start : member.data + member.size]


def readable_keys(original: bytes, damaged: bytes, members: list[Member]) -> set[str]:
    """The keys of the samples all of whose members are intact in ``damaged``."""
    broken = {member.key for member in members if not intact(original, damaged, member)}
    return {member.key for member in members} - broken


def damage(original: bytes, members: list[Member], rng: random.Random) -> tuple[bytes, list[str]]:
    """1-3 random corruptions (junk, zeros, a cut) aimed at headers, contents, padding, the end or anywhere."""
    data, done = bytearray(original), []
    for _ in range(rng.randint(1, 3)):
        kind, target = rng.choice(CORRUPTIONS), rng.choice(TARGETS)
        member = rng.choice(members)
        if target == "header":
            start = member.data - BLOCK + rng.randrange(BLOCK) if rng.random() < 0.5 else member.start
        elif target == "payload":
            start = member.data + rng.randrange(max(1, member.size))
        elif target == "padding":
            start = member.data + member.size + rng.randrange(max(1, -member.size % BLOCK))
        elif target == "end":
            start = members[-1].data + members[-1].size + rng.randrange(3 * BLOCK)
        else:
            start = rng.randrange(len(data))
        start = min(start, len(data) - 1)
        length = rng.choice((1, 8, 100, BLOCK, 3 * BLOCK)) if kind != "cut" else 0
        if kind == "cut":
            del data[start:]
        else:
            stop = min(len(data), start + length)
            data[start:stop] = bytes(stop - start) if kind == "zeros" else rng.randbytes(stop - start)
        done.append(f"{kind} {target} at {start}+{length}")
        if len(data) < BLOCK:
            break
    return bytes(data), done
