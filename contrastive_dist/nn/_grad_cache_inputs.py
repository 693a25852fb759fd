"""How ``grad_cache`` takes its inputs apart and puts one mini-batch of them back together.

The encoder may take positional tensors (``encoder(images)``), mappings (a sentence-transformers
model's ``model({"input_ids": …, "attention_mask": …})``) and keyword tensors (a Hugging Face
model's ``model(input_ids=…, attention_mask=…)``). :class:`Inputs` flattens every tensor into one
list, which the autograd function slices by rows, and rebuilds the call from a list of pieces;
non-tensor values (a string, a flag) are passed as they are. With ``trim_padding``, the columns
past the last position that the mini-batch's ``attention_mask`` keeps are dropped from the
tensors of the same mapping (or of the keywords) that span the sequence, as sentence-transformers
does, so a mini-batch of short texts is encoded at its own width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["Inputs", "flatten_inputs"]

_MASK = "attention_mask"


@dataclass
class _Slot:
    """One argument: a tensor (``index``), or a mapping of names to tensor indices / plain values."""

    index: int | None = None
    entries: dict[str, int | tuple[Any]] | None = None


@dataclass
class Inputs:
    """Every tensor of the call, and how the call is rebuilt from them (see the module docstring)."""

    tensors: list[Tensor]
    positional: list[_Slot]
    keywords: dict[str, int | tuple[Any]]
    trim_padding: bool = False

    def _groups(self) -> list[dict[str, int | tuple[Any]]]:
        return [slot.entries for slot in self.positional if slot.entries is not None] + [self.keywords]

    def pieces(self, tensors: Sequence[Tensor], start: int, stop: int) -> list[Tensor]:
        """Rows ``start:stop`` of ``tensors`` (these inputs or their detached copies), padding trimmed."""
        widths: dict[int, int] = {}
        if self.trim_padding:
            for entries in self._groups():
                mask_index = entries.get(_MASK)
                if not isinstance(mask_index, int) or tensors[mask_index].ndim != 2:
                    continue
                mask = tensors[mask_index]
                kept = mask[start:stop].bool().any(0).nonzero()
                width = int(kept.max()) + 1 if kept.numel() else mask.shape[1]
                for value in entries.values():
                    if isinstance(value, int) and tensors[value].ndim >= 2 and tensors[value].shape[1] == mask.shape[1]:
                        widths[value] = width
        return [x[start:stop, : widths[i]] if i in widths else x[start:stop] for i, x in enumerate(tensors)]

    def call(self, encoder: Any, pieces: Sequence[Tensor]) -> Any:
        """``encoder`` called on ``pieces`` in the shape of the original call."""
        def value(entry: int | tuple[Any]) -> Any:
            return pieces[entry] if isinstance(entry, int) else entry[0]

        args = [pieces[slot.index] if slot.index is not None else
                {key: value(entry) for key, entry in (slot.entries or {}).items()} for slot in self.positional]
        return encoder(*args, **{key: value(entry) for key, entry in self.keywords.items()})


def flatten_inputs(
    positional: Sequence[object], keywords: Mapping[str, object], trim_padding: bool
) -> tuple[Inputs, str | None]:
    """The call's :class:`Inputs`, and the reason an argument cannot be taken (or ``None``)."""
    tensors: list[Tensor] = []

    def entry(value: object) -> int | tuple[Any]:
        if isinstance(value, Tensor):
            tensors.append(value)
            return len(tensors) - 1
        return (value,)

    slots: list[_Slot] = []
    for index, argument in enumerate(positional):
        if isinstance(argument, Tensor):
            slots.append(_Slot(index=len(tensors)))
            tensors.append(argument)
        elif isinstance(argument, Mapping) and all(isinstance(key, str) for key in argument):
            slots.append(_Slot(entries={key: entry(value) for key, value in argument.items()}))
        else:
            return Inputs([], [], {}), (f"every input must be a torch.Tensor or a mapping of names to tensors, "
                                        f"got {type(argument).__name__} at position {index}")
    named = {key: entry(value) for key, value in keywords.items()}
    return Inputs(tensors, slots, named, trim_padding), None
