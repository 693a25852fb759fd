"""Drop-last-free loading and exact mid-epoch resume for a Lightning ``LightningModule`` or ``LightningDataModule``.

Three functions, nothing to subclass:

* :func:`distributed_loader` builds, when Lightning asks for a loader, a ``DataLoader`` over a
  :class:`~contrastive_dist.DistributedBatchSampler` (rank and world size from the trainer) with an
  :class:`~contrastive_dist.EmptySafeCollate`. Every sample is seen exactly once per epoch, every
  rank runs the same number of steps, and Lightning's ``set_epoch`` calls reach the sampler, so each
  epoch has a new order. The loader has ``state_dict`` / ``load_state_dict`` (the sampler's position
  after the batches the loader *yielded*, whatever its workers prefetched), which Lightning saves in
  every checkpoint and restores on ``trainer.fit(..., ckpt_path=...)``: a run resumed from a
  mid-epoch checkpoint continues with the very next global batch, on any number of devices or
  workers (keep the global batch size: Lightning fixes the steps of an epoch for a whole ``fit``).
* :func:`streaming_loader` does the same for sharded streams (webdataset tar shards, say): each
  rank and DataLoader worker reads its own shards (:class:`~contrastive_dist.DistributedShardList`)
  and a rank that runs out yields empty batches until every rank has
  (:class:`~contrastive_dist.DistributedStreamingBatches`), so uneven shards never hang DDP. Its
  state is every shard's progress (untouched, finished, or samples consumed), the same on every
  rank: a mid-epoch checkpoint resumes with exactly the samples not yet consumed, on any number of
  devices or workers, reading past the consumed part of a shard without decoding it.
* :func:`step_sizes` gives the per-rank batch sizes of the current training step, for either
  loader, to pass to a loss as ``sizes=`` so that it skips its size exchange: the training step is
  the same for map-style and streamed data.

Under ``ModelParallelStrategy`` (and any strategy with a device mesh) the loaders split the data over
the mesh's data-parallel ranks only, so that the tensor-parallel ranks of a data-parallel rank get the
same batches, and make that part of the mesh the package's default group
(:func:`~contrastive_dist.set_default_group`): a loss, SyncBatchNorm, queue or gradient cache called
without ``group=`` gathers over it (:func:`data_parallel_group`; [scale out][scale-out]). DDP and
``FSDPStrategy`` use the world.

Pass ``Trainer(use_distributed_sampler=False)``: left on, Lightning would rebuild the loader around
its own ``DistributedSampler``; :func:`distributed_loader` raises a ``ValueError`` that says so.
The ``training_step`` must return a loss connected to the parameters on a rank whose batch is
empty (the losses of this package do); returning ``None`` there makes that rank skip the backward
and the other ranks wait for it forever.

Lightning and this module are imported only when used: ``import contrastive_dist`` imports
neither (nor webdataset, whose stages the user passes to :func:`streaming_loader`).

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

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, default_collate

from contrastive_dist.data._resumable_loader import ResumableLoader
from contrastive_dist.data.collate import EmptySafeCollate
from contrastive_dist.data.sampler import DistributedBatchSampler
from contrastive_dist.data.shards import DistributedShardList
from contrastive_dist.data.streaming import DistributedStreamingBatches
from contrastive_dist.lightning._placement import check_trainer, data_parallel_group, placement
from contrastive_dist.lightning._step_sizes import step_sizes

__all__ = ["data_parallel_group", "distributed_loader", "step_sizes", "streaming_loader"]


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
) -> DataLoader:
    """A resumable, drop-last-free ``DataLoader`` for this rank, for ``*_dataloader()`` hooks.

    Call it from ``train_dataloader()`` / ``val_dataloader()`` (the trainer knows its rank and
    world size by then): ``return distributed_loader(self.train_set, self.trainer, batch_size=64)``.
    A checkpoint saved on one number of devices or workers resumes on another; with the same
    global batch size (``batch_size`` × devices) the remaining global batches are the same.

    Args:
        dataset: a map-style dataset (``len()`` and ``dataset[i]``) with at least one sample.
        trainer: the ``lightning.Trainer`` (rank and world size are read from it: under a device mesh, the
            data-parallel ones), or ``None`` to read them from the default group (one process without one).
        batch_size: samples per rank per step; a step's global batch is ``batch_size × world size``.
        shuffle: a new order each epoch (training); ``False`` splits the natural order across the
            ranks with nothing repeated or dropped (exact evaluation).
        seed: the base seed of the order; the same on every rank.
        collate_fn: collates a non-empty list of samples; an empty rank's batch is derived from it.
        num_workers: DataLoader worker processes; they persist across epochs when there are any, and
            exit when their rank does, even killed.
        **loader_options: any other ``DataLoader`` option (``pin_memory``, ``prefetch_factor``, ...).

    Returns:
        A ``DataLoader`` whose ``batch_sampler`` is the :class:`~contrastive_dist.DistributedBatchSampler`,
        with ``state_dict()`` / ``load_state_dict()``: the sampler's state after the batches it yielded.

    Raises:
        ValueError: the trainer would replace the sampler (``use_distributed_sampler=True`` under DDP);
            at ``load_state_dict``, a state the sampler refuses, or (with a trainer) one saved
            mid-epoch with another global batch size that changes the number of steps of the epoch,
            which Lightning keeps for a whole ``fit``.
        TypeError: ``dataset`` has no ``len()``, or an option has the wrong type.

    Shape:
        - each batch: ``collate_fn`` of ``step_sizes(trainer, step)[rank]`` samples (possibly 0).

    Example:
        >>> import torch
        >>> pairs = [(torch.randn(4), torch.randn(4), i) for i in range(10)]
        >>> loader = distributed_loader(pairs, None, batch_size=4, shuffle=False)  # in a module: self.trainer
        >>> [(len(ids), loader.batch_sampler.sizes(step)) for step, (_, _, ids) in enumerate(loader)]
        [(4, (4,)), (4, (4,)), (2, (2,))]
        >>> state = loader.state_dict()  # what Lightning saves in a checkpoint

    """
    for name in ("batch_sampler", "sampler", "batch_size", "shuffle", "drop_last"):
        if name in loader_options:
            raise TypeError(f"distributed_loader sets {name!r} itself; got it in loader_options")
    check_trainer(trainer, "distributed_loader")
    try:
        length = len(dataset)
    except TypeError as error:
        raise TypeError(f"dataset must be map-style with len(), got {type(dataset).__name__}") from error
    num_replicas, rank = placement(trainer)
    sampler = DistributedBatchSampler(length, batch_size, shuffle=shuffle, seed=seed, num_replicas=num_replicas,
                                      rank=rank)
    loader_options.setdefault("persistent_workers", num_workers > 0)
    return ResumableLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=EmptySafeCollate(dataset, collate_fn),
        num_workers=num_workers,
        fixed_epoch_length=trainer is not None,
        **loader_options,
    )


def streaming_loader(
    shards: Sequence[Any],
    trainer: Any | None,
    *stages: Callable[[Iterator[Any]], Iterator[Any]],
    batch_size: int,
    example: Any,
    shuffle: bool = True,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] = default_collate,
    num_workers: int = 0,
    lookahead: int = 1,
    on_error: str = "raise",
    **loader_options: Any,
) -> DistributedStreamingBatches:
    """Drop-last-free, resumable batches of a sharded stream for this rank, for ``train_dataloader()``.

    Call it from ``train_dataloader()``: ``return streaming_loader(urls, self.trainer,
    wds.tarfile_to_samples(), wds.decode("pil"), wds.map(preprocess), batch_size=64, example=...)``.
    The shards are split over the trainer's ranks and each rank's DataLoader workers
    (:class:`~contrastive_dist.DistributedShardList`, a new seeded order each epoch), the samples
    flow through ``stages`` (:meth:`~contrastive_dist.DistributedShardList.pipeline`), and the
    batches are wrapped in a :class:`~contrastive_dist.DistributedStreamingBatches`: every rank runs
    the same number of steps, every sample is used once per epoch. Lightning's ``set_epoch``
    reaches the shard order, and its checkpoints hold the stream's progress: ``trainer.fit(...,
    ckpt_path=...)`` resumes mid-epoch, on the same or another number of devices and workers.

    Args:
        shards: the shard names or URLs of the whole dataset, the same list on every rank.
        trainer: the ``lightning.Trainer`` (rank and world size are read from it: under a device mesh, the
            data-parallel ones), or ``None`` to read them from the default group (one process without one).
        *stages: webdataset pipeline stages after the shard list (``wds.tarfile_to_samples()``,
            ``wds.decode(...)``, ``wds.map(...)``, ...); picklable when ``num_workers > 0``. The
            first reads shards into samples that name their shard in ``__url__``; stages that hold
            samples back (a shuffle buffer) lose what they hold at a mid-epoch checkpoint.
        batch_size: samples per rank per step (a rank's last batches may be smaller or empty).
        example: one sample as the stages yield it; it shapes the empty batch of a rank that ran out.
        shuffle: a new shard order each epoch; ``False`` reads shard ``i`` on rank ``i % world size``
            every epoch (reproducible comparisons).
        seed: the base seed of the shard order; the same on every rank.
        collate_fn: collates a non-empty list of samples.
        num_workers: DataLoader worker processes per rank, started with ``forkserver`` (workers
            forked from a process in a gloo group were seen to hang) and new each epoch; they and
            the forkserver exit when their rank does, even killed.
        lookahead: batches fetched per agreement between the ranks (see
            :class:`~contrastive_dist.DistributedStreamingBatches`).
        on_error: what an unreadable shard or sample does (see
            :meth:`~contrastive_dist.DistributedShardList.pipeline`): ``"raise"`` stops every rank
            with the same ``RuntimeError``, naming the rank, the shard and the original error;
            ``"skip"`` skips it with one ``RuntimeWarning`` naming it, and the returned batches'
            ``skipped()`` counts the skips over every rank.
        **loader_options: any other ``DataLoader`` option (``pin_memory``, ``prefetch_factor``, ...).

    Returns:
        A :class:`~contrastive_dist.DistributedStreamingBatches` over a ``DataLoader``.

    Raises:
        ValueError: the trainer would replace the sampler (``use_distributed_sampler=True`` under
            DDP), or an option is out of range.
        RuntimeError: while iterating, on every rank, when a rank's loader raised (``on_error="raise"``).
        TypeError: an option that this function sets was given, or ``example`` does not collate.

    Shape:
        - each batch: ``collate_fn`` of ``step_sizes(trainer, step)[rank]`` samples (possibly 0).

    Example:
        >>> import tempfile, webdataset as wds
        >>> path = f"{tempfile.mkdtemp()}/shard-000000.tar"
        >>> with wds.TarWriter(path) as sink:
        ...     for i in range(5):
        ...         _ = sink.write({"__key__": f"{i:06d}", "cls": i})
        >>> batches = streaming_loader([path], None, wds.tarfile_to_samples(), wds.decode(), wds.to_tuple("cls"),
        ...                            batch_size=2, example=(0,))             # no trainer: one process
        >>> [(ids.tolist(), batches.sizes(step)) for step, (ids,) in enumerate(batches)]
        [([0, 1], (2,)), ([2, 3], (2,)), ([4], (1,))]

    """
    for name in ("batch_sampler", "sampler", "batch_size", "shuffle", "drop_last", "persistent_workers"):
        if name in loader_options:
            raise TypeError(f"streaming_loader sets {name!r} itself; got it in loader_options")
    check_trainer(trainer, "streaming_loader")
    num_replicas, rank = placement(trainer)
    shard_list = DistributedShardList(shards, shuffle=shuffle, seed=seed, num_replicas=num_replicas, rank=rank)
    try:
        collate = EmptySafeCollate([example], collate_fn)
    except Exception as error:  # checked here, on every rank, rather than at a rank's first empty step
        raise TypeError(
            f"example must be one sample as the stages yield it, which collate_fn can collate; collating "
            f"[example] raised {type(error).__name__}: {error}"
        ) from error
    if num_workers > 0:
        loader_options.setdefault("multiprocessing_context", "forkserver")
    loader = DataLoader(
        shard_list.pipeline(*stages, on_error=on_error),
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=num_workers,
        **loader_options,
    )
    # Lightning fetches one batch ahead of the step it trains on (it has no length to stop at).
    return DistributedStreamingBatches(loader, lookahead=lookahead, caller_prefetch=0 if trainer is None else 1)
