"""The gather's traceable route for ``torch.compile(fullgraph=True)``.

Dynamo cannot trace the eager route's ``autograd.Function`` around raw ``ProcessGroup``
calls; the functional collectives are traceable and carry their own autograd. Sizes must be
known (``sizes=``), since exchanging them is data-dependent, and nothing is verified across
ranks here.
"""

from __future__ import annotations

from typing import cast

import torch
from einops import repeat
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["gather_compiled"]


def gather_compiled(
    tensors: tuple[Tensor, ...], dim: int, sizes: tuple[int, ...], rank: int, group: ProcessGroup | None
) -> tuple[Tensor, ...]:
    """Traceable route for ``torch.compile``: functional collectives with their own autograd."""
    import torch.distributed._functional_collectives as funcol

    world_size = len(sizes)
    process_group = cast(ProcessGroup, group if group is not None else torch.distributed.group.WORLD)
    results = []
    for tensor in tensors:
        rows = tensor.movedim(dim, 0).contiguous()
        if min(sizes) == max(sizes):
            gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
            gathered = gather(rows, 0, process_group)
        else:
            # The same rows for every peer; contiguous, since for one row einops returns a stride-0 view.
            send = repeat(rows, "n ... -> (peer n) ...", peer=world_size).contiguous()
            gathered = funcol.all_to_all_single_autograd(
                send, list(sizes), [sizes[rank]] * world_size, process_group
            )
        results.append(gathered.movedim(0, dim))
    return tuple(results)
