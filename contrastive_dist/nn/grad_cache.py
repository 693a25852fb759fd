"""Gradient cache: the embeddings of a whole batch for the activation memory of one mini-batch, same gradient.

Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup": encode
the batch in mini-batches without keeping activations, compute the loss over the whole batch, then
re-encode each mini-batch with gradient and back-propagate its slice of the embedding gradient.
:func:`grad_cache` packs this into one differentiable call; the autograd side lives in
``_grad_cache_function``.

Every rank runs the same number of mini-batches, ``K = max(1, ceil(max_r n_r / m))`` for per-rank
batches ``n_r`` and ``mini_batch_size = m``, padding with empty ones. An empty one is skipped: the
module is not called on 0 rows (a Hugging Face model or open_clip's ViT cannot take them), and a
rank without any row learns the shape of its 0-row outputs from the others in one small exchange.
Only a module with collectives of its own (``SyncBatchNorm``, a model-parallel layer: ``synchronized``)
is called on the empty ones too, so that its collectives run as often on every rank in forward and in
backward. The package's agreement exchange (the one every loss runs,
:mod:`contrastive_dist.engine._agreement`) tells every rank the largest batch, and makes bad input
or a ``mini_batch_size`` that differs between ranks raise the same error everywhere; a second one
after the encodes does the same for bad module outputs and for an error the module raised on some
ranks only (a per-rank BatchNorm given one row). Both are tiny next to one encoder forward (on an
accelerator each costs one host synchronisation); ``sizes=`` given by the caller is checked by the
first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parameter import is_lazy

from contrastive_dist._dist import GroupLike, is_distributed
from contrastive_dist._validation import Problem
from contrastive_dist.engine._agreement import agree
from contrastive_dist.nn._ddp_forward import inside_forward
from contrastive_dist.nn._grad_cache_function import CachePlan, GradCacheFunction
from contrastive_dist.nn._grad_cache_inputs import flatten_inputs
from contrastive_dist.nn._grad_cache_outputs import described, output_problem
from contrastive_dist.nn.norm import SyncBatchNorm

__all__ = ["grad_cache"]

def grad_cache(
    module: nn.Module | Callable[..., Any],
    *inputs: Tensor | Mapping[str, Any],
    mini_batch_size: int,
    sizes: Sequence[int] | None = None,
    group: GroupLike = None,
    trim_padding: bool = False,
    synchronized: bool | None = None,
    **keywords: Any,
) -> Tensor | tuple[Tensor, ...] | dict[str, Tensor]:
    """``module(*inputs)`` for the whole local batch, encoded ``mini_batch_size`` rows at a time.

    The forward keeps no activations: only the outputs (the embeddings) and the inputs. The
    ordinary ``loss.backward()`` re-encodes each mini-batch with gradient and back-propagates its
    slice of the embedding gradient into the module's parameters (and into inputs that require
    gradient). The result is exactly that of encoding the same mini-batches *with* gradient,
    concatenating and back-propagating: the random state of each mini-batch (dropout) is replayed,
    on the CPU and on accelerators, and so is the autocast state of the call. For a module without
    randomness and batch statistics that is ``module(*inputs)`` on the whole batch.

    Each parameter receives its gradient once per backward, summed over the mini-batches, so DDP's
    reducer syncs once per parameter (no ``no_sync``), also with ``find_unused_parameters=True`` and
    layers the module does not use (their gradient stays ``None``; a rank without rows gives zeros), and
    Lightning's automatic optimization, gradient accumulation and ``torch.autocast`` work unchanged.
    Call it where the module would be called: inside the forward of the ``DistributedDataParallel``
    model, in ``training_step``, or on the ``DistributedDataParallel`` model itself (its forward then
    runs once, around the encodes of its inner module).
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
            whose parameters that require gradient receive it; a ``DistributedDataParallel`` model
            encodes with its inner module, inside one forward of the wrapper.
        *inputs: tensors with the same leading (batch) size, split along it (images; or tokens and
            an attention mask), or mappings of names to such tensors (a sentence-transformers
            model's ``features``); other values in a mapping are passed to every call as they are.
        mini_batch_size: rows encoded at a time; peak activation memory is that of this many rows.
            The same on every rank.
        sizes: every rank's batch size in rank order, when known: checked against the agreement,
            like the losses' ``sizes=``.
        group: the ranks that encode in step, a process group or a device mesh (default: the world).
        trim_padding: drop, per mini-batch, the columns past the last one its ``attention_mask``
            keeps, from the tensors beside that mask (in its mapping, or the keywords) that span the
            sequence, as sentence-transformers does; the module's outputs must not depend on the width.
        synchronized: whether the module runs collectives of its own (then every rank calls it for
            every mini-batch, empty ones included, and it must take 0 rows); default: whether it holds
            a synchronized BatchNorm (``torch.nn.SyncBatchNorm`` or this package's). The same on every rank.
        **keywords: keyword inputs of the module (``input_ids=…, attention_mask=…``), split like
            ``inputs``.

    Returns:
        What ``module`` returns, a tensor, a tuple of tensors or a dict of tensors (a Hugging Face
        style output), for the whole local batch.

    Raises:
        TypeError: ``mini_batch_size`` not an int, an input that is not a tensor (or a mapping), a
            module that is not an ``nn.Module`` (or a method of one, not of a ``DistributedDataParallel``
            wrapper) or returns something other than tensors.
        RuntimeError: in backward, when the module uses reentrant checkpointing
            (``torch.utils.checkpoint(..., use_reentrant=True)``), which ``torch.autograd.grad`` cannot run.

    Warns:
        UserWarning: in backward, when the module uses a tensor that requires gradient but is not
            one of its parameters (nor an input): that tensor receives no gradient.
        ValueError: ``mini_batch_size`` < 1 or it or ``synchronized`` not the same on every rank, inputs with different
            leading sizes, outputs whose leading size is not the mini-batch's. These are raised on
            every rank of ``group``, and so is an error the module raised on some ranks only (its
            type if a ``ValueError``/``TypeError``, else ``RuntimeError``, naming the rank and the
            message), unless that rank skipped a collective of the module's own; otherwise the
            module's error is raised as it is.

    Shape:
        inputs: ``(n, *)`` each, ``n`` may be 0 (an empty rank still takes part in every exchange).
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
    if isinstance(module, DistributedDataParallel):
        return inside_forward(module, lambda inner: grad_cache(
            inner, *inputs, mini_batch_size=mini_batch_size, sizes=sizes, group=group, trim_padding=trim_padding,
            synchronized=synchronized, **keywords))
    flat, input_problem = flatten_inputs(inputs, keywords, trim_padding)
    tensors = flat.tensors
    problem, owner = _local_problem(module, tensors, mini_batch_size, input_problem)
    if synchronized is None and owner is not None:
        synchronized = any(isinstance(layer, (SyncBatchNorm, nn.SyncBatchNorm)) for layer in owner.modules())
    rows = tensors[0].shape[0] if problem is None else 0
    # Inputs may differ across ranks beyond their rows (tokens padded per rank): only rows are compared.
    layout = agree(tensors, problem=problem, group=group, operation="grad_cache", sizes=sizes, rows=rows,
                   options={"mini_batch_size": mini_batch_size, "synchronized": bool(synchronized)},
                   compare_inputs=False)
    owner = cast(nn.Module, owner)  # every problem, a missing owner included, was raised above
    count = max(1, math.ceil(max(layout.sizes) / mini_batch_size))
    bounds = [(min(k * mini_batch_size, rows), min((k + 1) * mini_batch_size, rows)) for k in range(count)]
    if any(is_lazy(p) for p in owner.parameters()):
        # A lazy layer's shape comes from its first call: make it on no rows, before the parameters
        # are taken as the function's inputs (an uninitialized one has no shape yet).
        with torch.no_grad():
            flat.call(module, flat.pieces(tensors, 0, 0))
    parameters = [p for p in owner.parameters() if p.requires_grad]
    exchange = is_distributed(group)

    def settle(output_problem: Problem | None) -> None:
        agree(tensors, problem=output_problem, group=group, operation="grad_cache", rows=0, compare_inputs=False)

    # No rows anywhere: the module's call on 0 rows is the only way to learn what it returns.
    encode_empty = bool(synchronized) or max(layout.sizes) == 0
    # Some rank encodes nothing: it takes its outputs' description from a rank that did.
    describe = None if encode_empty or min(layout.sizes) > 0 else lambda mine: described(mine, layout.group)
    plan = CachePlan(
        encoder=module,
        inputs=flat,
        batch_norms=[layer for layer in owner.modules() if isinstance(layer, _BatchNorm)],
        bounds=bounds,
        check_outputs=output_problem,
        settle=settle,
        exchange=exchange,
        encode_empty=encode_empty,
        describe=describe,
        device=next(iter(parameters), tensors[0]).device,
    )
    outputs = GradCacheFunction.apply(plan, len(tensors), *tensors, *parameters)
    if plan.kind[0] == "mapping":
        return dict(zip(cast(tuple[str, ...], plan.kind[1:]), outputs))
    return outputs[0] if plan.kind[0] == "tensor" else tuple(outputs)


def _owner(module: object) -> nn.Module | None:
    """The ``nn.Module`` whose parameters ``module`` uses: itself, or the object of a bound method."""
    if isinstance(module, nn.Module):
        return module
    owner = getattr(module, "__self__", None)
    return owner if callable(module) and isinstance(owner, nn.Module) else None


def _local_problem(
    module: object, inputs: Sequence[object], mini_batch_size: object, input_problem: str | None = None
) -> tuple[Problem | None, Any]:
    owner = _owner(module)
    if isinstance(owner, DistributedDataParallel):
        return (TypeError, "got a DistributedDataParallel wrapper; call grad_cache inside its forward "
                "(e.g. in the wrapped model's forward or in training_step) on the inner module, so that the reducer "
                "sees one backward"), None
    if owner is None:
        return (TypeError, f"module must be an nn.Module or a bound method of one, got "
                f"{type(module).__name__}"), None
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int):
        return (TypeError, f"mini_batch_size must be a positive int, got "
                f"{type(mini_batch_size).__name__}"), None
    if mini_batch_size < 1:
        return (ValueError, f"mini_batch_size must be a positive int, got {mini_batch_size}"), None
    if input_problem is not None:
        return (TypeError, input_problem), None
    if not inputs:
        return (TypeError, "expected at least one input tensor after the module"), None
    not_tensors = [type(x).__name__ for x in inputs if not isinstance(x, Tensor)]
    if not_tensors:
        return (TypeError, f"every input must be a torch.Tensor, got {not_tensors}"), None
    shapes = [tuple(x.shape) for x in cast(Sequence[Tensor], inputs)]
    if any(len(shape) == 0 for shape in shapes) or len({shape[0] for shape in shapes}) > 1:
        return (ValueError, f"every input must have the same leading (batch) size, got shapes "
                f"{shapes}"), None
    return None, owner
