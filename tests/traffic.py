"""Count a call's kernel launches and memory traffic without running it: every aten op on fake tensors.

:class:`Traffic` is a ``TorchDispatchMode`` that records each operator a call dispatches (its name,
the bytes it reads and writes, whether it is a matrix product). Run under ``FakeTensorMode`` nothing
is computed and no memory is used, so the count of a loss at a GPU's sizes takes a fraction of a
second, and fake tensors can sit on a CUDA device on a machine without one: the count is that of the
CUDA path (half products through ``torch.mm(..., out_dtype=float32)``, whatever a loss does only on
CUDA). :func:`count` runs forward and backward of a loss on fake CUDA tensors.

What counts:

* one dispatched operator is one launch, reading each distinct tensor input and writing each
  output once; a tensor's bytes are those it spans (an expanded dimension, stride 0, reads one
  element); a write-only argument (``out=``, the target of ``copy_`` / ``fill_`` / ``zero_``) is not read;
  an indexed read (``gather``, ``index_select``, ``index``) reads of its source only what it outputs, an
  indexed in-place write (``scatter_``, ``index_put_``, ``index_add_`` ...) writes of its target only the
  elements it touches;
* views (``t``, ``view``, ``slice``, ``select``, ``expand``, ``transpose``, ``detach`` ...: any operator
  whose schema says its output aliases an input without writing it), allocations (``empty``) and
  ``prim`` operators move no data and launch nothing: zero launches, zero bytes;
* the matrix products (:data:`PRODUCTS`) are kept apart from the rest, the *epilogue*; a product
  whose inner dimension is the features' forms a logit block;
* a value read back to the host (``.item()``, ``bool(t)``: ``_local_scalar_dense``) is a device
  synchronisation, counted apart; a fake tensor has no value, so the read returns the stand-in 1
  (``True``): the call takes the path of a check that passes (e.g. "every key is a small integer");
* only launches on the device asked for count (work on CPU tensors is the host's);
* an operator registered through ``torch.library`` (say ``contrastive_dist::sigmoid_epilogue``
  with a fake implementation) is one launch with its inputs and outputs, like any other; the arguments
  it mutates are outputs (written, not read), also where the same tensor is an input too.

:class:`Traffic` also follows the memory a call holds: every storage an operator's output makes (views
share their base's), alive until its last tensor goes; :attr:`Traffic.peak` is the most bytes alive at
once, the inputs made before the count left out, as a GPU's ``max_memory_allocated`` above the inputs
(the allocator's rounding and caching aside). :func:`peak` gives it for a loss's forward and backward.

The autograd engine cannot run a backward pass on fake CUDA tensors without a GPU (it asks the CUDA
driver for a context), so :func:`backward` walks the graph itself in topological order, calling each
node as the engine would; ``tests/test_traffic.py`` checks it against the engine on CPU tensors.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PRODUCTS", "Op", "Tally", "Traffic", "backward", "count", "fake_cuda", "peak"]

PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot", "_scaled_mm"})
"""Operator names (without overload) counted as matrix products."""
_FREE = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view"})
"""Operators that allocate or re-view without touching data (``_unsafe_view``'s schema marks no alias)."""
_WRITE_ONLY = frozenset({"copy_", "fill_", "zero_", "uniform_", "normal_", "random_", "bernoulli_"})
"""In-place operators that overwrite their first argument without reading it."""
_GATHERS = frozenset({"gather", "index_select", "index", "take", "embedding"})
"""Operators that read of their first argument only the elements they output."""
_UPDATES = frozenset({"scatter_add_", "scatter_reduce_", "index_add_"})
"""Indexed in-place writes that also read the elements they write (the others only write them)."""
_READ_BACK = "aten._local_scalar_dense.default"


class Op(NamedTuple):
    """One launch: the operator, the bytes it reads and writes, and for a product its inner dimension."""

    name: str
    bytes: int
    inner: int | None
    device: str


def _span(tensor: Tensor) -> int:
    """The bytes a tensor spans: dimensions of stride 0 (``expand``) count once."""
    if tensor.numel() == 0:
        return 0
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0)
    return elements * tensor.element_size()


def _free(func: torch._ops.OpOverload) -> bool:
    if func.namespace == "prim" or _name(func) in _FREE:
        return True
    return func.is_view


def _name(func: torch._ops.OpOverload) -> str:
    return func._overloadpacket.__name__


