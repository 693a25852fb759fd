"""The saved position of a :class:`~contrastive_dist.DistributedBatchSampler`, in terms of no layout.

A position says how far the epoch's order has been consumed (``consumed`` samples, over ``step``
steps whatever their layout), not which rank did what, so it loads into a sampler with another
number of ranks or another batch size. What it cannot survive is another order: another dataset
length, seed or ``shuffle``; :func:`decode_position` refuses those, and states that are not ones
:func:`encode_position` made, with a message that says what differs.

Every rank must start an epoch at the same position of the same order, or their steps no longer
line up (a rank that loaded another state runs on a step ahead or behind, across the epoch's end,
until one rank exits): :func:`agree_on_start` checks it in one small exchange as each epoch starts
(the package's agreement), and every rank raises the same ``ValueError`` naming each rank's start.

Version 1 (before the layout-free state) saved ``step`` and its layout (``batch_size``,
``num_replicas``) instead of ``consumed``; it still loads: ``consumed = step × batch_size ×
num_replicas`` (at most the length).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contrastive_dist._dist import GroupLike
from contrastive_dist.engine._agreement import agree

__all__ = ["EpochPosition", "agree_on_start", "decode_position", "encode_position"]

FORMAT = "contrastive_dist.DistributedBatchSampler"
VERSION = 2
_INT64_MAX = 2**63 - 1
_VERSION_1_KEYS = ("epoch", "step", "seed", "length", "batch_size", "num_replicas", "shuffle")
_KEYS = ("format", "version", "epoch", "step", "consumed", "seed", "length", "shuffle")


@dataclass(frozen=True)
class EpochPosition:
    """Where an epoch stands: ``step`` steps done, which took the first ``consumed`` samples of its order."""

    epoch: int
    step: int
    consumed: int


def encode_position(
    position: EpochPosition, *, seed: int, length: int, shuffle: bool, batch_size: int, num_replicas: int
) -> dict[str, Any]:
    """The state dict of ``position``; ``batch_size`` and ``num_replicas`` only record the saving layout."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "epoch": position.epoch,
        "step": position.step,
        "consumed": position.consumed,
        "seed": seed,
        "length": length,
        "shuffle": shuffle,
        "batch_size": batch_size,
        "num_replicas": num_replicas,
    }


def _integer(state: Mapping[str, Any], key: str, low: int, high: int) -> int:
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"cannot resume: the state's {key!r} must be an int in [{low}, {high}], got {value!r}")
    return value


def decode_position(state: object, *, seed: int, length: int, shuffle: bool) -> EpochPosition:
    """Check ``state`` against the sampler's order and return its position; ``ValueError`` says what is wrong."""
    if not isinstance(state, Mapping):
        raise ValueError(f"cannot resume: expected a dict made by DistributedBatchSampler.state_dict(), got "
                         f"{type(state).__name__}")
    version_1 = "version" not in state and all(key in state for key in _VERSION_1_KEYS)
    missing = [key for key in (_VERSION_1_KEYS if version_1 else _KEYS) if key not in state]
    if missing:
        raise ValueError(f"cannot resume: the state lacks {missing}; expected a dict made by "
                         f"DistributedBatchSampler.state_dict(), got the keys {sorted(map(str, state))}")
    if not version_1 and (state["format"] != FORMAT or state["version"] != VERSION):
        raise ValueError(f"cannot resume: expected a state of format {FORMAT!r} version {VERSION}, got "
                         f"{state['format']!r} version {state['version']!r}")
    saved_length = _integer(state, "length", 1, 2**62)
    if saved_length != length:
        raise ValueError(f"cannot resume: the state was saved for a dataset of {saved_length} samples, this "
                         f"sampler has {length}; its order and progress belong to another dataset")
    saved_seed = _integer(state, "seed", -(2**63), _INT64_MAX)
    if saved_seed != seed:
        raise ValueError(f"cannot resume: the state was saved with seed={saved_seed}, this sampler has seed={seed}; "
                         f"the rest of its epoch would repeat some samples and skip others: pass seed={saved_seed}")
    if not isinstance(state["shuffle"], bool) or state["shuffle"] != shuffle:
        raise ValueError(f"cannot resume: the state was saved with shuffle={state['shuffle']!r}, this sampler has "
                         f"shuffle={shuffle}; the orders differ")
    epoch = _integer(state, "epoch", 0, _INT64_MAX)
    if version_1:
        global_batch = _integer(state, "batch_size", 1, _INT64_MAX) * _integer(state, "num_replicas", 1, _INT64_MAX)
        step = _integer(state, "step", 0, -(-length // global_batch))
        return EpochPosition(epoch, step, min(step * global_batch, length))
    consumed = _integer(state, "consumed", 0, length)
    # Every step takes at least one sample, and only a step takes any.
    step = _integer(state, "step", 1 if consumed else 0, consumed)
    return EpochPosition(epoch, step, consumed)


def agree_on_start(position: EpochPosition, *, seed: int, length: int, shuffle: bool, batch_size: int,
                   num_replicas: int, group: GroupLike) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless they all start the epoch at ``position``.

    Every rank calls it as its sampler's epoch starts; the order (``seed``, ``length``,
    ``shuffle``) and the layout (``batch_size``, ``num_replicas``) must match too.
    """
    start = {"epoch": position.epoch, "step": position.step, "consumed": position.consumed, "seed": seed,
             "length": length, "shuffle": shuffle, "batch_size": batch_size, "num_replicas": num_replicas}
    agree([], problem=None, group=group, rows=0, compare_inputs=False, options=start,
          operation="DistributedBatchSampler: every rank must start the epoch at the same step of the same order "
                    "(load the same state_dict on every rank, or none, and set the same epoch)")
