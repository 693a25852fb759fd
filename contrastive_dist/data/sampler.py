"""Drop-last-free distributed batch sampler: every sample exactly once per epoch, equal step counts.

``torch.utils.data.DistributedSampler`` either pads the last batch by repeating samples (in a
contrastive batch a repeated sample is a false negative of itself) or drops them
(``drop_last=True``). Giving ranks different *numbers* of batches instead deadlocks DDP, whose
backward waits for every rank. :class:`DistributedBatchSampler` does neither: it draws one global
permutation per epoch, cuts it into global batches of ``batch_size * num_replicas`` samples and
splits each global batch across ranks as evenly as possible. Every rank runs the same number of
steps; only the last step's per-rank sizes differ (some may be 0, which the losses of this
package and :class:`~contrastive_dist.EmptySafeCollate` handle).

Use it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))``, call
``sampler.set_epoch(epoch)`` each epoch, and pass ``sampler.sizes(step)`` to a loss as ``sizes=`` (the
torchrun guide, ``docs/guides/torchrun.md``, has a whole loop); under Lightning,
``contrastive_dist.lightning.distributed_loader`` builds that loader, and Lightning's ``set_epoch``
reaches the sampler (``loader.batch_sampler.sampler`` is the sampler itself).

Order: each epoch's order is a seeded bijection of ``[0, length)`` evaluated only at the positions a
batch needs (:mod:`contrastive_dist.data._permutation`: a Feistel network with cycle walking), so the first
batch of a 2·10⁹-sample dataset comes in milliseconds and no permutation is ever held in memory.
Earlier versions drew ``torch.randperm(length)`` seeded with ``seed + epoch``: the same seed now
gives a different order (every guarantee above is unchanged).

Evaluation: ``shuffle=False`` splits a validation set across ranks in natural order with no
sample repeated or dropped, so sums and counts reduced over ranks give exact metrics.

Resuming, on the same layout or another: the state says how many samples of the epoch's order are
consumed, not by which rank, so it loads into another ``num_replicas`` and/or ``batch_size``: the rest
of the order is cut into the new global batches. With the same global batch size (2 ranks × 64 →
4 × 32) they are the uninterrupted run's, so with exact losses the run does not depend on the number
of ranks. Another length, seed or ``shuffle`` is refused. Ranks that loaded different states (or
some none) raise the same ``ValueError`` at the first batch, before any step runs. Workers prefetch,
so a loop saves the steps it *finished* (``state_dict(step=...)``); ``distributed_loader``'s loader does it itself.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import Sampler

from contrastive_dist._dist import GroupLike, get_rank, get_world_size, is_distributed
from contrastive_dist.data._epoch_grid import EpochGrid
from contrastive_dist.data._permutation import Permutation
from contrastive_dist.data._sampler_state import EpochPosition, agree_on_start, decode_position, encode_position

__all__ = ["DistributedBatchSampler"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum} (a signed 64-bit int), got {value}")
    return value


class DistributedBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices for one rank; every index exactly once per epoch over all ranks.

    Pass it to ``DataLoader(dataset, batch_sampler=sampler)``. The order of epoch ``e`` is a random
    bijection of ``[0, length)`` keyed by ``(seed, e)`` and computed per position, in constant
    memory, so every rank computes the same one without communicating. Step ``s`` takes the global
    batch ``order[s*G : (s+1)*G]`` with ``G = batch_size * num_replicas`` and gives rank ``r`` its
    ``r``-th share; shares differ by at most one sample and the first ranks get the extra ones. A
    fresh ``iter()`` starts a full epoch, unless :meth:`load_state_dict` was called just before
    (then it continues the saved epoch, cut into this sampler's global batches).

    Args:
        data_source_or_length: the dataset (anything with ``len()``) or its length.
        batch_size: samples per rank per step (a rank gets fewer only in the last step).
        num_replicas: number of ranks (default: the size of ``group``, 1 without a process group).
        rank: this rank (default: the rank in ``group``, 0 without a process group).
        shuffle: a new random order each epoch; ``False`` keeps the natural order (evaluation).
        seed: seed of the order, any signed 64-bit int; must be the same on every rank.
        group: the data-parallel ranks the defaults are read from, a process group or a device mesh
            ([group][option-group]; under a data × tensor parallel mesh ``mesh["dp"]``: the
            tensor-parallel ranks of a data-parallel rank get the same batches). A sampler that is
            this rank's share of it (the defaults, or the same ``num_replicas`` and ``rank``) checks,
            at the first batch of each epoch, that every rank starts the epoch at the same step of
            the same order: else every rank raises the same ``ValueError`` (so every rank must
            iterate it, as a ``DataLoader`` on every rank does).

    Shape:
        - each batch: a list of ``sizes(step)[rank]`` ints, ``0 <= size <= batch_size``.

    Example:
        >>> sampler = DistributedBatchSampler(10, batch_size=2, num_replicas=3, rank=0, shuffle=False)
        >>> len(sampler), [sampler.sizes(step) for step in range(len(sampler))]
        (2, [(2, 2, 2), (2, 1, 1)])
        >>> list(sampler)
        [[0, 1], [6, 7]]
        >>> [list(DistributedBatchSampler(10, 2, num_replicas=3, rank=r, shuffle=False)) for r in (1, 2)]
        [[[2, 3], [8]], [[4, 5], [9]]]
        >>> sampler = DistributedBatchSampler(10, batch_size=2, num_replicas=3, rank=0, seed=1)
        >>> sampler.set_epoch(3)
        >>> batches = iter(sampler)
        >>> first = next(batches)
        >>> state = sampler.state_dict()      # one step of 6 samples done: resume from here
        >>> state["epoch"], state["step"], state["consumed"]
        (3, 1, 6)
        >>> resumed = DistributedBatchSampler(10, batch_size=2, num_replicas=3, rank=0, seed=1)
        >>> resumed.load_state_dict(state)
        >>> list(resumed) == list(batches)
        True
        >>> alone = DistributedBatchSampler(10, batch_size=4, num_replicas=1, rank=0, seed=1)
        >>> alone.load_state_dict(state)      # the rest of the epoch on 1 rank: 4 samples, in one step
        >>> len(alone), alone.sizes(1)
        (2, (4,))

    """

    def __init__(
        self,
        data_source_or_length: Sized | int,
        batch_size: int,
        *,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        group: GroupLike = None,
    ) -> None:
        if isinstance(data_source_or_length, int) and not isinstance(data_source_or_length, bool):
            length = data_source_or_length
        elif isinstance(data_source_or_length, Sized):
            length = len(data_source_or_length)
        else:
            raise TypeError(
                "data_source_or_length must be a dataset with len() or an int, "
                f"got {type(data_source_or_length).__name__}"
            )
        if length < 1:
            raise ValueError(f"the dataset must hold at least one sample, got length {length}")
        if length > 2**62:
            raise ValueError(f"the dataset length must be at most 2**62, got {length}")
        self.length = length
        self.batch_size = _int("batch_size", batch_size, 1)
        self.num_replicas = _int("num_replicas", get_world_size(group) if num_replicas is None else num_replicas, 1)
        self.rank = _int("rank", get_rank(group) if rank is None else rank, 0)
        if self.rank >= self.num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas={self.num_replicas}), got {self.rank}")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {type(shuffle).__name__}")
        self.shuffle = shuffle
        self.seed = _int("seed", seed, _INT64_MIN, _INT64_MAX)
        self.group = group
        self.epoch = 0
        self._restart()

    def _restart(self) -> None:
        """Plan a fresh epoch: step ``s`` takes positions ``[s*G, (s+1)*G)`` of the order."""
        # A state saved on another global batch size resumes off this grid, at its own (step, position).
        self._grid = EpochGrid(self.length, self.batch_size, self.num_replicas)
        # The step the next iteration starts at, and the steps of the epoch handed out by the latest iterator.
        # Every fresh iteration resets them, so that a loader that stopped after len() batches (without
        # exhausting us) still gets a full next epoch.
        self._start = 0
        self._step = 0
        # A loaded state waits for the next iter(), which continues it instead of restarting.
        self._pending = False

    @property
    def global_batch_size(self) -> int:
        """Samples per step over all ranks (the last step may hold fewer)."""
        return self._grid.global_batch_size

    @property
    def sampler(self) -> DistributedBatchSampler:
        """Return ``self``, because Lightning calls ``loader.batch_sampler.sampler.set_epoch(epoch)``."""
        return self

    @property
    def first_step(self) -> int:
        """The first step of the current iteration (once it yielded a batch), or of the next: 0 or a loaded step."""
        return self._start

    def __len__(self) -> int:
        """Steps of the current epoch; a resumed epoch counts those done before the resume too."""
        return self._grid.steps()

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` from the next iteration on (read at its first batch).

        A state loaded by :meth:`load_state_dict` for another epoch is discarded: the caller has
        moved on. Setting the loaded epoch again keeps it.
        """
        _int("epoch", epoch, 0, _INT64_MAX)
        if epoch != self.epoch:
            self._restart()
        self.epoch = epoch

    def sizes(self, step: int) -> tuple[int, ...]:
        """Return the number of samples each rank gets at ``step``; the same on every rank.

        Pass it as ``all_gather(x, sizes=sampler.sizes(step))`` to skip the size exchange. In an
        epoch resumed on another global batch size, the steps before the resume are not known.
        """
        return self._grid.sizes(step)

    def __iter__(self) -> Iterator[list[int]]:
        if not self._pending:
            self._restart()  # now too, so that state_dict() right after iter() is the fresh epoch's
        return self._batches()

    def _batches(self) -> Iterator[list[int]]:
        # Everything is decided at the first next(), not at iter(): a DataLoader with workers calls iter()
        # twice before it asks for a batch, and Lightning calls iter() before set_epoch() when it resumes
        # a run (a set_epoch() to another epoch drops a loaded state). A loaded state is used once.
        if not self._pending:
            self._restart()
        self._pending = False
        if self._spans_group():  # ranks that start elsewhere would run misaligned steps: the same error on each
            agree_on_start(EpochPosition(self.epoch, self._start, min(self._grid.position(self._start), self.length)),
                           seed=self.seed,
                           length=self.length, shuffle=self.shuffle, batch_size=self.batch_size,
                           num_replicas=self.num_replicas, group=self.group)
        order = Permutation(self.length, self.seed, self.epoch) if self.shuffle else None
        step = self._start
        self._step = step
        while step < len(self):
            for batch in self._grid.rows(order, step, self.rank):
                # Counted before the yield: once the caller holds batch `step`, `step + 1` are done.
                step += 1
                self._step = step
                yield batch

    def _spans_group(self) -> bool:
        """Whether this sampler is this rank's share of ``group`` (then its epochs start collectively)."""
        group = self.group
        return is_distributed(group) and (self.num_replicas, self.rank) == (get_world_size(group), get_rank(group))

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """Where the epoch stands once ``step`` of its steps are done (default: the batches handed out).

        The state holds the epoch, the steps done and the samples of the epoch's order they took
        (``consumed``), and what fixes the order (``seed``, ``length``, ``shuffle``); ``batch_size``
        and ``num_replicas`` only record the layout that saved it. It holds no rank: ranks in step
        save the same dict, and any layout can load it. A loop whose loader has worker processes
        passes the steps it finished, because the workers have asked for more batches than that.
        """
        if step is None:
            step = self._step
        elif isinstance(step, bool) or not isinstance(step, int) or not self._grid.first_step <= step <= len(self):
            raise ValueError(f"step must be an int in [{self._grid.first_step}, {len(self)}], got {step!r}")
        position = EpochPosition(self.epoch, step, min(self._grid.position(step), self.length))
        return encode_position(position, seed=self.seed, length=self.length, shuffle=self.shuffle,
                               batch_size=self.batch_size, num_replicas=self.num_replicas)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved epoch on the next ``iter()``, cut into this sampler's global batches.

        Raises:
            ValueError: the state belongs to another order (dataset length, seed, ``shuffle``), or is
                not one :meth:`state_dict` made; the message says what differs.
        """
        position = decode_position(state_dict, seed=self.seed, length=self.length, shuffle=self.shuffle)
        self._restart()
        self.epoch = position.epoch
        self._grid, self._start = self._grid.resume(position)
        self._step = self._start
        self._pending = True