def _unread(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """Ids of the arguments this operator writes without reading."""
    unread = {id(kwargs[name]) for name in ("out",) if isinstance(kwargs.get(name), Tensor)}
    if _name(func) in _WRITE_ONLY and args and isinstance(args[0], Tensor):
        unread.add(id(args[0]))
    return unread


def _touched(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> int | None:
    """How many elements of its first argument an indexed in-place write touches; None for other operators."""
    name, target = _name(func), args[0]
    if name in ("scatter_", "scatter_add_", "scatter_reduce_"):
        return int(args[2].numel())
    if name in ("index_add_", "index_copy_", "index_fill_"):
        return target.numel() // max(target.shape[args[1]], 1) * int(args[2].numel())
    if name == "index_put_":
        indices = [index for index in args[1] if index is not None]
        positions = math.prod(torch.broadcast_shapes(*(index.shape for index in indices)))
        return positions * math.prod(target.shape[len(args[1]) :])
    return None


def _distinct(tensors: list[Any]) -> list[Tensor]:
    unique: dict[int, Tensor] = {}
    for tensor in tensors:
        if isinstance(tensor, Tensor):
            unique.setdefault(id(tensor), tensor)
    return list(unique.values())


def _mutated(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """``(read, written)``: a custom operator's arguments split into those it reads and those it mutates.

    A ``torch.library`` operator's mutated arguments are its outputs (the epilogue ops' ``G``): written,
    not read, also where the same tensor is passed as an input too (``G`` over the product: read as the
    product, then written). An ``aten`` operator's are left to the rules above (``add_`` reads its target).
    """
    if func.namespace in ("aten", "prim"):
        return tree_leaves((args, kwargs)), []
    read, written = [], []
    for index, argument in enumerate(func._schema.arguments):
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        mutated = argument.alias_info is not None and argument.alias_info.is_write
        (written if mutated else read).extend(tree_leaves(value))
    return read, written


def _bytes(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes one launch reads and writes (see the module docstring)."""
    unread = _unread(func, args, kwargs)
    read, mutated = _mutated(func, args, kwargs)
    inputs = [tensor for tensor in _distinct(read) if id(tensor) not in unread]
    written = sum(_span(tensor) for tensor in _distinct(tree_leaves(out) + mutated))
    touched = _touched(func, args)
    if touched is not None:  # of the target, only the touched elements: written, and read by an update
        others = sum(_span(tensor) for tensor in inputs if tensor is not args[0])
        return others + touched * args[0].element_size() * (2 if _name(func) in _UPDATES else 1)
    if _name(func) in _GATHERS:  # of the source, only the elements it outputs
        return sum(_span(tensor) for tensor in inputs if tensor is not args[0]) + 2 * written
    return sum(_span(tensor) for tensor in inputs) + written


class Traffic(TorchDispatchMode):
    """Record every operator dispatched while active, as :class:`Op` in :attr:`ops` (call order).

    Example:
        >>> import torch
        >>> with Traffic() as traffic:
        ...     total = torch.ones(4) + torch.ones(4)
        >>> [(op.name, op.bytes) for op in traffic.ops]
        [('aten.ones.default', 16), ('aten.ones.default', 16), ('aten.add.Tensor', 48)]
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self.peak = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}

    def _hold(self, out: Any, inputs: Any) -> None:
        """Count the storages ``out`` made (not an input's: a view, an in-place result); forget those whose
        tensors are all gone; raise :attr:`peak`."""
        given = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves(inputs) if isinstance(t, Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, Tensor) and tensor.device.type != "cpu":
                storage = tensor.untyped_storage()
                reference = StorageWeakRef(storage)
                if reference.cdata not in given:
                    self._live.setdefault(reference.cdata, (reference, storage.nbytes()))
        self._live = {key: held for key, held in self._live.items() if not held[0].expired()}
        self.peak = max(self.peak, sum(size for _, size in self._live.values()))

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if str(func) == _READ_BACK:  # a fake tensor holds no value: the stand-in 1 (True)
            self.ops.append(Op(_READ_BACK, args[0].element_size(), None, args[0].device.type))
            return True if args[0].dtype == torch.bool else 1.0 if args[0].dtype.is_floating_point else 1
        out = func(*args, **kwargs)
        self._hold(out, (args, kwargs))
        if not _free(func):
            product = _name(func).rstrip("_") in PRODUCTS  # addmm_ too
            inner = [t for t in args if isinstance(t, Tensor)][-2].shape[-1] if product else None
            devices = [t.device.type for t in tree_leaves((out, args, kwargs)) if isinstance(t, Tensor)]
            self.ops.append(Op(str(func), _bytes(func, args, kwargs, out), inner, devices[0] if devices else "cpu"))
        return out


class Tally(NamedTuple):
    """The launches of one call on one device, the matrix products apart from the epilogue.

    Attributes:
        products: matrix products launched.
        logit_blocks: products whose inner dimension is the features' (logits ``Q Kᵀ``, formed or recomputed).
        product_bytes: bytes the products read and write.
        epilogue: every other launch.
        epilogue_bytes: bytes those read and write.
        host_reads: values read back to the host (``.item()``, ``bool()``): each a device synchronisation.
        names: epilogue launches per operator.
    """

    products: int
    logit_blocks: int
    product_bytes: int
    epilogue: int
    epilogue_bytes: int
    host_reads: int
    names: Counter[str]

    @classmethod
    def of(cls, ops: list[Op], dim: int, device: str = "cuda") -> Tally:
        """The tally of ``ops`` that touch ``device``; ``dim`` is the features' last dimension."""
        here = [op for op in ops if op.device == device]
        reads = [op for op in here if op.name == _READ_BACK]
        products = [op for op in here if op.inner is not None]
        epilogue = [op for op in here if op.inner is None and op.name != _READ_BACK]
        return cls(
            len(products),
            sum(op.inner == dim for op in products),
            sum(op.bytes for op in products),
            len(epilogue),
            sum(op.bytes for op in epilogue),
            len(reads),
            Counter(op.name for op in epilogue),
        )


def fake_cuda() -> FakeTensorMode:
    """A fake tensor mode: tensors made inside may sit on ``cuda`` without a GPU."""
    return FakeTensorMode()


def backward(root: Tensor) -> None:
    """``root.backward()`` without the autograd engine: each node called in topological order.

    Gradients of leaves are accumulated into ``.grad``; an output a node gets no gradient for
    receives zeros, as the engine materialises them for custom functions, and a gradient in another
    dtype than its input's is cast, as the engine casts it. Grad mode is off, as in the engine's
    backward without ``create_graph``.
    """
    if root.grad_fn is None:
        raise ValueError("backward() needs a tensor with a grad_fn")
    users: defaultdict[Any, int] = defaultdict(int)
    stack, seen = [root.grad_fn], {root.grad_fn}
    while stack:
        node = stack.pop()
        for parent, _ in node.next_functions:
            if parent is not None:
                users[parent] += 1
                if parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
    pending: dict[Any, list[Tensor | None]] = {root.grad_fn: [torch.ones_like(root)]}
    ready = [root.grad_fn]
    with torch.no_grad():
        while ready:
            node = ready.pop()
            grads = pending.pop(node)
            if hasattr(node, "variable"):  # AccumulateGrad: the end of a leaf's path
                leaf, grad = node.variable, grads[0]
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
                continue
            inputs = _materialised(node, grads)
            outputs = node.apply(*inputs) if hasattr(node, "apply") else node(*inputs)  # type: ignore[operator]
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            for (parent, slot), grad in zip(node.next_functions, outputs):
                if parent is None:
                    continue
                slots = pending.setdefault(parent, [None] * len(parent._input_metadata))
                wanted = parent._input_metadata[slot].dtype
                if grad is not None and grad.dtype != wanted:  # as the engine's validate_outputs casts
                    grad = grad.to(wanted)
                if grad is not None:
                    slots[slot] = grad if slots[slot] is None else slots[slot] + grad
                users[parent] -= 1
                if users[parent] == 0:
                    ready.append(parent)


def _materialised(node: Any, grads: list[Tensor | None]) -> list[Tensor | None]:
    if not hasattr(node, "apply"):  # a C++ node takes undefined gradients as they are
        return grads
    metadata = node._input_metadata
    return [
        torch.zeros(m.shape, dtype=m.dtype, device=m.device) if grad is None else grad
        for grad, m in zip(grads, metadata)
    ]


def count(loss: Callable[..., Tensor], inputs: Callable[[], Sequence[Tensor]], *, dim: int) -> Tally:
    """The CUDA launches of ``loss(*inputs()).backward()``, on fake CUDA tensors.

    Args:
        loss: returns a scalar.
        inputs: makes the inputs, on ``cuda`` (called under the fake mode; not counted).
        dim: the features' last dimension, which tells the logit products apart.
    """
    with fake_cuda():
        arguments = inputs()
        with Traffic() as traffic:
            backward(loss(*arguments))
    return Tally.of(traffic.ops, dim)


def peak(loss: Callable[..., Tensor], inputs: Callable[[], Sequence[Tensor]]) -> int:
    """The most bytes ``loss(*inputs()).backward()`` holds at once on CUDA, above its inputs, on fake tensors.

    The gradients handed to the inputs count (they are made by the call); the inputs do not.
    """
    with fake_cuda():
        arguments = inputs()
        with Traffic() as traffic:
            backward(loss(*arguments))
    return traffic.peak
