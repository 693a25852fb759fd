"""Which ranks share the global batch under a Lightning trainer: the world, or a device mesh's data-parallel part.

Under ``ModelParallelStrategy`` (and any strategy with a ``device_mesh``) the tensor-parallel ranks of
a data-parallel rank hold the same samples: the loaders must split the data over the data-parallel
ranks only, and the losses, SyncBatchNorm, the queue and the gradient cache must gather over them.
The data-parallel part of the mesh is its dimension named ``data_parallel`` (Lightning) or ``dp``, or
its dimensions ``dp_replicate`` and ``dp_shard`` (HSDP) flattened; a 1-D mesh is data-parallel
whole. Strategies without a mesh (DDP, ``FSDPStrategy``) use the world, as before.
"""

from __future__ import annotations

from typing import Any

from contrastive_dist._dist import GroupLike, get_rank, get_world_size, set_default_group

__all__ = ["check_trainer", "data_parallel_group", "placement"]

DATA_PARALLEL_NAMES = (("data_parallel",), ("dp",), ("dp_replicate", "dp_shard"), ("dp_replicate",), ("dp_shard",))
"""The names of a mesh's data-parallel dimension(s), tried in this order."""


def data_parallel_group(trainer: Any) -> GroupLike:
    """The ranks that share the global batch under ``trainer``: its mesh's data-parallel part, or ``None`` (the world).

    ``contrastive_dist.lightning``'s loaders use it and make it the package's default group
    (:func:`~contrastive_dist.set_default_group`), so that a loss called without ``group=`` gathers
    over it; pass it as ``group=`` to say so in the code.

    Raises:
        ValueError: the strategy has a device mesh of several dimensions none of whose names says
            which is data-parallel (``data_parallel``, ``dp``, or ``dp_replicate`` and ``dp_shard``).

    Example:
        >>> from types import SimpleNamespace
        >>> data_parallel_group(SimpleNamespace(strategy=SimpleNamespace())) is None  # DDP: the world
        True
    """
    mesh = _device_mesh(getattr(trainer, "strategy", None))
    if mesh is None:
        return None
    if mesh.ndim == 1:
        return mesh
    names = tuple(mesh.mesh_dim_names or ())
    for candidate in DATA_PARALLEL_NAMES:
        if set(candidate) <= set(names):
            return mesh[candidate if len(candidate) > 1 else candidate[0]]
    raise ValueError(
        f"the strategy's device mesh has dimensions {names or mesh.shape}, and none is named as data-parallel "
        f"({' / '.join(' + '.join(candidate) for candidate in DATA_PARALLEL_NAMES)}): name it so, or build the "
        "loaders with num_replicas/rank and pass group= to the losses"
    )


def _device_mesh(strategy: Any) -> Any:
    try:
        return getattr(strategy, "device_mesh", None)
    except RuntimeError:  # Lightning's ModelParallelStrategy before its processes joined: no mesh yet
        return None


def placement(trainer: Any | None) -> tuple[int | None, int | None]:
    """The sampler's ``num_replicas`` and ``rank`` under ``trainer`` (``None``: read from the default group).

    With a trainer, its data-parallel group becomes the package's default group (``None``, the world,
    for a strategy without a mesh): the loaders and the losses then agree on it.
    """
    if trainer is None:
        return None, None
    group = data_parallel_group(trainer)
    set_default_group(group)
    if group is None:
        return trainer.world_size, trainer.global_rank
    return get_world_size(group), get_rank(group)


def _rebuilds_loaders(trainer: Any) -> bool:
    # Lightning keeps the flag on its accelerator connector; a trainer-like object without one
    # (or a future Lightning that moved it) is given the benefit of the doubt.
    connector = getattr(trainer, "_accelerator_connector", None)
    return bool(getattr(connector, "use_distributed_sampler", False)) and trainer.world_size > 1


def check_trainer(trainer: Any, builder: str) -> None:
    """Refuse a trainer that would replace the loader's sampler with Lightning's own."""
    if trainer is not None and _rebuilds_loaders(trainer):
        raise ValueError(
            "this Trainer was built with use_distributed_sampler=True, so Lightning would replace the "
            f"drop-last-free sampler of {builder} with its own; pass Trainer(..., use_distributed_sampler=False)"
        )
