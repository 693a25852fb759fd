"""Train SimCLR with Lightning DDP, ``NTXentLoss`` and global (synchronized) BatchNorm; runs as shipped.

Two torchvision ``transforms.v2`` views per image (random resized crop, flip, colour jitter,
grayscale, blur), a torchvision ResNet for small images, a projection head with BatchNorm, and
:func:`contrastive_dist.convert_sync_batchnorm` applied to the whole model (exact global batch
statistics; ``--no-sync-bn`` to keep per-rank ones). Evaluation: weighted k-NN on the backbone
features of held-out images against a labelled bank, gathered from every rank; reported against
the majority class. Default data: the generated shapes on a plain background (label: the shape,
one of 5; colour, size and position are what the augmentations teach the features to ignore), no
download. Loading is drop-last-free and resumable mid-epoch (``contrastive_dist.lightning``).
Each run writes to a new ``runs/simclr/version_N`` (``--resume`` names the run to continue).

``--queue-size K`` trains the MoCo v2 way instead: keys from a momentum (EMA) copy of the encoder,
and a :class:`contrastive_dist.DistributedMemoryQueue` of the last ``K`` keys of the global batches
as extra negatives (see :class:`SimCLR`). ``--communication ring`` sends the NT-Xent embeddings
round the ring instead of gathering them (same loss and gradients, per-rank memory independent of
the number of processes). ``--grad-cache M`` encodes M images at a time without keeping activations
and re-encodes them in backward (``contrastive_dist.grad_cache``; BatchNorm then sees M-image statistics).

One machine, CPU (2 processes, gloo) or all visible GPUs::

    python recipes/simclr.py
    python recipes/simclr.py --queue-size 4096
    python recipes/simclr.py --data cifar10:~/data --download --accelerator gpu --batch-size 512

Several machines with Lightning (run on each, NODE_RANK = 0 .. N-1)::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NODE_RANK=0 python recipes/simclr.py --num-nodes 2 --devices 8

torchrun (Lightning reads the torchelastic environment)::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        recipes/simclr.py --data imagefolder:/data/train
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from shared import BACKBONES, parser_for, training_flags

DATA_KINDS = ("shapes", "cifar10", "imagefolder")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = parser_for(__doc__)
    training_flags(parser, batch_size=64, lr=2e-3, max_steps=200, val_every=50)
    data = parser.add_argument_group("data and model")
    data.add_argument("--data", default="shapes", help="'shapes' (generated, offline), 'imagefolder:PATH', "
                      "'cifar10:ROOT'")
    data.add_argument("--download", action="store_true", help="allow downloading CIFAR-10")
    data.add_argument("--image-size", type=int, default=32, help="image side in pixels")
    data.add_argument("--train-size", type=int, default=8192, help="generated training samples")
    data.add_argument("--val-size", type=int, default=500, help="held-out query images")
    data.add_argument("--bank-size", type=int, default=8192,
                      help="labelled training images for k-NN; default: 8192, all of the generated training set")
    data.add_argument("--background-noise", type=float, default=0.0,
                      help="shapes: background pixel noise (std); 0.04 is the CLIP recipe's")
    data.add_argument("--tint-spread", type=float, default=0.0,
                      help="shapes: range of the per-image background tint; 0.2 is the CLIP recipe's")
    data.add_argument("--min-crop", type=float, default=0.5, help="RandomResizedCrop minimum scale")
    data.add_argument("--hue", type=float, default=0.5,
                      help="ColorJitter hue range; 0.5 (any hue) makes the shape, not its colour, what views share")
    data.add_argument("--deterministic-data", action="store_true", help="no augmentation (two identical views)")
    data.add_argument("--backbone", choices=BACKBONES, default="resnet-small", help="image backbone")
    data.add_argument("--width", type=int, default=16, help="resnet-small base width")
    data.add_argument("--stem-stride", type=int, choices=(1, 2), default=1,
                      help="resnet-small stem stride; 1 keeps full resolution for shapes a few pixels wide")
    data.add_argument("--hidden", type=int, default=256, help="projection head hidden width")
    data.add_argument("--out", type=int, default=64, help="projection dimension")
    data.add_argument("--temperature", type=float, default=0.5, help="NT-Xent (or, with a queue, InfoNCE) temperature")
    moco = parser.add_argument_group("memory queue (MoCo v2 style)")
    moco.add_argument("--queue-size", type=int, default=0,
                      help="keys of past global batches used as extra negatives, with a momentum key encoder; "
                      "0: plain SimCLR")
    moco.add_argument("--momentum", type=float, default=0.99,
                      help="key encoder EMA momentum with --queue-size (MoCo uses 0.999 for runs of 10^5+ steps)")
    args = parser.parse_args(argv)
    if args.queue_size < 0 or not 0 <= args.momentum < 1:
        parser.error(f"expected --queue-size >= 0 and --momentum in [0, 1), got {args.queue_size} and {args.momentum}")
    kind = args.data.partition(":")[0]
    if kind not in DATA_KINDS:
        sys.exit(f"error: --data must be one of {DATA_KINDS} (with ':PATH' where needed), got {args.data!r}")
    return args


if __name__ == "__main__":
    parse_args(None)  # --help and bad flags answer at once: the imports below take seconds

import copy
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange
from shared import make_trainer, optimizer_and_schedule, small_image_resnet
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchvision.transforms import v2

from contrastive_dist import (
    DistributedInfoNCE,
    DistributedMemoryQueue,
    NTXentLoss,
    all_gather_many,
    convert_sync_batchnorm,
    grad_cache,
)
from contrastive_dist.lightning import distributed_loader, step_sizes
from contrastive_dist.lightning.report import plot_curves, print_summary, read_metrics
from contrastive_dist.lightning.runs import check_global_batch, run_folder
from contrastive_dist.lightning.training import fit
from contrastive_dist.shapes import SHAPES, ShapesDataset, normalize

# -- data -----------------------------------------------------------------------------------------


class Images(Dataset):
    """``(uint8 image (3, S, S), label)`` from shapes, an ImageFolder or CIFAR-10, restricted to ``indices``."""

    def __init__(self, source: Any, indices: Sequence[int], image_size: int) -> None:
        self.source, self.indices = source, list(indices)
        self.to_tensor = v2.Compose([v2.ToImage(), v2.ToDtype(torch.uint8, scale=True),
                                     v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        item = self.source[self.indices[index]]
        image = item[0] if isinstance(item[0], Tensor) else self.to_tensor(item[0])
        return image, int(item[2] if isinstance(self.source, ShapesDataset) else item[1])


class TwoViews(Dataset):
    """Training items ``(view, view, index)``; ``augment=None`` gives two identical views."""

    def __init__(self, images: Images, augment: v2.Transform | None) -> None:
        self.images, self.augment = images, augment

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor, int]:
        image, _ = self.images[index]
        if self.augment is None:
            return image, image, index
        return self.augment(image), self.augment(image), index


class KnnSplit(Dataset):
    """Evaluation items ``(image, label, is_query)``: the labelled bank first, then the queries."""

    def __init__(self, bank: Images, queries: Images) -> None:
        self.bank, self.queries = bank, queries

    def __len__(self) -> int:
        return len(self.bank) + len(self.queries)

    def __getitem__(self, index: int) -> tuple[Tensor, int, int]:
        is_query = index >= len(self.bank)
        image, label = self.queries[index - len(self.bank)] if is_query else self.bank[index]
        return image, label, int(is_query)


def collate(items: list[tuple[Any, ...]]) -> tuple[Tensor, ...]:
    """Field by field: uint8 images → normalised float batches, ints → int64 tensors; picklable for workers."""
    return tuple(normalize(torch.stack(field)) if isinstance(field[0], Tensor) else torch.tensor(field)
                 for field in zip(*items))


def simclr_augment(args: argparse.Namespace) -> v2.Transform:
    """SimCLR's view distribution on uint8 tensors; ``--hue 0.5`` (any hue) stops colour telling images apart."""
    return v2.Compose([
        v2.RandomResizedCrop(args.image_size, scale=(args.min_crop, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, args.hue)], p=0.8),
        v2.RandomGrayscale(p=0.2),
        v2.RandomApply([v2.GaussianBlur(3, sigma=(0.1, 2.0))], p=0.5),
    ])


