"""Train a small CLIP with plain PyTorch DDP (no Lightning): drop-last-free batches, exact mid-epoch resume.

One file, no download: generated images of a coloured square whose caption names it ("a large red
square in the top left"), a small conv net with exact global BatchNorm (``convert_sync_batchnorm``)
and a bag-of-words text tower, ``DistributedInfoNCE`` over the global batch with the sampler's
per-rank sizes, and held-out image→text / text→image recall at the end. Each run writes its
``checkpoint.pt`` to a new ``runs/clip_torchrun/version_N`` (``--resume`` names the run to continue).

    torchrun --standalone --nproc-per-node 2 recipes/clip_torchrun.py                  # CPU: gloo
    torchrun --standalone --nproc-per-node 8 recipes/clip_torchrun.py --batch-size 256  # GPUs: NCCL
    torchrun --standalone --nproc-per-node 2 recipes/clip_torchrun.py --max-steps 600 \\
        --resume runs/clip_torchrun/version_0                                           # continue a run
    torchrun --standalone --nproc-per-node 2 recipes/clip_torchrun.py --batch-size 1024 \\
        --grad-cache 64                                     # activations of 64 rows at a time (grad_cache)
    torchrun --standalone --nproc-per-node 4 recipes/clip_torchrun.py --max-steps 600 --batch-size 32 \\
        --resume runs/clip_torchrun/version_0    # ... on 4 processes: the same global batch, the same batches

Several machines: the same command on each, one c10d rendezvous (``recipes/exactness_torchrun.py`` first)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29500 \\
        --rdzv-id clip recipes/clip_torchrun.py --batch-size 256
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from contrastive_dist import (
    DistributedBatchSampler,
    DistributedInfoNCE,
    EmptySafeCollate,
    convert_sync_batchnorm,
    grad_cache,
    retrieval_accuracy,
)
from contrastive_dist.lightning.runs import run_folder

COLOURS = {"red": (0.9, 0.15, 0.15), "green": (0.15, 0.8, 0.2), "blue": (0.2, 0.35, 0.95),
           "yellow": (0.95, 0.9, 0.15), "purple": (0.65, 0.2, 0.85), "cyan": (0.15, 0.85, 0.9)}
SIZES = {"small": 3, "large": 6}  # side in pixels, in a 24×24 image of 3×3 cells of 8 pixels
POSITIONS = [f"{row} {column}" for row in ("top", "middle", "bottom") for column in ("left", "middle", "right")]
WORDS = ["<pad>", *sorted({word for text in [*COLOURS, *SIZES, *POSITIONS, "a square in the"]
                           for word in text.split()})]
CAPTION_WORDS = 8


class Squares(Dataset):
    """Items ``(image float (3, 24, 24), caption word ids (8,), index)``, the same on every rank.

    ``distinct=True`` draws each (colour, size, position) at most once: every caption is unique,
    so retrieval over the split has one right answer per query (chance ``1/size``).
    """

    def __init__(self, size: int, *, seed: int, distinct: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        every = list(itertools.product(range(len(COLOURS)), range(len(SIZES)), range(len(POSITIONS))))
        picks = (torch.randperm(len(every), generator=generator)[:size] if distinct
                 else torch.randint(len(every), (size,), generator=generator))
        self.images = 0.15 + 0.05 * torch.randn(len(picks), 3, 24, 24, generator=generator)
        self.tokens = torch.zeros(len(picks), CAPTION_WORDS, dtype=torch.long)
        for index, pick in enumerate(picks.tolist()):
            colour, size, position = every[pick]
            side = list(SIZES.values())[size]
            top, left = (8 * cell + int(torch.randint(9 - side, (), generator=generator))
                         for cell in divmod(position, 3))
            rgb = torch.tensor(list(COLOURS.values())[colour])
            self.images[index, :, top : top + side, left : left + side] = rgb[:, None, None]
            text = f"a {list(SIZES)[size]} {list(COLOURS)[colour]} square in the {POSITIONS[position]}"
            self.tokens[index, : len(text.split())] = torch.tensor([WORDS.index(word) for word in text.split()])

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        return self.images[index], self.tokens[index], index


class CLIP(nn.Module):
    """Image and text towers into one embedding space; a learnable temperature, clamped at 100 as in CLIP."""

    def __init__(self, embed_dim: int = 64, grad_cache: int = 0) -> None:
        super().__init__()
        self.mini_batch_size = grad_cache

        def block(channels_in: int, channels_out: int, stride: int) -> list[nn.Module]:
            return [nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False), nn.BatchNorm2d(channels_out),
                    nn.ReLU()]

        self.image = nn.Sequential(*block(3, 32, 1), *block(32, 64, 2), *block(64, 64, 2), nn.AdaptiveAvgPool2d(1),
                                   nn.Flatten(), nn.Linear(64, embed_dim))
        self.words = nn.EmbeddingBag(len(WORDS), 64, mode="mean", padding_idx=0)
        self.text = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, embed_dim))
        self.logit_scale = nn.Parameter(torch.tensor(1 / 0.07).log())

    def encode_image(self, images: Tensor) -> Tensor:
        return F.normalize(self.image(images), dim=-1)

    def encode_text(self, tokens: Tensor) -> Tensor:
        return F.normalize(self.text(self.words(tokens)), dim=-1)

    def forward(self, images: Tensor, tokens: Tensor,
                sizes: Sequence[int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if self.mini_batch_size and self.training:  # --grad-cache M: M rows at a time, inside DDP's forward
            image = grad_cache(self.encode_image, images, mini_batch_size=self.mini_batch_size, sizes=sizes)
            text = grad_cache(self.encode_text, tokens, mini_batch_size=self.mini_batch_size, sizes=sizes)
        else:
            image, text = self.encode_image(images), self.encode_text(tokens)
        return image, text, self.logit_scale.clamp(max=math.log(100)).exp()


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, batch_size: int, device: torch.device) -> dict[str, float]:
    """Recall@1/@5 over the whole held-out split: each rank encodes its share, the metric gathers them all."""
    model.eval()
    sampler = DistributedBatchSampler(dataset, batch_size, shuffle=False)  # every sample once, in order
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))
    features = [model(images.to(device), tokens.to(device))[:2] for images, tokens, _ in loader]
    image, text = (torch.cat(parts) for parts in zip(*features))
    model.train()
    return {key: value.item() for key, value in retrieval_accuracy(image, text, top_k=(1, 5)).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=200, help="optimizer steps of the whole run")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per process per step")
    parser.add_argument("--lr", type=float, default=0.03, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--train-size", type=int, default=8192, help="generated training pairs")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, the data and their order")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="write the checkpoint every N steps")
    parser.add_argument("--grad-cache", type=int, default=0, metavar="M",
                        help="encode M rows at a time and re-encode in backward: the activation memory of M rows, "
                        "the same gradient except through BatchNorm (M-row statistics); 0: off")
    parser.add_argument("--output-dir", type=Path, default=None, help="the run's folder (its checkpoint.pt goes "
                        "there), which must not hold a run yet; default: a new runs/clip_torchrun/version_N")
    parser.add_argument("--overwrite", action="store_true", help="let --output-dir replace the run it holds")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN", help="continue a run (mid-epoch is "
                        "fine): its folder, e.g. runs/clip_torchrun/version_0, or its checkpoint.pt")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a rank waits for a hung peer, then fails")
    args = parser.parse_args()
    if args.grad_cache < 0:
        parser.error(f"--grad-cache must be >= 0, got {args.grad_cache}")

    cuda = torch.cuda.is_available()
    # torchrun sets rank, world size and the rendezvous. The timeout bounds how long a rank waits in a
    # collective for a peer that hangs without exiting (one that exits is reported at once, by name).
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # Rank 0 picks the run's folder (or refuses one that holds a run) and tells the others: every rank
    # agrees, and none lists the runs while rank 0 creates a new one.
    picked: list[tuple[Path, Path | None] | str] = [""]
    if rank == 0:
        try:
            picked = [run_folder(Path("runs/clip_torchrun"), output_dir=args.output_dir, resume=args.resume,
                                 overwrite=args.overwrite, checkpoint_name="checkpoint.pt")]
        except ValueError as error:
            picked = [f"error: {error}"]
    dist.broadcast_object_list(picked, src=0)
    if isinstance(picked[0], str):
        dist.destroy_process_group()
        sys.exit(picked[0] if rank == 0 else 1)
    args.output_dir, checkpoint = picked[0]
    torch.manual_seed(args.seed)
    # Exact global BatchNorm statistics on every backend, for any (even empty) per-rank batch.
    model = convert_sync_batchnorm(CLIP(grad_cache=args.grad_cache)).to(device)
    ddp_model = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    criterion = DistributedInfoNCE()
    train_set, held_out = Squares(args.train_size, seed=args.seed), Squares(64, seed=args.seed + 1, distinct=True)
    # Each global batch of batch_size × world size samples split evenly over the ranks: nothing dropped or repeated.
    sampler = DistributedBatchSampler(train_set, args.batch_size, seed=args.seed)
    loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=EmptySafeCollate(train_set),
                        num_workers=args.num_workers)
    step, epoch, first, resumed = 0, 0, 0, ""
    if checkpoint is not None:
        state = torch.load(checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        # The sampler's state says how much of the epoch's order is consumed, not by which rank: any number of
        # processes and any batch size continue it; the rest of the epoch is cut into this run's global batches.
        sampler.load_state_dict(state["sampler"])
        step, epoch, first = state["step"], sampler.epoch, sampler.first_step
        saved = (state["sampler"]["num_replicas"], state["sampler"]["batch_size"])
        if saved != (sampler.num_replicas, sampler.batch_size):
            same = saved[0] * saved[1] == sampler.global_batch_size
            resumed = (f"; resumed on {sampler.num_replicas} processes × {sampler.batch_size} from a run on "
                       f"{saved[0]} × {saved[1]} ({'the same global batch' if same else 'another global batch'})")

    def save(epoch: int, batches_done: int) -> None:
        if rank != 0:
            return
        # Workers prefetch, so the sampler has handed out more batches than the loop used: store the loop's count.
        position = sampler.state_dict(step=batches_done)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": position, "step": step}
        args.output_dir.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.output_dir / "checkpoint.pt")

    start = time.perf_counter()
    while step < args.max_steps:
        sampler.set_epoch(epoch)  # a new order each epoch; keeps a resumed position in this epoch
        for batch_index, (images, tokens, _) in enumerate(loader, start=first):
            # The sizes of this step on every rank: the loss (and --grad-cache) skip their size exchange.
            sizes = sampler.sizes(batch_index)
            image, text, scale = ddp_model(images.to(device), tokens.to(device), sizes=sizes)
            loss = criterion(image, text, scale, sizes=sizes)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the per-rank losses' gradients: the global batch's gradient
            optimizer.step()
            step += 1
            if step % 50 == 0 and rank == 0:
                # The global batch's loss: every rank's loss value is it (its gradient, the rank's share).
                print(f"step {step}/{args.max_steps}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f} s)")
            if step % args.checkpoint_every == 0 or step == args.max_steps:
                save(epoch, batch_index + 1)
            if step == args.max_steps:
                break
        else:
            epoch, first = epoch + 1, 0
    recall = evaluate(model, held_out, args.batch_size, device)
    if rank == 0:
        metrics = "  ".join(f"{key} {value:.3f}" for key, value in recall.items())
        print(f"held-out recall over {len(held_out)} pairs (chance R@1 {1 / len(held_out):.3f}): {metrics}")
        print(f"{step} steps in {time.perf_counter() - start:.0f} s{resumed}; checkpoint: "
              f"{args.output_dir / 'checkpoint.pt'}")
    # A clean end: no rank tears the group down while another still uses it, then the group goes. The
    # package's collectives return only once gloo has let go of their tensors, so the interpreter's
    # own exit is safe too (no "terminate called without an active exception" at exit).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
