"""A ``collate_fn`` that also turns an empty batch into correctly shaped empty tensors.

With :class:`~contrastive_dist.DistributedBatchSampler` a rank may get no sample in the last step
of an epoch; it must still run that step (DDP and the losses' collectives wait for every rank).
``torch.utils.data.default_collate([])`` raises ``IndexError``, so such a rank needs a batch with
the usual structure and zero rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.utils.data import default_collate

__all__ = ["EmptySafeCollate"]


def _is_leaf_value(value: object) -> bool:
    return isinstance(value, (str, bytes)) or not isinstance(value, (Tensor, Mapping, Sequence))


def _zero_rows(collated: Any) -> Any:
    """Collated batch of one sample → the same structure with 0 rows."""
    if isinstance(collated, Tensor):
        if collated.dim() == 0:
            raise ValueError("the collated batch holds a 0-d tensor; expected a leading batch dimension")
        return collated[:0].clone()
    if isinstance(collated, Mapping):
        return type(collated)({key: _zero_rows(value) for key, value in collated.items()})  # type: ignore[call-arg]
    if isinstance(collated, (str, bytes)):
        raise ValueError(f"cannot build an empty batch from a bare {type(collated).__name__}")
    if isinstance(collated, Sequence):
        is_namedtuple = hasattr(collated, "_fields")
        # A list of plain values (strings, say) is the batch itself: one entry per sample.
        if not is_namedtuple and all(_is_leaf_value(item) for item in collated):
            return type(collated)()  # type: ignore[call-arg]
        items = [_zero_rows(item) for item in collated]
        if is_namedtuple:
            return type(collated)(*items)
        return type(collated)(items)  # type: ignore[call-arg]
    raise ValueError(
        f"cannot build an empty batch from a collated {type(collated).__name__}; "
        "expected tensors, mappings and sequences of them"
    )


def _clone(template: Any) -> Any:
    if isinstance(template, Tensor):
        return template.clone()
    if isinstance(template, Mapping):
        return type(template)({key: _clone(value) for key, value in template.items()})  # type: ignore[call-arg]
    if isinstance(template, (str, bytes)) or not isinstance(template, Sequence):
        return template
    items = [_clone(item) for item in template]
    return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)  # type: ignore[call-arg]


class EmptySafeCollate:
    """``collate_fn(samples)`` as usual; for no samples, the structure of a batch with 0 rows.

    The empty batch is built once, at construction, from ``collate_fn([dataset[0]])`` cut to zero
    rows: tensors become ``(0, *shape)`` with the same dtype, ints become empty ``int64`` tensors,
    dicts, tuples, lists and namedtuples keep their keys and nesting, a list of strings becomes an
    empty list. Only that small template is kept, so the object pickles cheaply into
    ``DataLoader`` workers.

    Args:
        dataset: a map-style dataset with at least one sample.
        collate_fn: the collate function of non-empty batches.

    Shape:
        - every tensor of the empty batch: ``(0, *sample_shape)``.

    Example:
        >>> import torch
        >>> dataset = [(torch.ones(3, 2), 7, {"caption": torch.zeros(5, dtype=torch.long)})] * 4
        >>> collate = EmptySafeCollate(dataset)
        >>> image, label, text = collate([])
        >>> image.shape, label.dtype, label.shape, text["caption"].shape
        (torch.Size([0, 3, 2]), torch.int64, torch.Size([0]), torch.Size([0, 5]))
        >>> collate(dataset[:2])[0].shape
        torch.Size([2, 3, 2])

    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] = default_collate) -> None:
        if not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable, got {type(collate_fn).__name__}")
        try:
            first = dataset[0]
        except (IndexError, KeyError) as error:
            raise ValueError("dataset must hold at least one sample to shape an empty batch") from error
        self.collate_fn = collate_fn
        self._empty = _zero_rows(collate_fn([first]))

    def __call__(self, samples: list[Any]) -> Any:
        """Collate ``samples``; an empty list gives the empty batch."""
        if len(samples) == 0:
            return _clone(self._empty)
        return self.collate_fn(samples)
