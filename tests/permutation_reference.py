"""A plain-Python, one-position-at-a-time reference of the sampler's order (no tensors, no vectorisation).

Written from the description in ``contrastive_dist/data/_permutation.py``: BLAKE2b round keys, an
alternating Feistel network on the smallest power of two >= length (at least 4 values), cycle
walking into range, a keyed swap of the values 0 and 1.
"""

from __future__ import annotations

import hashlib

MASK32 = 0xFFFF_FFFF


def mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB_352D) & MASK32
    x ^= x >> 15
    x = (x * 0x5851_F42D) & MASK32
    return x ^ (x >> 16)


def reference_order(length: int, seed: int, epoch: int, rounds: int = 12) -> list[int]:
    bits = max(2, (length - 1).bit_length())
    message = seed.to_bytes(8, "little", signed=True) + epoch.to_bytes(8, "little")
    digest = hashlib.blake2b(message, digest_size=4 * rounds + 1, person=b"contrastive_dist").digest()
    keys = [int.from_bytes(digest[4 * i : 4 * i + 4], "little") for i in range(rounds)]

    def encipher(value: int) -> int:
        high_bits, low_bits = (bits + 1) // 2, bits // 2
        for key in keys:
            high, low = value >> low_bits, value % (1 << low_bits)
            value = low * (1 << high_bits) + (high ^ (mix32(low ^ key) % (1 << high_bits)))
            high_bits, low_bits = low_bits, high_bits
        return value

    order = []
    for position in range(length):
        value = encipher(position)
        while value >= length:
            value = encipher(value)
        order.append(value)
    if digest[-1] & 1 and length >= 2:
        order = [1 - value if value < 2 else value for value in order]
    return order
