"""Drop-last-free loading and exact mid-epoch resume for a Lightning ``LightningModule`` or ``LightningDataModule``.

Two functions, nothing to subclass:

* :func:`distributed_loader` builds, when Lightning asks for a loader, a torchdata
  ``StatefulDataLoader`` over a :class:`~contrastive_dist.DistributedBatchSampler` (rank and world
  size from the trainer) with an :class:`~contrastive_dist.EmptySafeCollate`. Every sample is seen
  exactly once per epoch, every rank runs the same number of steps, and Lightning's ``set_epoch``
  calls reach the sampler, so each epoch has a new order. The loader has ``state_dict`` /
  ``load_state_dict``, which Lightning saves in every checkpoint and restores on
  ``trainer.fit(..., ckpt_path=...)``: a run resumed from a mid-epoch checkpoint continues with the
  very next global batch, with or without worker processes (the loader accounts for their prefetching).
* :func:`step_sizes` gives the per-rank batch sizes of the current training step, to pass to a
  loss as ``sizes=`` so that it skips its size exchange.

Pass ``Trainer(use_distributed_sampler=False)``: left on, Lightning would rebuild the loader around
its own ``DistributedSampler``; :func:`distributed_loader` raises a ``ValueError`` that says so.
The ``training_step`` must return a loss connected to the parameters on a rank whose batch is
empty (the losses of this package do); returning ``None`` there makes that rank skip the backward
and the other ranks wait for it forever.

Lightning, torchdata and this module are imported only when used: ``import contrastive_dist``
imports none of them.

Example:
    >>> import torch
    >>> dataset = [(torch.full((3,), float(i)), i) for i in range(5)]
    >>> loader = distributed_loader(dataset, None, batch_size=2, shuffle=False)   # no trainer: one process
    >>> [ids.tolist() for _, ids in loader]
    [[0, 1], [2, 3], [4]]
    >>> loader.batch_sampler.sizes(2)
    (1,)

"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils.data import default_collate

from contrastive_dist.collate import EmptySafeCollate
from contrastive_dist.sampler import DistributedBatchSampler

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = ["distributed_loader", "step_sizes"]


def _rebuilds_loaders(trainer: Any) -> bool:
    # Lightning keeps the flag on its accelerator connector; a trainer-like object without one
    # (or a future Lightning that moved it) is given the benefit of the doubt.
    connector = getattr(trainer, "_accelerator_connector", None)
    return bool(getattr(connector, "use_distributed_sampler", False)) and trainer.world_size > 1


def distributed_loader(
    dataset: Any,
    trainer: Any | None,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] = default_collate,
    num_workers: int = 0,
    **loader_options: Any,
) -> StatefulDataLoader:
    """A resumable, drop-last-free ``DataLoader`` for this rank, for ``*_dataloader()`` hooks.

    Call it from ``train_dataloader()`` / ``val_dataloader()`` (the trainer knows its rank and
    world size by then): ``return distributed_loader(self.train_set, self.trainer, batch_size=64)``.

    Args:
        dataset: a map-style dataset (``len()`` and ``dataset[i]``) with at least one sample.
        trainer: the ``lightning.Trainer`` (rank and world size are read from it), or ``None``
            to read them from the default process group (one process without one).
        batch_size: samples per rank per step; a step's global batch is ``batch_size × world size``.
        shuffle: a new order each epoch (training); ``False`` splits the natural order across the
            ranks with nothing repeated or dropped (exact evaluation).
        seed: the base seed of the order; the same on every rank.
        collate_fn: collates a non-empty list of samples; an empty rank's batch is derived from it.
        num_workers: DataLoader worker processes; they persist across epochs when there are any.
        **loader_options: any other ``StatefulDataLoader`` option (``pin_memory``, ``prefetch_factor``, ...).

    Returns:
        A ``torchdata.stateful_dataloader.StatefulDataLoader`` whose ``batch_sampler`` is the
        :class:`~contrastive_dist.DistributedBatchSampler`.

    Raises:
        ValueError: the trainer would replace the sampler (``use_distributed_sampler=True`` under DDP).
        TypeError: ``dataset`` has no ``len()``, or an option has the wrong type.

    Shape:
        - each batch: ``collate_fn`` of ``step_sizes(trainer, step)[rank]`` samples (possibly 0).

    """
    from torchdata.stateful_dataloader import StatefulDataLoader

    for name in ("batch_sampler", "sampler", "batch_size", "shuffle", "drop_last"):
        if name in loader_options:
            raise TypeError(f"distributed_loader sets {name!r} itself; got it in loader_options")
    if trainer is not None and _rebuilds_loaders(trainer):
        raise ValueError(
            "this Trainer was built with use_distributed_sampler=True, so Lightning would replace the "
            "drop-last-free sampler of distributed_loader with its own; pass "
            "Trainer(..., use_distributed_sampler=False)"
        )
    try:
        length = len(dataset)
    except TypeError as error:
        raise TypeError(f"dataset must be map-style with len(), got {type(dataset).__name__}") from error
    placement = {} if trainer is None else {"num_replicas": trainer.world_size, "rank": trainer.global_rank}
    sampler = DistributedBatchSampler(length, batch_size, shuffle=shuffle, seed=seed, **placement)
    loader_options.setdefault("persistent_workers", num_workers > 0)
    with warnings.catch_warnings():
        # torchdata 0.11 calls a torch function that torch >= 2.9 deprecates: noise for the user.
        warnings.filterwarnings("ignore", message=".*set_vital.*")
        return StatefulDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=EmptySafeCollate(dataset, collate_fn),
            num_workers=num_workers,
            **loader_options,
        )


def step_sizes(trainer: Any, batch_idx: int) -> tuple[int, ...]:
    """The per-rank batch sizes of training step ``batch_idx``; the same tuple on every rank.

    ``batch_idx`` is the one Lightning passes to ``training_step``; it counts steps within the
    epoch and continues where a resumed checkpoint left off, as the loader does. Pass the result to
    a loss as ``sizes=`` to skip its size exchange.

    Args:
        trainer: a ``lightning.Trainer`` whose training loader came from :func:`distributed_loader`
            (or has a :class:`~contrastive_dist.DistributedBatchSampler` as ``batch_sampler``).
        batch_idx: the step within the current epoch.

    Raises:
        TypeError: the training loader has no :class:`~contrastive_dist.DistributedBatchSampler`.
        ValueError: ``batch_idx`` is not a step of the epoch.

    """
    loader = trainer.train_dataloader
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, DistributedBatchSampler):
        raise TypeError(
            "step_sizes needs a training loader built by distributed_loader (a DistributedBatchSampler as "
            f"batch_sampler); the trainer's train_dataloader is a {type(loader).__name__} with batch_sampler "
            f"{type(sampler).__name__}"
        )
    return sampler.sizes(batch_idx)
