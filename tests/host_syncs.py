"""Count the host syncs a call would make on an accelerator, on a machine without one.

Tensors made "on the device" are stand-ins: a wrapper that reports the ``meta`` device (a device
type other than CPU, so the package takes its accelerator paths, and one whose device guard works
without a GPU) and holds real CPU values, so the code runs to its end and collectives run on gloo.
:class:`HostSyncs` counts what stalls the host on a real accelerator:

* reading a device value on the host: ``.item()``, ``float()``, ``bool()``, ``.tolist()``, a copy to
  the CPU;
* an operation whose output size depends on device data (``nonzero``, boolean-mask indexing, ...);
* a host-to-device copy from pageable memory, or a blocking one (``torch.tensor(x, device=...)``,
  ``.to(device)`` of an unpinned tensor): CUDA waits for the stream before such a copy.

A copy from pinned memory with ``non_blocking=True``, and a factory that fills on the device
(``torch.full``), are not syncs. Inside :class:`HostSyncs`, ``DEVICE`` stands for the accelerator.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

DEVICE = torch.device("meta")
_ACTIVE: list[HostSyncs] = []
_SIZE_FROM_DATA = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim",
                   "aten::unique_consecutive", "aten::nonzero_static"}


class OnDevice(torch.Tensor):
    """A tensor that says it is on ``DEVICE`` and holds its values in ``inner`` (a CPU tensor)."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OnDevice:
        wrapper = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=DEVICE, requires_grad=inner.requires_grad)
        wrapper.inner = inner
        return wrapper

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OnDevice({self.inner!r})"

    def tolist(self) -> Any:  # type: ignore[override]
        _ACTIVE[-1].count("tolist")
        return self.inner.tolist()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Outside the mode's thread (autograd's device threads): the active counter handles it.
        with _ACTIVE[-1]:
            return func(*args, **(kwargs or {}))


def _device_kwarg(kwargs: dict[str, Any]) -> torch.device | None:
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


class HostSyncs(TorchDispatchMode):
    """While active, tensors made on ``DEVICE`` are stand-ins and every host sync is appended to ``syncs``."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self._pinned: dict[int, torch.Tensor] = {}

    def count(self, what: str) -> None:
        self.syncs.append(what)

    def _is_pinned(self, tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and _memory(tensor) in self._pinned

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = func._schema.name
        wrappers = {value.inner._cdata: value for value in tree_leaves((args, kwargs)) if isinstance(value, OnDevice)}
        to_device = _device_kwarg(kwargs)
        on_device = bool(wrappers) or (to_device is not None and to_device.type == DEVICE.type)
        if name == "aten::is_pinned":
            return self._is_pinned(args[0])
        if name == "aten::_pin_memory":
            return self._pin(args[0].clone())
        pin = bool(kwargs.pop("pin_memory", False))
        if pin:
            kwargs["pin_memory"] = False
        if to_device is not None:
            kwargs["device"] = torch.device("cpu")
        self._note(name, args, kwargs, to_device)
        output = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if to_device is not None and to_device.type == "cpu":
            on_device = False  # a copy to the host
        if pin:
            return self._pin(output)
        if not on_device:
            return output
        return tree_map(lambda value: _wrapped(value, wrappers), output)

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        self._pinned[_memory(tensor)] = tensor  # by its memory: a factory hands back a detached alias
        return tensor

    def _note(self, name: str, args: Any, kwargs: dict[str, Any], to_device: torch.device | None) -> None:
        """Count the call ``name`` if it syncs the host on a real accelerator."""
        source = args[0] if args else None
        if name == "aten::_local_scalar_dense" and isinstance(source, OnDevice):
            self.count("item")
        elif name in _SIZE_FROM_DATA and isinstance(source, OnDevice):
            self.count(name)
        elif name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
                isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                for index in (args[1] if len(args) > 1 else ()) if index is not None):
            self.count(f"{name} with a mask")
        elif name == "aten::_to_copy" and to_device is not None and isinstance(source, torch.Tensor):
            self._copy(source, to_device, bool(kwargs.get("non_blocking", False)))
        elif name == "aten::copy_" and len(args) > 1:
            target, copied = args[0], args[1]
            if isinstance(target, OnDevice) != isinstance(copied, OnDevice):
                self._copy(copied, target.device, bool(args[2]) if len(args) > 2 else False)

    def _copy(self, source: torch.Tensor, target: torch.device, non_blocking: bool) -> None:
        if isinstance(source, OnDevice) and target.type == "cpu":
            self.count("copy to the host")
        elif not isinstance(source, OnDevice) and target.type == DEVICE.type:
            if not (non_blocking and self._is_pinned(source)):
                self.count("blocking or pageable copy to the device")

    def __enter__(self) -> HostSyncs:
        _ACTIVE.append(self)
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _ACTIVE.pop()


def _memory(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


def _wrapped(value: Any, wrappers: dict[int, OnDevice]) -> Any:
    """An output on the device: the caller's own wrapper where an in-place op returned its input."""
    if isinstance(value, torch.Tensor) and value._cdata in wrappers:
        return wrappers[value._cdata]
    return OnDevice(value) if isinstance(value, torch.Tensor) and not isinstance(value, OnDevice) else value


def _unwrap(value: Any) -> Any:
    return value.inner if isinstance(value, OnDevice) else value


@contextmanager
def counting_host_syncs() -> Iterator[HostSyncs]:
    """Count host syncs; ``torch.tensor(data, device=DEVICE)`` counts as one (a pageable copy), as on CUDA.

    ``torch.tensor`` with a device never reaches a dispatch mode (it copies in C++), hence the patch.
    """
    original = torch.tensor

    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == DEVICE.type:
            counter.count("torch.tensor(..., device=the device)")
            return OnDevice(original(data, *args, **kwargs))
        return original(data, *args, device=device, **kwargs)

    with HostSyncs() as counter:
        torch.tensor = tensor  # type: ignore[assignment]
        try:
            yield counter
        finally:
            torch.tensor = original  # type: ignore[assignment]
