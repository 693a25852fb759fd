"""What the mesh tests share: device meshes made once per worker, a float64 two-tower model, how it is parallelized.

The model is a CLIP of two small MLP towers and a learnable logit scale, in float64 with weights drawn
from a fixed seed, so every rank and the one-process reference start alike. :func:`parallelize` applies
one of PyTorch's engines to it: FSDP2 over a 1-D mesh, HSDP over a replicate × shard mesh, or tensor
parallelism over the ``tp`` dimension of a ``dp × tp`` mesh (the text tower's output left a replicated
``DTensor``) with FSDP2 over ``dp``. Imported by the test modules and, through pickled functions, by
their gloo workers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IN_DIM, HIDDEN, EMBED = 6, 8, 5
KINDS = ("fsdp2", "hsdp", "dp_tp")
MESHES = {"fsdp2": ((4,), ("dp",)), "hsdp": ((2, 2), ("dp_replicate", "dp_shard")), "dp_tp": ((2, 2), ("dp", "tp")),
          "dp_cp": ((2, 2), ("dp", "cp"))}
_MADE: dict[str, object] = {}


def mesh(name: str):
    """The 4-rank device mesh ``name`` of :data:`MESHES`, made once per worker (making one is collective)."""
    if name not in _MADE:
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = MESHES[name]
        _MADE[name] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MADE[name]


class Towers(nn.Module):
    """Image and text MLP towers into one normalized embedding space, and a learnable logit scale."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.image = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, EMBED)).double()
        self.text = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, EMBED)).double()
        self.logit_scale = nn.Parameter(torch.tensor([1.5], dtype=torch.float64))
        with torch.no_grad():
            for parameter in (*self.image.parameters(), *self.text.parameters()):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        image, text = F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1)
        return image, text, self.logit_scale[0].exp()


def global_batch(total: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(total, IN_DIM, generator=generator, dtype=torch.float64),
            torch.randn(total, IN_DIM, generator=generator, dtype=torch.float64))


def parallelize(model: Towers, kind: str):
    """Apply ``kind``'s engine to ``model``; the loss's ``group=`` (a mesh) and this rank's data-parallel rank."""
    from torch.distributed.fsdp import fully_shard

    devices = mesh(kind)
    if kind != "dp_tp":  # every rank data-parallel: the whole mesh (HSDP's two dimensions flattened)
        fully_shard(model, mesh=devices)
        return devices, torch.distributed.get_rank()
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model.image, devices["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    # The text features stay a DTensor, replicated over tp: the loss takes them as this rank's rows.
    replicated = RowwiseParallel(use_local_output=False)
    parallelize_module(model.text, devices["tp"], {"0": ColwiseParallel(), "2": replicated})
    fully_shard(model, mesh=devices["dp"])
    return devices["dp"], devices.get_local_rank("dp")


def full_gradients(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's whole gradient (a sharded ``DTensor`` one gathered; collective: on every rank alike)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def shard(tensor: Tensor, sizes: tuple[int, ...], rank: int) -> Tensor:
    start = sum(sizes[:rank])
    return tensor[start : start + sizes[rank]]


def relative_error(actual: Tensor, expected: Tensor) -> float:
    """The largest difference relative to the largest expected value (0 for two empty tensors)."""
    if expected.numel() == 0:
        return 0.0 if actual.numel() == 0 else float("inf")
    actual, expected = actual.detach(), expected.detach()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300))
