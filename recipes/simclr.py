"""Train SimCLR with Lightning DDP, ``NTXentLoss`` and global (synchronized) BatchNorm; runs as shipped.

Two torchvision ``transforms.v2`` views per image (random resized crop, flip, colour jitter,
grayscale, blur), a torchvision ResNet for small images, a projection head with BatchNorm, and
:func:`contrastive_dist.convert_sync_batchnorm` applied to the whole model (exact global batch
statistics; ``--no-sync-bn`` to keep per-rank ones). Evaluation: weighted k-NN on the backbone
features of held-out images against a labelled bank, gathered from every rank; reported against
chance. Default data: the generated shapes on a plain background (label: the shape, one of 5;
colour, size and position are what the augmentations teach the features to ignore), no download.

One machine, CPU (2 processes, gloo) or all visible GPUs::

    python recipes/simclr.py
    python recipes/simclr.py --data cifar10:~/data --download --accelerator gpu --batch-size 512

Several machines with Lightning (run on each, NODE_RANK = 0 .. N-1)::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NODE_RANK=0 python recipes/simclr.py --num-nodes 2 --devices 8

torchrun (Lightning reads the torchelastic environment)::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        recipes/simclr.py --data imagefolder:/data/train
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from base import RecipeModule  # noqa: E402
from common import (  # noqa: E402
    base_parser,
    check_children,
    fit,
    last_values,
    make_trainer,
    metrics_path,
    plot_curves,
    print_summary,
    read_metrics,
)
from models import BACKBONES, projection_head, small_image_resnet  # noqa: E402
from simclr_data import KnnSplit, TwoViews, build, normalize, simclr_augment  # noqa: E402

from contrastive_dist import NTXentLoss, all_gather_many, convert_sync_batchnorm  # noqa: E402

METRICS = ["val/knn_accuracy"]


class ViewsCollate:
    """``(view, view, index)`` items → ``(views1, views2, indices)``; picklable."""

    def __call__(self, items: list[tuple[Tensor, Tensor, int]]) -> tuple[Tensor, Tensor, Tensor]:
        return (normalize(torch.stack([item[0] for item in items])),
                normalize(torch.stack([item[1] for item in items])),
                torch.tensor([item[2] for item in items], dtype=torch.long))


class KnnCollate:
    """``(image, label, is_query, index)`` items → tensors; picklable."""

    def __call__(self, items: list[tuple[Tensor, int, int, int]]) -> tuple[Tensor, Tensor, Tensor]:
        return (normalize(torch.stack([item[0] for item in items])),
                torch.tensor([item[1] for item in items], dtype=torch.long),
                torch.tensor([item[2] for item in items], dtype=torch.long))


def knn_accuracy(bank: Tensor, bank_labels: Tensor, queries: Tensor, query_labels: Tensor, *, classes: int,
                 k: int = 20, temperature: float = 0.1) -> float:
    """Similarity-weighted k-NN vote (as in instance-discrimination papers) on normalized features."""
    similarity, neighbours = (queries @ bank.T).topk(min(k, len(bank)), dim=1)
    weights = (similarity / temperature).exp()
    votes = torch.zeros(len(queries), classes).scatter_add_(1, bank_labels[neighbours], weights)
    return (votes.argmax(1) == query_labels).float().mean().item()


class SimCLR(RecipeModule):
    """Backbone + BatchNorm projection head; the loss pairs the two views of each image."""

    def __init__(self, *, backbone: str, width: int, hidden: int, out: int, temperature: float, sync_bn: bool,
                 classes: int, stem_stride: int = 2, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.backbone, features = small_image_resnet(backbone, width=width, stem_stride=stem_stride)
        self.head: nn.Module = projection_head(features, hidden, out)
        if sync_bn:
            self.backbone, self.head = convert_sync_batchnorm(self.backbone), convert_sync_batchnorm(self.head)
        self.loss = NTXentLoss(temperature=temperature)
        self.classes = classes
        self._val: list[tuple[Tensor, Tensor, Tensor]] = []

    def shared_step(self, batch: tuple[Tensor, Tensor, Tensor], sizes: tuple[int, ...]) -> Tensor:
        views1, views2, _ = batch
        n = views1.shape[0]
        # Both views in one forward: BatchNorm sees the 2·N images of the global batch, as in SimCLR.
        projections = self.head(self.backbone(torch.cat([views1, views2]))).float()
        return self.loss(projections[:n], projections[n:], sizes=sizes)

    def sample_ids(self, batch: tuple[Tensor, Tensor, Tensor]) -> list[int]:
        return batch[2].tolist()

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        images, labels, is_query = batch
        self._val.append((F.normalize(self.backbone(images).float(), dim=-1), labels, is_query))

    def on_validation_epoch_end(self) -> None:
        features, labels, is_query = (torch.cat(parts) for parts in zip(*self._val))
        self._val.clear()
        features, labels, is_query = all_gather_many((features, labels, is_query)).tensors
        query = is_query.bool()
        accuracy = knn_accuracy(features[~query], labels[~query], features[query], labels[query], classes=self.classes)
        self.log("val/knn_accuracy", accuracy, prog_bar=True, sync_dist=True)  # equal on all ranks


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0], batch_size=64, lr=2e-3, max_steps=200, val_every=50)
    data = parser.add_argument_group("data and model")
    data.add_argument("--data", default="shapes",
                      help="'shapes' (generated, offline), 'imagefolder:PATH', 'cifar10:ROOT'")
    data.add_argument("--download", action="store_true", help="allow downloading CIFAR-10")
    data.add_argument("--image-size", type=int, default=32)
    data.add_argument("--train-size", type=int, default=8192, help="generated training samples")
    data.add_argument("--val-size", type=int, default=500, help="held-out query images")
    data.add_argument("--bank-size", type=int, default=8192,
                      help="labelled training images for k-NN (the default: all of the generated training set)")
    data.add_argument("--background-noise", type=float, default=0.0,
                      help="shapes: background pixel noise (std); 0.04 is the CLIP recipe's")
    data.add_argument("--tint-spread", type=float, default=0.0,
                      help="shapes: range of the per-image background tint; 0.2 is the CLIP recipe's")
    data.add_argument("--min-crop", type=float, default=0.5, help="RandomResizedCrop minimum scale")
    data.add_argument("--hue", type=float, default=0.5,
                      help="ColorJitter hue range; 0.5 (any hue) makes the shape, not its colour, what views share")
    data.add_argument("--deterministic-data", action="store_true", help="no augmentation (two identical views)")
    data.add_argument("--backbone", choices=BACKBONES, default="resnet-small")
    data.add_argument("--width", type=int, default=16, help="resnet-small base width")
    data.add_argument("--stem-stride", type=int, choices=(1, 2), default=1,
                      help="resnet-small stem stride; 1 keeps full resolution for shapes a few pixels wide")
    data.add_argument("--hidden", type=int, default=256)
    data.add_argument("--out", type=int, default=64)
    data.add_argument("--temperature", type=float, default=0.5)
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or Path("runs/simclr")
    start = time.perf_counter()

    import lightning as L

    L.seed_everything(args.seed, workers=True, verbose=False)
    train, bank, queries, classes = build(args.data, image_size=args.image_size, train_size=args.train_size,
                                          val_size=args.val_size, bank_size=args.bank_size, seed=args.seed,
                                          download=args.download, background_noise=args.background_noise,
                                          tint_spread=args.tint_spread)
    augment = simclr_augment(args.image_size, min_scale=args.min_crop, hue=args.hue)
    augment = None if args.deterministic_data else augment
    model = SimCLR(
        backbone=args.backbone, width=args.width, stem_stride=args.stem_stride, hidden=args.hidden, out=args.out,
        temperature=args.temperature,
        sync_bn=not args.no_sync_bn, classes=classes, val_collate=KnnCollate(), train_set=TwoViews(train, augment),
        val_set=KnnSplit(bank, queries), collate=ViewsCollate(), batch_size=args.batch_size, seed=args.seed,
        num_workers=args.num_workers, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
    )
    trainer = make_trainer(args, monitor="val/knn_accuracy")
    fit(trainer, model, args)
    if not trainer.is_global_zero:
        return
    check_children(trainer)
    rows = read_metrics(trainer)
    files = {"metrics": metrics_path(trainer),
             "checkpoints": args.output_dir / "checkpoints"}
    if not args.no_plots:
        files["curves"] = args.output_dir / "curves.png"
        plot_curves(rows, METRICS, files["curves"], f"SimCLR on {args.data} (k-NN on held-out labels)")
    counts = torch.bincount(torch.tensor([queries.image(i)[1] for i in range(len(queries))]), minlength=classes)
    chance = {"val/knn_accuracy": counts.max().item() / len(queries)}  # majority class
    print_summary(f"SimCLR, {len(queries)} held-out queries, {classes} classes", last_values(rows, METRICS), chance,
                  time.perf_counter() - start, files, trainer.world_size)


if __name__ == "__main__":
    main()