def shapes_data(location: str, args: argparse.Namespace) -> tuple[Images, Images, Images, int]:
    # A plain background by default: a per-image tint or noise pattern, shared by an image's two
    # views, would let the loss tell images apart without looking at the shape.
    background = {"background_noise": args.background_noise, "tint_spread": args.tint_spread}
    train = ShapesDataset("train", size=args.train_size, image_size=args.image_size, seed=args.seed, **background)
    held_out = ShapesDataset("val", size=args.val_size, image_size=args.image_size, seed=args.seed, **background)
    return (Images(train, range(args.train_size), args.image_size),
            Images(train, range(min(args.bank_size, args.train_size)), args.image_size),
            Images(held_out, range(args.val_size), args.image_size), len(SHAPES))


def cifar10_data(location: str, args: argparse.Namespace) -> tuple[Images, Images, Images, int]:
    import torchvision

    train = torchvision.datasets.CIFAR10(location, train=True, download=args.download)
    test = torchvision.datasets.CIFAR10(location, train=False, download=args.download)
    bank = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))[: args.bank_size]
    return (Images(train, range(len(train)), args.image_size), Images(train, bank.tolist(), args.image_size),
            Images(test, range(min(args.val_size, len(test))), args.image_size), 10)


def imagefolder_data(location: str, args: argparse.Namespace) -> tuple[Images, Images, Images, int]:
    import torchvision

    folder = torchvision.datasets.ImageFolder(Path(location).expanduser())
    order = torch.randperm(len(folder), generator=torch.Generator().manual_seed(args.seed)).tolist()
    if len(order) <= args.val_size:
        raise ValueError(f"{location} has {len(order)} images; need more than --val-size={args.val_size}: "
                         "add images or lower --val-size")
    train, queries = order[: -args.val_size], order[-args.val_size :]
    return (Images(folder, train, args.image_size), Images(folder, train[: args.bank_size], args.image_size),
            Images(folder, queries, args.image_size), len(folder.classes))


