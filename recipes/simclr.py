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
    moco.add_argument("--queue-size", type=int, default=0, help="keys of past global batches used as extra "
                      "negatives, with a momentum key encoder; 0: plain SimCLR")
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

import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from einops import rearrange
from shared import make_trainer, optimizer_and_schedule
from torch import Tensor, nn
from torch.utils.data import Dataset

from contrastive_dist import DistributedInfoNCE, DistributedMemoryQueue, NTXentLoss, convert_sync_batchnorm, grad_cache
from contrastive_dist.lightning import distributed_loader, step_sizes
from contrastive_dist.lightning.knn import KnnSplit, majority_rate, split_knn_accuracy
from contrastive_dist.lightning.labelled_images import cifar10_splits, image_folder_splits, shapes_splits
from contrastive_dist.lightning.momentum import momentum_contrast_loss, momentum_copy, momentum_update_
from contrastive_dist.lightning.report import report_run
from contrastive_dist.lightning.runs import check_global_batch, run_folder
from contrastive_dist.lightning.towers import projection_head, small_image_resnet
from contrastive_dist.lightning.training import fit
from contrastive_dist.lightning.views import TwoViews, image_collate, simclr_augment

# -- data -----------------------------------------------------------------------------------------


def labelled_data(kind: str, location: str, args: argparse.Namespace) -> tuple[Dataset, Dataset, Dataset, int]:
    """``--data KIND[:LOCATION]`` → (train, k-NN bank, k-NN queries, classes); a new source is one branch here."""
    sizes = {"image_size": args.image_size, "val_size": args.val_size, "bank_size": args.bank_size, "seed": args.seed}
    if kind == "cifar10":
        return cifar10_splits(location, download=args.download, **sizes)
    if kind == "imagefolder":
        return image_folder_splits(location, **sizes)
    # A plain background by default: a per-image tint or noise pattern, shared by an image's two
    # views, would let the loss tell images apart without looking at the shape.
    return shapes_splits(train_size=args.train_size, background_noise=args.background_noise,
                         tint_spread=args.tint_spread, **sizes)


# -- model ----------------------------------------------------------------------------------------


def embed(backbone: nn.Module, head: nn.Module, images: Tensor) -> Tensor:
    """``(m, C, H, W)`` → ``(m, D)``; half precision is computed in float32 from here on (float64 stays).

    Both views go in one batch of 2·n images: BatchNorm sees the 2·N images of the global batch, as in SimCLR.
    """
    projections = head(backbone(images))
    return projections.to(torch.promote_types(projections.dtype, torch.float32))


