"""Gradient cache: the embeddings of a whole batch for the activation memory of one mini-batch, same gradient.

Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup": encode
the batch in mini-batches without keeping activations, compute the loss over the whole batch, then
re-encode each mini-batch with gradient and back-propagate its slice of the embedding gradient.
:func:`grad_cache` packs this into one differentiable call; the autograd side lives in
``_grad_cache_function``.

Every rank encodes the same number of mini-batches, ``K = max(1, ceil(max_r n_r / m))`` for per-rank
batches ``n_r`` and ``mini_batch_size = m``, padding with empty ones, so a collective inside the
encoder (``SyncBatchNorm``, a model-parallel layer) runs as often on every rank in forward and in
backward. The largest local batch is read from ``sizes=`` when the caller has them (the package's
samplers do: ``DistributedBatchSampler.sizes(step)``, ``contrastive_dist.lightning.step_sizes``): no
communication at all. Without ``sizes=``, one all-gather of three integers per rank (status, rows,
``mini_batch_size``) tells every rank the largest batch, and makes bad input or a ``mini_batch_size``
that differs between ranks raise the same error everywhere; a second one of one integer after the
encodes does the same for bad module outputs and for an error the module raised on some ranks only
(a per-rank BatchNorm given one row). Both are tiny next to one encoder forward; on an accelerator
each costs one host synchronisation, which ``sizes=`` avoids.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from contrastive_dist._dist import get_rank, get_world_size, is_distributed
from contrastive_dist.engine._wire import all_gather_single
from contrastive_dist.nn._grad_cache_function import CachePlan, GradCacheFunction, Problem, as_outputs

__all__ = ["grad_cache"]

_OK = 0
_STATUS: dict[type[Exception], int] = {TypeError: 1, ValueError: 2, RuntimeError: 3}


def grad_cache(
    module: nn.Module | Callable[..., Any],
    *inputs: Tensor,
    mini_batch_size: int,
    sizes: Sequence[int] | None = None,
    group: ProcessGroup | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """``module(*inputs)`` for the whole local batch, encoded ``mini_batch_size`` rows at a time.

    The forward keeps no activations: only the outputs (the embeddings) and the inputs. The
    ordinary ``loss.backward()`` re-encodes each mini-batch with gradient and back-propagates its
    slice of the embedding gradient into the module's parameters (and into inputs that require
    gradient). The result is exactly that of encoding the same mini-batches *with* gradient,
    concatenating and back-propagating: the random state of each mini-batch (dropout) is replayed,
    on the CPU and on accelerators, and so is the autocast state of the call. For a module without
    randomness and batch statistics that is ``module(*inputs)`` on the whole batch.

    Each parameter receives its gradient once per backward, summed over the mini-batches, so DDP's
    reducer syncs once per parameter (no ``no_sync``), and Lightning's automatic optimization,
    gradient accumulation and ``torch.autocast`` work unchanged. Call it where the module would be
    called: inside the forward of the ``DistributedDataParallel`` model, or in ``training_step``.
    The same module may be used by several calls (two views through one encoder); every loss and
    communication mode takes the outputs like any other embeddings.

    **BatchNorm** (like gradient accumulation): a layer with batch statistics normalizes each
    mini-batch with that mini-batch's statistics (over every rank's mini-batch for a synchronized
    one), so exactness to the whole batch does not hold for it. Its running statistics are updated
    once per mini-batch encode, empty padding ones included (``num_batches_tracked`` counts them, as
    for any empty batch), never by the re-encode. Other state a module changes in its forward
    changes twice per mini-batch.

    Args:
        module: the encoder: an ``nn.Module``, or a bound method of one (``model.encode_image``),
            whose parameters that require gradient receive it. Not a ``DistributedDataParallel``
            wrapper: call this inside its forward, on the inner module.
        *inputs: tensors with the same leading (batch) size, split along it (images; or tokens and
            an attention mask).
        mini_batch_size: rows encoded at a time; peak activation memory is that of this many rows.
            The same on every rank.
        sizes: every rank's batch size in rank order, when known (no exchange; see the module
            docstring). A promise, like the losses' ``sizes=``: the same on every rank, equal to the rows.
        group: the ranks that encode in step (default: the world).

    Returns:
        What ``module`` returns, a tensor or a tuple of tensors, for the whole local batch.

    Raises:
        TypeError: ``mini_batch_size`` not an int, an input that is not a tensor, a module that is
            not an ``nn.Module`` (or a method of one) or returns something other than tensors.
        ValueError: ``mini_batch_size`` < 1 or not the same on every rank, inputs with different
            leading sizes, outputs whose leading size is not the mini-batch's. Without ``sizes=``,
            these are raised on every rank of ``group``, and so is an error the module raised on
            some ranks only (its type if a ``ValueError``/``TypeError``, else ``RuntimeError``,
            naming the rank and the message), unless that rank skipped a collective of the
            module's own; otherwise the module's error is raised as it is.

    Shape:
        inputs: ``(n, *)`` each, ``n`` may be 0 (an empty rank still encodes in step).
        output: ``(n, *)`` each, what ``module`` returns for ``n`` rows.

    Example:
        >>> import torch
        >>> from contrastive_dist import grad_cache, info_nce
        >>> _ = torch.manual_seed(0)
        >>> image_tower, text_tower = torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)
        >>> images, texts = torch.randn(10, 8), torch.randn(10, 6)
        >>> image = grad_cache(image_tower, images, mini_batch_size=4)  # 3 encodes, no graph kept
        >>> info_nce(image, text_tower(texts), 10.0).backward()  # re-encodes the 3 mini-batches
        >>> plain = info_nce(image_tower(images), text_tower(texts), 10.0)
        >>> expected = torch.autograd.grad(plain, image_tower.weight)[0]
        >>> torch.allclose(image_tower.weight.grad, expected, atol=1e-6)
        True
    """
    problem, owner = _local_problem(module, inputs, mini_batch_size)
    rows = inputs[0].shape[0] if problem is None else 0
    distributed = is_distributed(group)
    if sizes is not None:
        problem = problem or _sizes_problem(sizes, rows, group)
        if problem is not None:
            raise problem[0](problem[1])  # a promise broken here: the others are not told (as the losses)
        largest = max(sizes)
    elif distributed:
        table = _agree([rows, mini_batch_size if problem is None else 0], problem, inputs, group)
        steps = {row[2] for row in table}
        if len(steps) > 1:
            raise ValueError(
                f"grad_cache: mini_batch_size must be the same on every rank, got {[row[2] for row in table]} "
                "(rank order): the ranks would encode different numbers of mini-batches"
            )
        largest = max(row[1] for row in table)
    elif problem is not None:
        raise problem[0](problem[1])
    else:
        largest = rows
    owner = cast(nn.Module, owner)  # every problem, a missing owner included, was raised above
    count = max(1, math.ceil(largest / mini_batch_size))
    bounds = [(min(k * mini_batch_size, rows), min((k + 1) * mini_batch_size, rows)) for k in range(count)]
    parameters = [p for p in owner.parameters() if p.requires_grad]
    exchange = sizes is None and distributed

    def settle(output_problem: Problem | None) -> None:
        if exchange:
            _agree([], output_problem, inputs, group)
        elif output_problem is not None:
            raise output_problem[0](output_problem[1])

    plan = CachePlan(
        encoder=module,
        batch_norms=[layer for layer in owner.modules() if isinstance(layer, _BatchNorm)],
        bounds=bounds,
        check_outputs=_output_problem,
        settle=settle,
        exchange=exchange,
    )
    outputs = GradCacheFunction.apply(plan, len(inputs), *inputs, *parameters)
    return outputs[0] if plan.single else tuple(outputs)


def _owner(module: object) -> nn.Module | None:
    """The ``nn.Module`` whose parameters ``module`` uses: itself, or the object of a bound method."""
    if isinstance(module, nn.Module):
        return module
    owner = getattr(module, "__self__", None)
    return owner if callable(module) and isinstance(owner, nn.Module) else None


def _local_problem(module: object, inputs: Sequence[object], mini_batch_size: object) -> tuple[Problem | None, Any]:
    owner = _owner(module)
    if isinstance(owner, DistributedDataParallel):
        return (TypeError, "grad_cache: got a DistributedDataParallel wrapper; call grad_cache inside its forward "
                "(e.g. in the wrapped model's forward or in training_step) on the inner module, so that the reducer "
                "sees one backward"), None
    if owner is None:
        return (TypeError, f"grad_cache: module must be an nn.Module or a bound method of one, got "
                f"{type(module).__name__}"), None
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int):
        return (TypeError, f"grad_cache: mini_batch_size must be a positive int, got "
                f"{type(mini_batch_size).__name__}"), None
    if mini_batch_size < 1:
        return (ValueError, f"grad_cache: mini_batch_size must be a positive int, got {mini_batch_size}"), None
    if not inputs:
        return (TypeError, "grad_cache: expected at least one input tensor after the module"), None
    not_tensors = [type(x).__name__ for x in inputs if not isinstance(x, Tensor)]
    if not_tensors:
        return (TypeError, f"grad_cache: every input must be a torch.Tensor, got {not_tensors}"), None
    shapes = [tuple(x.shape) for x in cast(Sequence[Tensor], inputs)]
    if any(len(shape) == 0 for shape in shapes) or len({shape[0] for shape in shapes}) > 1:
        return (ValueError, f"grad_cache: every input must have the same leading (batch) size, got shapes "
                f"{shapes}"), None
    return None, owner


def _sizes_problem(sizes: Sequence[int], rows: int, group: ProcessGroup | None) -> Problem | None:
    world_size, rank = get_world_size(group), get_rank(group)
    if isinstance(sizes, Tensor) or not all(isinstance(size, int) and size >= 0 for size in sizes):
        return TypeError, f"grad_cache: sizes must be a sequence of non-negative Python ints, got {sizes!r}"
    if len(sizes) != world_size or sizes[rank] != rows:
        return ValueError, (f"grad_cache: sizes must give every rank's rows ({world_size} entries, this rank's "
                            f"{rows} at index {rank}), got {tuple(sizes)}")
    return None


def _output_problem(outputs: object, rows: int) -> Problem | None:
    """A problem when ``outputs`` is not a tensor or tuple of tensors with ``rows`` leading rows each."""
    is_tuple = isinstance(outputs, tuple) and len(outputs) > 0 and all(isinstance(x, Tensor) for x in outputs)
    if not (isinstance(outputs, Tensor) or is_tuple):
        return TypeError, (f"grad_cache: the module must return a tensor or a tuple of tensors, got "
                           f"{type(outputs).__name__}")
    shapes = [tuple(out.shape) for out in as_outputs(outputs)]
    if any(len(shape) == 0 or shape[0] != rows for shape in shapes):
        return ValueError, (f"grad_cache: every output must have the inputs' leading size ({rows} rows in this "
                            f"mini-batch), got shapes {shapes}")
    return None


def _control_device(inputs: Sequence[object], group: ProcessGroup | None) -> torch.device:
    """Where the small exchange tensor lives: beside the inputs, or on the GPU an NCCL-only group needs."""
    first = inputs[0] if inputs else None
    if isinstance(first, Tensor) and first.device.type != "cpu":
        return first.device
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(values: list[int], problem: Problem | None, inputs: Sequence[object],
           group: ProcessGroup | None) -> list[list[int]]:
    """All-gather ``[status, *values]`` from every rank; raise a rank's problem on all of them."""
    world_size = get_world_size(group)
    status = _OK if problem is None else _STATUS[problem[0]]
    local = torch.tensor([[status, *values]], dtype=torch.int64, device=_control_device(inputs, group))
    table = local.new_empty((world_size, local.shape[1]))
    all_gather_single(table, local, group=group)
    rows: list[list[int]] = table.tolist()
    failing = [rank for rank, row in enumerate(rows) if row[0] != _OK]
    if failing:
        # The error path only: one more exchange carries the readable message of each rank.
        messages: list[Any] = [None] * world_size
        dist.all_gather_object(messages, problem[1] if problem else "", group=group)
        first = failing[0]
        kind = next(kind for kind, status in _STATUS.items() if status == rows[first][0])
        raise kind(f"{messages[first]} (on rank {first}; raised on every rank of the group, failing: {failing})")
    return rows