# --data KIND[:LOCATION] → (train, k-NN bank, k-NN queries, classes); a new source is one function and one entry.
DATA_SOURCES: dict[str, Callable[[str, argparse.Namespace], tuple[Images, Images, Images, int]]] = {
    "shapes": shapes_data,
    "cifar10": cifar10_data,
    "imagefolder": imagefolder_data,
}

# -- model ----------------------------------------------------------------------------------------


def knn_accuracy(bank: Tensor, bank_labels: Tensor, queries: Tensor, query_labels: Tensor, *, classes: int,
                 k: int = 20, temperature: float = 0.1) -> float:
    """Similarity-weighted k-NN vote (as in instance-discrimination papers) on normalised features."""
    similarity, neighbours = (queries @ bank.T).topk(min(k, len(bank)), dim=1)
    weights = (similarity / temperature).exp()
    votes = weights.new_zeros(len(queries), classes).scatter_add_(1, bank_labels[neighbours], weights)
    return (votes.argmax(1) == query_labels).float().mean().item()


def embed(backbone: nn.Module, head: nn.Module, images: Tensor) -> Tensor:
    """``(m, C, H, W)`` → ``(m, D)`` projections; half precision is computed in float32 from here on (float64 stays)."""
    projections = head(backbone(images))
    return projections.to(torch.promote_types(projections.dtype, torch.float32))


def project(backbone: nn.Module, head: nn.Module, views: Tensor) -> Tensor:
    """``(2·n, C, H, W)`` views, both views of the step in one forward → ``(2, n, D)`` projections.

    One forward for both views: BatchNorm sees the 2·N images of the global batch, as in SimCLR.
    """
    return rearrange(embed(backbone, head, views), "(view n) d -> view n d", view=2)


