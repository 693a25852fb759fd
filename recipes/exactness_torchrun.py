"""Check, with the machines and the launcher you will train with, that the losses give the one-process gradients.

Every process holds the same float64 two-tower CLIP and the same global batch, split unevenly over
the processes (an empty one among them); each takes its rows through ``info_nce`` in gather and ring
mode under DDP (``DistributedDataParallel``) and under HSDP (FSDP2 over a nodes × processes-per-node
mesh, ``group=`` the mesh), and compares the gradients the engine averaged with the gradients of the
whole batch in one process (a plain loop of the loss), computed on each process. It prints one line
and exits 1 if any gradient is further than 1e-10 (relative) from the one-process one::

    torchrun --standalone --nproc-per-node 2 recipes/exactness_torchrun.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 \\
        --rdzv-id exactness recipes/exactness_torchrun.py      # the same command on each machine

Under SLURM, one task per node: ``srun torchrun --nnodes $SLURM_NNODES --nproc-per-node 8
--rdzv-backend c10d --rdzv-endpoint $(scontrol show hostnames | head -n 1):29500 --rdzv-id
$SLURM_JOB_ID recipes/exactness_torchrun.py``. CPU processes use gloo, GPUs NCCL.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from contrastive_dist import info_nce

TOLERANCE = 1e-10


class TinyCLIP(nn.Module):
    """Two linear towers into a normalized embedding space and a learnable logit scale, float64, seeded."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(12, 6, dtype=torch.float64, device=device)
        self.text = nn.Linear(12, 6, dtype=torch.float64, device=device)
        self.logit_scale = nn.Parameter(torch.tensor([2.0], dtype=torch.float64, device=device))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1), self.logit_scale[0].exp()


def one_process_loss(images: Tensor, texts: Tensor, scale: Tensor) -> Tensor:
    """CLIP's symmetric loss of the whole batch, row by row: image i picks text i among all, and back."""
    rows = []
    for i in range(images.shape[0]):
        image_to_text = torch.logsumexp(scale * texts @ images[i], 0) - scale * images[i] @ texts[i]
        text_to_image = torch.logsumexp(scale * images @ texts[i], 0) - scale * texts[i] @ images[i]
        rows.append((image_to_text + text_to_image) / 2)
    return torch.stack(rows).mean()


def gradient_error(model: nn.Module, wrapped: nn.Module, batch: tuple[Tensor, Tensor], rows: slice,
                   communication: str, group: object) -> float:
    """The largest relative difference of any parameter's averaged gradient from the one-process gradient."""
    x, y = batch
    info_nce(*wrapped(x[rows], y[rows]), communication=communication, group=group).backward()
    reference = TinyCLIP(x.device)
    one_process_loss(*reference(x, y)).backward()
    error = 0.0
    for parameter, expected in zip(model.parameters(), reference.parameters(), strict=True):
        grad = parameter.grad.full_tensor() if hasattr(parameter.grad, "full_tensor") else parameter.grad
        error = max(error, float((grad - expected.grad).abs().max() / expected.grad.abs().max()))
    return error


def main() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    sizes = [(3 * r + 2) % 5 for r in range(world_size)]  # uneven, an empty rank from 2 processes on
    start = sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    generator = torch.Generator().manual_seed(1)
    batch = tuple(torch.randn(sum(sizes), 12, generator=generator, dtype=torch.float64).to(device) for _ in "xy")
    errors = {}
    for communication in ("gather", "ring"):
        model = TinyCLIP(device)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        errors[f"DDP {communication}"] = gradient_error(model, ddp, batch, rows, communication, None)
    if world_size % per_node == 0 and world_size > per_node:  # several nodes: replicate over nodes, shard within
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size // per_node, per_node),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
        for communication in ("gather", "ring"):
            model = TinyCLIP(device)
            fully_shard(model, mesh=mesh)
            errors[f"HSDP {communication}"] = gradient_error(model, model, batch, rows, communication, mesh)
    worst = torch.tensor(list(errors.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst of every process
    line = ", ".join(f"{name} {value:.1e}" for name, value in zip(errors, worst.tolist(), strict=True))
    nodes = f"{world_size // per_node} node(s) × {per_node}"
    exact = float(worst.max()) <= TOLERANCE
    if rank == 0:
        print(f"exactness on {world_size} processes ({nodes}), rows per process {tuple(sizes)}: largest relative "
              f"gradient error {line}: {'exact' if exact else 'NOT EXACT'} (tolerance {TOLERANCE:.0e})")
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
