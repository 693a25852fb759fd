"""The autograd side of the gradient cache: encode without a graph, re-encode and back-propagate in backward.

:class:`GradCacheFunction` takes the encoder's parameters as inputs. Its forward encodes each
mini-batch under ``no_grad`` and records what the re-encode needs to repeat it exactly: the
random-number state of the CPU and of every accelerator the inputs and parameters live on, per
mini-batch, and the autocast state of the call. Its backward re-encodes one mini-batch at a time
with that state, back-propagates the slice of the incoming embedding gradient with
``torch.autograd.grad`` (which never touches ``.grad``, so no DDP hook fires inside), and returns
the parameter gradients summed over the mini-batches: each parameter receives its gradient once per
backward, as from any other op, and DDP's reducer, Lightning and gradient accumulation see nothing
unusual.

The re-encode must not count as a second forward of the layers that keep running statistics, so
every training BatchNorm layer (``nn.modules.batchnorm._BatchNorm``: ``nn.BatchNorm*``,
``torch.nn.SyncBatchNorm``, this package's :class:`~contrastive_dist.SyncBatchNorm`) runs it with
``track_running_stats`` off: it still normalizes with the mini-batch statistics, as in the forward,
but leaves its buffers alone.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm

from contrastive_dist._validation import Problem
from contrastive_dist.nn._grad_cache_inputs import Inputs
from contrastive_dist.nn._grad_cache_outputs import Description, as_outputs, empty_outputs, kind_of, unlike_first

__all__ = ["CachePlan", "GradCacheFunction"]

_REENTRANT = ("Checkpointing is not compatible with .grad()", "checkpoint is incompatible with .grad()")


@dataclass
class CachePlan:
    """What one ``grad_cache`` call encodes, and what its forward records for the backward.

    ``bounds`` holds ``(start, stop)`` row ranges, the same number on every rank (empty ranges pad
    the ranks with fewer rows). ``check_outputs(outputs, rows)`` returns a problem or ``None``;
    ``settle(problem)`` runs once after the encodes and raises it (on every rank) if there is one;
    with ``exchange``, it tells the other ranks, so an error the module raises is kept for it too.
    """

    encoder: Callable[..., Any]
    inputs: Inputs
    batch_norms: list[_BatchNorm]
    bounds: list[tuple[int, int]]
    check_outputs: Callable[[object, int], Problem | None]
    settle: Callable[[Problem | None], None]
    exchange: bool
    encode_empty: bool = True
    describe: Callable[[Description | None], Description] | None = None
    device: torch.device = torch.device("cpu")
    kind: tuple[object, ...] = ("tensor",)
    rng_states: list[tuple[Tensor, list[Tensor]]] = field(default_factory=list)
    autocast: dict[str, dict[str, Any]] = field(default_factory=dict)

    def encodes(self, start: int, stop: int) -> bool:
        """Whether the mini-batch of rows ``start:stop`` is encoded (in forward, and again in backward)."""
        return stop > start or self.encode_empty


def _accelerators(tensors: Sequence[Tensor]) -> tuple[str | None, list[int]]:
    """The accelerator type and device indices whose random state the encodes may draw from."""
    devices = {tensor.device for tensor in tensors if tensor.device.type not in ("cpu", "meta")}
    kinds = {device.type for device in devices}
    if len(kinds) > 1:
        raise ValueError(f"grad_cache replays the random state of one accelerator type, got {sorted(kinds)}")
    kind = kinds.pop() if kinds else None
    return kind, sorted({device.index or 0 for device in devices})


def _rng_state(kind: str | None, indices: list[int]) -> tuple[Tensor, list[Tensor]]:
    device_states = [] if kind is None else [torch.get_device_module(kind).get_rng_state(i) for i in indices]
    return torch.get_rng_state(), device_states


def _set_rng_state(kind: str | None, indices: list[int], state: tuple[Tensor, list[Tensor]]) -> None:
    torch.set_rng_state(state[0])
    for index, device_state in zip(indices, state[1]):
        torch.get_device_module(kind).set_rng_state(device_state, index)  # type: ignore[arg-type]


def _autocast_state(kinds: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {
        kind: {
            "enabled": torch.is_autocast_enabled(kind),
            "dtype": torch.get_autocast_dtype(kind),
            # No weight-cast cache in the re-encode: each mini-batch's graph is freed by its own
            # backward, so a cast cached by the first would be stale for the second (same values).
            "cache_enabled": False,
        }
        for kind in kinds
    }


@contextlib.contextmanager
def _replay_autocast(state: dict[str, dict[str, Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for kind, options in state.items():
            stack.enter_context(torch.autocast(kind, **options))
        yield


@contextlib.contextmanager
def _running_stats_frozen(batch_norms: Sequence[_BatchNorm]) -> Iterator[None]:
    """Training BatchNorm layers normalize with batch statistics but update no buffer (see module docstring)."""
    frozen = [norm for norm in batch_norms if norm.training and norm.track_running_stats]
    for norm in frozen:
        norm.track_running_stats = False
    try:
        yield
    finally:
        for norm in frozen:
            norm.track_running_stats = True


def _raised(error: Exception, rows: int) -> Problem:
    kind = next((kind for kind in (TypeError, ValueError) if isinstance(error, kind)), RuntimeError)
    return kind, f"the module raised {type(error).__name__} on a mini-batch of {rows} rows: {error}"


class GradCacheFunction(torch.autograd.Function):
    """``plan.encoder(*inputs)`` in mini-batches: no graph kept in forward, re-encoded in backward."""

    @staticmethod
    def forward(ctx: Any, plan: CachePlan, input_count: int, *tensors: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        inputs = tensors[:input_count]
        kind, indices = _accelerators(tensors)
        plan.autocast = _autocast_state(["cpu"] if kind is None else ["cpu", kind])
        buffers: list[Tensor] = []
        problem: Problem | None = None
        for start, stop in plan.bounds:
            plan.rng_states.append(_rng_state(kind, indices))
            if not plan.encodes(start, stop):
                continue  # a real encoder may not take 0 rows, and nothing here needs the call
            # A rank with a problem keeps encoding: a collective inside the encoder (SyncBatchNorm)
            # must run as often on every rank. plan.settle raises it on all of them afterwards.
            try:
                outputs = plan.inputs.call(plan.encoder, plan.inputs.pieces(inputs, start, stop))
            except Exception as error:
                if not plan.exchange:
                    raise
                # E.g. a per-rank BatchNorm given a mini-batch of one row here only: without this, the
                # other ranks would wait for this one in the exchange of plan.settle.
                problem = problem or _raised(error, stop - start)
                continue
            problem = problem or plan.check_outputs(outputs, stop - start)
            if problem is None and not buffers:
                plan.kind = kind_of(outputs)
                rows = plan.bounds[-1][1]  # padding ranges are empty ranges at the end
                buffers = [out.new_empty((rows, *out.shape[1:])) for out in as_outputs(outputs)]
            problem = problem or unlike_first(outputs, plan.kind, buffers)
            if problem is None:
                for buffer, out in zip(buffers, as_outputs(outputs)):
                    buffer[start:stop] = out
        plan.settle(problem)
        if plan.describe is not None:
            mine = (plan.kind, tuple((str(b.dtype), tuple(b.shape[1:])) for b in buffers)) if buffers else None
            description = plan.describe(mine)
            if not buffers:
                plan.kind, buffers = description[0], empty_outputs(description, plan.device)
        ctx.plan, ctx.input_count, ctx.kind, ctx.indices = plan, input_count, kind, indices
        ctx.save_for_backward(*tensors)
        return tuple(buffers)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        plan: CachePlan = ctx.plan
        count, wants = ctx.input_count, ctx.needs_input_grad[2:]
        inputs, parameters = ctx.saved_tensors[:count], ctx.saved_tensors[count:]
        wanted_parameters = [p for p, wanted in zip(parameters, wants[count:]) if wanted]
        sums: list[Tensor | None] = [None] * len(wanted_parameters)
        input_grads = [torch.zeros_like(x) if wanted else None for x, wanted in zip(inputs, wants[:count])]
        warned, encoded = False, False
        with torch.random.fork_rng(devices=ctx.indices, device_type=ctx.kind or "cuda"):
            for (start, stop), state in zip(plan.bounds, plan.rng_states):
                if not plan.encodes(start, stop):
                    continue
                encoded = True
                _set_rng_state(ctx.kind, ctx.indices, state)
                pieces = [x.detach().requires_grad_(wanted)
                          for x, wanted in zip(plan.inputs.pieces(inputs, start, stop), wants[:count])]
                with torch.enable_grad(), _replay_autocast(plan.autocast), _running_stats_frozen(plan.batch_norms):
                    outputs = as_outputs(plan.inputs.call(plan.encoder, pieces))
                tracked = [(out, grad[start:stop]) for out, grad in zip(outputs, grad_outputs) if out.requires_grad]
                targets = [*wanted_parameters, *(piece for piece in pieces if piece.requires_grad)]
                if not tracked or not targets:
                    continue
                # Called for every mini-batch encoded in forward, empty ones included there: a collective
                # in the encoder's backward (SyncBatchNorm's all-reduce) runs as often on every rank.
                if not warned:
                    warned = _warn_unregistered([out for out, _ in tracked], targets)
                grads = _grads([out for out, _ in tracked], targets, [grad for _, grad in tracked])
                for index, (grad, total) in enumerate(zip(grads[: len(sums)], sums)):
                    if grad is not None:  # out of place: a returned gradient may alias the incoming one
                        sums[index] = grad if total is None else total + grad
                for input_grad, grad in zip([g for g in input_grads if g is not None], grads[len(sums) :]):
                    if grad is not None:  # a trimmed piece fills the leading columns of its rows
                        input_grad[(slice(start, stop), *(slice(0, size) for size in grad.shape[1:]))] = grad
        if not encoded:  # no rows here: zeros, so that DDP's hooks fire on this rank too and it joins the reduction
            sums = [torch.zeros_like(p) for p in wanted_parameters]
        summed = iter(sums)
        return (None, None, *input_grads, *(next(summed) if wanted else None for wanted in wants[count:]))


def _grads(
    outputs: Sequence[Tensor], targets: Sequence[Tensor], grad_outputs: Sequence[Tensor]
) -> tuple[Tensor | None, ...]:
    try:
        return torch.autograd.grad(outputs, targets, grad_outputs, allow_unused=True)
    except RuntimeError as error:
        if not any(text in str(error) for text in _REENTRANT):  # the message of torch < 2.14 and of 2.14
            raise
        raise RuntimeError(
            "grad_cache: the module uses reentrant checkpointing (torch.utils.checkpoint(..., use_reentrant=True)), "
            "which cannot run under the torch.autograd.grad that the re-encode needs (it never touches .grad, so "
            "DDP's hooks fire once). Use use_reentrant=False, the same memory saving, or no checkpointing: "
            "grad_cache already keeps no activations beyond one mini-batch"
        ) from error


def _warn_unregistered(outputs: Sequence[Tensor], targets: Sequence[Tensor]) -> bool:
    """Warn (once per backward) about leaves of the re-encode's graph that are not parameters nor inputs."""
    known = {id(target) for target in targets}
    seen: set[int] = set()
    missed: list[tuple[int, ...]] = []
    stack: list[Any] = [out.grad_fn for out in outputs if out.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if isinstance(variable, Tensor) and id(variable) not in known:
            missed.append(tuple(variable.shape))
        stack.extend(next_node for next_node, _ in node.next_functions)
    if missed:
        warnings.warn(
            f"grad_cache: the module uses {len(missed)} tensor(s) that require gradient but are neither its "
            f"parameters nor inputs (shapes {missed}); they receive no gradient. Register them on the module "
            "(an nn.Parameter attribute) or pass the module that owns them",
            UserWarning,
            stacklevel=2,
        )
    return True