class SimCLR(L.LightningModule):
    """Backbone + BatchNorm projection head; the loss pairs the two views of each image.

    Default: NT-Xent over the 2·N views of the global batch. With ``--queue-size K`` > 0, MoCo v2's
    recipe, its loss symmetrised as in MoCo v3: the query encoder (backbone + head, trained) embeds
    both views, a momentum encoder (an EMA of the query encoder, no gradient) embeds them as keys, and each
    view's queries must pick the key of the other view among the N keys of the global batch and
    the ``K`` queued keys of past batches (:func:`contrastive_dist.info_nce` with
    ``symmetric=False`` and ``negatives=queue.negatives``); then the view-2 keys are enqueued.

    Why a momentum encoder rather than queueing the query encoder's own detached embeddings: the
    queue holds keys from up to ``K / N`` steps ago, and they are useful negatives only while they
    stay comparable with today's keys; MoCo's ablation (momentum 0) fails to train for that reason.
    The EMA copy changes slowly, costs one no-grad forward per step, and its weights, like the
    queue's buffers, live in this module, so checkpoints carry both and a resumed run continues
    exactly. Its BatchNorm is global (synchronized) like the query encoder's unless ``--no-sync-bn``:
    SimCLR's answer to the leak through per-device batch statistics that MoCo's "shuffle BN" avoids.
    """

    def __init__(self, args: argparse.Namespace, train_set: Dataset, val_set: Dataset, classes: int) -> None:
        super().__init__()
        self.args, self.train_set, self.val_set, self.classes = args, train_set, val_set, classes
        self.backbone, features = small_image_resnet(args.backbone, width=args.width, stem_stride=args.stem_stride)
        self.head: nn.Module = nn.Sequential(nn.Linear(features, args.hidden, bias=False), nn.BatchNorm1d(args.hidden),
                                             nn.ReLU(inplace=True), nn.Linear(args.hidden, args.out))
        if not args.no_sync_bn:  # exact global BatchNorm statistics, as SimCLR's "global BN"
            self.backbone, self.head = convert_sync_batchnorm(self.backbone), convert_sync_batchnorm(self.head)
        self.loss: nn.Module = NTXentLoss(temperature=args.temperature, communication=args.communication)
        if args.queue_size > 0:
            self.key_backbone, self.key_head = copy.deepcopy(self.backbone), copy.deepcopy(self.head)
            self.key_backbone.requires_grad_(False)
            self.key_head.requires_grad_(False)
            self.queue = DistributedMemoryQueue(args.queue_size, args.out)
            self.loss = DistributedInfoNCE(
                temperature=args.temperature, symmetric=False, communication=args.communication
            )
        self.val_parts: list[tuple[Tensor, Tensor, Tensor]] = []

    def train_dataloader(self) -> Any:
        return distributed_loader(self.train_set, self.trainer, batch_size=self.args.batch_size, seed=self.args.seed,
                                  collate_fn=collate, num_workers=self.args.num_workers)

    def val_dataloader(self) -> Any:
        return distributed_loader(self.val_set, self.trainer, batch_size=self.args.batch_size, shuffle=False,
                                  collate_fn=collate, num_workers=self.args.num_workers)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        views1, views2, _ = batch  # the last step of an epoch may leave this rank 0 images
        views = rearrange([views1, views2], "view n c h w -> (view n) c h w")
        sizes = step_sizes(self.trainer, batch_idx)
        if self.args.grad_cache:  # --grad-cache M: M images at a time (BatchNorm sees M-image statistics)
            flat = grad_cache(self.embed_views, views, mini_batch_size=self.args.grad_cache,
                              sizes=[2 * size for size in sizes])
            projections = rearrange(flat, "(view n) d -> view n d", view=2)
        else:
            projections = project(self.backbone, self.head, views)
        if self.args.queue_size == 0:
            loss = self.loss(projections[0], projections[1], sizes=sizes)
        else:
            loss = self.momentum_contrast(projections, views, sizes)
        self.log("train/loss", loss.detach(), sync_dist=True, prog_bar=True)
        self.log("train/samples", float(sum(sizes)), rank_zero_only=True)
        return loss

    def momentum_contrast(self, projections: Tensor, views: Tensor, sizes: Sequence[int]) -> Tensor:
        """The symmetrised MoCo loss against the queue; then the view-2 keys join the queue on every rank."""
        with torch.no_grad():
            # MoCo's order: the key encoder moves towards the query encoder after its last
            # optimizer step, then embeds. Here, not in a hook after the step: the checkpoint
            # callbacks run before a module's own end-of-step hook, so a resumed run would miss one.
            momentum = self.args.momentum
            for key, query in zip(self.key_parameters(), self.query_parameters(), strict=True):
                key.lerp_(query.detach(), 1 - momentum)
            keys = F.normalize(project(self.key_backbone, self.key_head, views), dim=-1)
        queries = F.normalize(projections, dim=-1)
        negatives = self.queue.negatives  # the past batches only: taken before this step's enqueue
        loss = (self.loss(queries[0], keys[1], sizes=sizes, negatives=negatives)
                + self.loss(queries[1], keys[0], sizes=sizes, negatives=negatives)) / 2
        self.queue.enqueue(keys[1])
        self.log("train/queue_fill", float(len(self.queue)), rank_zero_only=True)
        return loss

    def embed_views(self, views: Tensor) -> Tensor:
        return embed(self.backbone, self.head, views)

    def query_parameters(self) -> list[nn.Parameter]:
        return [*self.backbone.parameters(), *self.head.parameters()]

    def key_parameters(self) -> list[nn.Parameter]:
        return [*self.key_backbone.parameters(), *self.key_head.parameters()]

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        images, labels, is_query = batch
        self.val_parts.append((F.normalize(self.backbone(images).float(), dim=-1), labels, is_query))

    def on_validation_epoch_end(self) -> None:
        features, labels, is_query = (torch.cat(parts) for parts in zip(*self.val_parts))
        self.val_parts.clear()
        features, labels, is_query = all_gather_many((features, labels, is_query)).tensors  # every rank's share
        query = is_query.bool()
        accuracy = knn_accuracy(features[~query], labels[~query], features[query], labels[query], classes=self.classes)
        self.log("val/knn_accuracy", accuracy, prog_bar=True, sync_dist=True)  # the same on every rank

    def configure_optimizers(self) -> Any:
        return optimizer_and_schedule(self, self.args)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True, verbose=False)
    kind, _, location = args.data.partition(":")
    try:  # the data first: a run that cannot start leaves no folder
        train, bank, queries, classes = DATA_SOURCES[kind](location, args)
        args.output_dir, checkpoint = run_folder(Path("runs/simclr"), output_dir=args.output_dir,
                                                 resume=args.resume, overwrite=args.overwrite)
    except (OSError, ValueError, RuntimeError) as error:  # torchvision: RuntimeError for a missing CIFAR-10
        sys.exit(f"error: {error}")
    augment = None if args.deterministic_data else simclr_augment(args)
    model = SimCLR(args, TwoViews(train, augment), KnnSplit(bank, queries), classes)
    trainer = make_trainer(args, monitor="val/knn_accuracy", callbacks=callbacks)
    if trainer.is_global_zero:  # NT-Xent: each view meets the 2·N - 2 views of the other images
        global_batch = args.batch_size * trainer.world_size
        check_global_batch(global_batch, negatives=2 * global_batch - 2,
                           advice="raise --batch-size or --devices (the global batch is --batch-size × processes)")
    if not fit(trainer, model, checkpoint):
        return
    labels = torch.tensor([queries[i][1] for i in range(len(queries))])
    chance = {"val/knn_accuracy": torch.bincount(labels, minlength=classes).max().item() / len(queries)}  # majority
    files = {"run": args.output_dir, "metrics": Path(trainer.loggers[0].log_dir or ".") / "metrics.csv"}
    rows = read_metrics(args.output_dir)
    if not args.no_plots:
        files["curves"] = args.output_dir / "curves.png"
        plot_curves(rows, list(chance), files["curves"], f"SimCLR on {args.data} (k-NN on held-out labels)")
    print_summary(f"SimCLR, {len(queries)} held-out queries, {classes} classes", rows, chance, trainer=trainer,
                  seconds=time.perf_counter() - start, files=files)


if __name__ == "__main__":
    main()
