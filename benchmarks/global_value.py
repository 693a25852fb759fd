"""What a loss returns on each rank, and what it costs that this is the global loss.

Run (W gloo processes on this machine's CPUs)::

    python benchmarks/global_value.py                          # the [3, 1] table, then W = 2 and 4
    python benchmarks/global_value.py --world-sizes 2 --repeats 5   # quick check

**Values.** Every loss and drop-in on 2 processes holding 3 rows and 1 row of the same 4-row batch
(float64): the value each rank returns, beside the single-process loss of the 4 rows. Each rank
returns the global loss; its gradient is still this rank's share, so DDP's average is the global
gradient (the gradient contract).

**Cost.** The global value costs one scalar all-reduce per loss call (none for SupCon, whose
denominator was already exchanged: the value rides in the same all-reduce). It is timed inside a
realistic training step on W processes: the CLIP recipe's image tower (``resnet-small``, width 16,
32×32 images) and a text tower, ``per_rank`` pairs per rank, ``DistributedInfoNCE(chunk_size=256)``,
DDP's backward and an SGD step. Right after the loss — where the ranks meet anyway, in the loss's own
gather — one more 0-d all-reduce of the same kind is timed; the table gives the median step (that
extra exchange left out) and the median of that all-reduce, and their ratio: what returning the
global loss adds to the step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist import DistributedInfoNCE, dcl, info_nce, nt_xent, siglip, supcon
from contrastive_dist.compat.lightly import DCLLoss, NTXentLoss
from contrastive_dist.compat.open_clip import ClipLoss, SigLipLoss
from contrastive_dist.compat.sentence_transformers import MultipleNegativesRankingLoss
from contrastive_dist.lightning.towers import small_image_resnet  # the recipes' image tower itself
from contrastive_dist.testing import WorkerPool

SHARDS = (3, 1)


class _Identity(nn.Module):  # sentence-transformers' interface: features in, a dict out
    def forward(self, features: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"sentence_embedding": features["x"]}


def _values(images: Tensor, texts: Tensor, labels: Tensor, weights: Tensor) -> dict[str, Tensor]:
    """Every loss on these rows (this rank's, or the whole batch on one process)."""
    scale, bias = torch.tensor(10.0, dtype=torch.float64), torch.tensor(-5.0, dtype=torch.float64)
    views = torch.stack([images, texts], dim=1)
    return {
        "info_nce": info_nce(images, texts, scale),
        "info_nce(weight=)": info_nce(images, texts, scale, weight=weights),
        "nt_xent": nt_xent(images, texts, temperature=0.2),
        "siglip": siglip(images, texts, scale, bias),
        "supcon": supcon(views, labels, temperature=0.2),
        "dcl": dcl(images, texts, temperature=0.2),
        "open_clip ClipLoss": ClipLoss(local_loss=True, gather_with_grad=True)(images, texts, scale),
        "open_clip SigLipLoss": SigLipLoss()(images, texts, scale, bias),
        "lightly NTXentLoss": NTXentLoss(temperature=0.2, gather_distributed=True)(images, texts),
        "lightly DCLLoss": DCLLoss(temperature=0.2, gather_distributed=True)(images, texts),
        "sentence-transformers MNRL": MultipleNegativesRankingLoss(_Identity(), gather_across_devices=True)(
            [{"x": images}, {"x": texts}], None),
    }


def _batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = F.normalize(torch.randn(sum(SHARDS), 16, generator=generator, dtype=torch.float64), dim=-1)
    texts = F.normalize(images + 0.5 * torch.randn(sum(SHARDS), 16, generator=generator, dtype=torch.float64), dim=-1)
    return images, texts, torch.tensor([0, 1, 0, 1]), torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)


def values_on_rank(rank: int, world_size: int) -> dict[str, float]:
    mine = slice(sum(SHARDS[:rank]), sum(SHARDS[: rank + 1]))
    return {name: float(value) for name, value in _values(*(x[mine] for x in _batch())).items()}


def _towers() -> nn.Module:
    torch.manual_seed(0)
    backbone, features = small_image_resnet("resnet-small", width=16)
    image = nn.Sequential(backbone, nn.Linear(features, 64, bias=False))
    text = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64))

    class Towers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.image, self.text = image, text
            self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

        def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1), self.logit_scale.exp()

    return Towers()


def step_times(rank: int, world_size: int, per_rank: int, repeats: int) -> dict[str, float]:
    """Median seconds of a training step (the timed exchange left out), and of one extra 0-d all-reduce."""
    model = nn.parallel.DistributedDataParallel(_towers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    criterion = DistributedInfoNCE(chunk_size=256)
    generator = torch.Generator().manual_seed(1 + rank)
    images = torch.randn(per_rank, 3, 32, 32, generator=generator)
    texts = torch.randn(per_rank, 128, generator=generator)
    steps, exchanges = [], []
    for index in range(repeats + 1):  # the first step warms up
        start = time.perf_counter()
        loss = criterion(*model(images, texts))
        exchange_start = time.perf_counter()
        extra = loss.detach().clone()
        dist.all_reduce(extra)  # what the global value adds: one such exchange per loss call
        exchange = time.perf_counter() - exchange_start
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if index:
            steps.append(time.perf_counter() - start - exchange)
            exchanges.append(exchange)
    return {"step": statistics.median(steps), "exchange": statistics.median(exchanges)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--per-rank", type=int, default=128, help="pairs per rank in the timed step")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    with WorkerPool(len(SHARDS), timeout=120) as pool:
        per_rank = pool.run(values_on_rank)
    single = {name: float(value) for name, value in _values(*_batch()).items()}
    print(f"| loss, rows {list(SHARDS)} | rank 0 | rank 1 | one process, {sum(SHARDS)} rows |")
    print("|---|---:|---:|---:|")
    for name, value in single.items():
        print(f"| {name} | {per_rank[0][name]:.6f} | {per_rank[1][name]:.6f} | {value:.6f} |")

    print(f"\n| W | step (ms) | one 0-d all-reduce (ms) | all-reduce / step |  ({args.per_rank} pairs per rank)")
    print("|---:|---:|---:|---:|")
    for world_size in args.world_sizes:
        with WorkerPool(world_size, timeout=600) as pool:
            results: list[dict[str, Any]] = pool.run(step_times, args.per_rank, args.repeats)
        step = max(result["step"] for result in results)  # the slowest rank sets the pace
        exchange = max(result["exchange"] for result in results)
        print(f"| {world_size} | {1e3 * step:.1f} | {1e3 * exchange:.3f} | {exchange / step:.2%} |")


if __name__ == "__main__":
    main()