class SimCLR(L.LightningModule):
    """Backbone + BatchNorm projection head; the loss pairs the two views of each image.

    Default: NT-Xent over the 2·N views of the global batch. With ``--queue-size K`` > 0, MoCo v2's recipe
    (:mod:`contrastive_dist.lightning.momentum`: why, and the loss, symmetrised as in MoCo v3): a momentum
    encoder embeds both views as keys; each view's queries pick the other view's key among the N keys of the
    global batch and the ``K`` queued keys of past batches. Its weights and the queue live in this module, so
    checkpoints carry both and a resumed run continues exactly. Its BatchNorm is global (synchronized) unless
    ``--no-sync-bn``: SimCLR's answer to the leak through per-device batch statistics that "shuffle BN" avoids.
    """

    def __init__(self, args: argparse.Namespace, train_set: Dataset, val_set: Dataset, classes: int) -> None:
        super().__init__()
        self.args, self.train_set, self.val_set, self.classes = args, train_set, val_set, classes
        self.backbone, features = small_image_resnet(args.backbone, width=args.width, stem_stride=args.stem_stride)
        self.head = projection_head(features, hidden=args.hidden, out=args.out)
        if not args.no_sync_bn:  # exact global BatchNorm statistics, as SimCLR's "global BN"
            self.backbone, self.head = convert_sync_batchnorm(self.backbone), convert_sync_batchnorm(self.head)
        self.loss: nn.Module = NTXentLoss(temperature=args.temperature, communication=args.communication)
        if args.queue_size > 0:
            self.key_backbone, self.key_head = momentum_copy(self.backbone), momentum_copy(self.head)
            self.queue = DistributedMemoryQueue(args.queue_size, args.out)
            self.loss = DistributedInfoNCE(temperature=args.temperature, symmetric=False,
                                           communication=args.communication)
        self.val_parts: list[tuple[Tensor, Tensor, Tensor]] = []

    def train_dataloader(self) -> Any:
        return distributed_loader(self.train_set, self.trainer, batch_size=self.args.batch_size, seed=self.args.seed,
                                  collate_fn=image_collate, num_workers=self.args.num_workers)

    def val_dataloader(self) -> Any:
        return distributed_loader(self.val_set, self.trainer, batch_size=self.args.batch_size, shuffle=False,
                                  collate_fn=image_collate, num_workers=self.args.num_workers)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        views1, views2, _ = batch  # the last step of an epoch may leave this rank 0 images
        views = rearrange([views1, views2], "view n c h w -> (view n) c h w")
        sizes = step_sizes(self.trainer, batch_idx)
        if self.args.grad_cache:  # --grad-cache M: M images at a time (BatchNorm sees M-image statistics)
            flat = grad_cache(self.embed_views, views, mini_batch_size=self.args.grad_cache,
                              sizes=[2 * size for size in sizes])
        else:
            flat = self.embed_views(views)
        projections = rearrange(flat, "(view n) d -> view n d", view=2)
        loss = (self.momentum_contrast(projections, views, sizes) if self.args.queue_size
                else self.loss(projections[0], projections[1], sizes=sizes))
        self.log("train/loss", loss.detach(), prog_bar=True)  # the global batch's loss on every rank
        self.log("train/samples", float(sum(sizes)), rank_zero_only=True)
        return loss

    def momentum_contrast(self, projections: Tensor, views: Tensor, sizes: Sequence[int]) -> Tensor:
        """The symmetrised MoCo loss against the queue; then the view-2 keys join the queue on every rank."""
        # MoCo's order: the key encoder moves towards the query encoder after its last optimizer
        # step, then embeds. Here, not in a hook after the step: the checkpoint callbacks run before
        # a module's own end-of-step hook, so a resumed run would miss one.
        momentum_update_(self.key_backbone, self.backbone, momentum=self.args.momentum)
        momentum_update_(self.key_head, self.head, momentum=self.args.momentum)
        with torch.no_grad():
            keys = rearrange(embed(self.key_backbone, self.key_head, views), "(view n) d -> view n d", view=2)
        loss = momentum_contrast_loss(self.loss, projections, keys, self.queue, sizes=sizes)
        self.log("train/queue_fill", float(len(self.queue)), rank_zero_only=True)
        return loss

    def embed_views(self, views: Tensor) -> Tensor:
        return embed(self.backbone, self.head, views)

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        images, labels, is_query = batch
        self.val_parts.append((F.normalize(self.backbone(images).float(), dim=-1), labels, is_query))

    def on_validation_epoch_end(self) -> None:
        features, labels, is_query = (torch.cat(parts) for parts in zip(*self.val_parts))
        self.val_parts.clear()
        accuracy = split_knn_accuracy(features, labels, is_query, classes=self.classes)  # every rank's share
        self.log("val/knn_accuracy", accuracy, prog_bar=True, sync_dist=True)  # the same on every rank

    def configure_optimizers(self) -> Any:
        return optimizer_and_schedule(self, self.args)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True, verbose=False)
    kind, _, location = args.data.partition(":")
    try:  # the data first: a run that cannot start leaves no folder
        train, bank, queries, classes = labelled_data(kind, location, args)
        args.output_dir, checkpoint = run_folder(Path("runs/simclr"), output_dir=args.output_dir,
                                                 resume=args.resume, overwrite=args.overwrite)
    except (OSError, ValueError, RuntimeError) as error:  # torchvision: RuntimeError for a missing CIFAR-10
        sys.exit(f"error: {error}")
    augment = None if args.deterministic_data else simclr_augment(args.image_size, min_crop=args.min_crop, hue=args.hue)
    model = SimCLR(args, TwoViews(train, augment), KnnSplit(bank, queries), classes)
    trainer = make_trainer(args, monitor="val/knn_accuracy", callbacks=callbacks)
    if trainer.is_global_zero:  # NT-Xent: each view meets the 2·N - 2 views of the other images
        global_batch = args.batch_size * trainer.world_size
        check_global_batch(global_batch, negatives=2 * global_batch - 2,
                           advice="raise --batch-size or --devices (the global batch is --batch-size × processes)")
    if not fit(trainer, model, checkpoint):
        return
    labels = torch.tensor([queries[i][1] for i in range(len(queries))])
    chance = {"val/knn_accuracy": majority_rate(labels, classes)}
    report_run(args.output_dir, trainer, chance, title=f"SimCLR, {len(queries)} held-out queries, {classes} classes",
               plot_title=None if args.no_plots else f"SimCLR on {args.data} (k-NN on held-out labels)",
               seconds=time.perf_counter() - start)


if __name__ == "__main__":
    main()
