"""Train a small CLIP with Lightning DDP and ``DistributedInfoNCE``; runs as shipped, no download.

The default data are generated images of coloured shapes with captions that name them ("a small
red circle in the top left"); the held-out split has distinct captions, and image→text /
text→image recall@1/@5 over the whole held-out split (gathered from every rank) is reported
against chance. Image tower: a torchvision ResNet for small images; text tower: a byte-level
transformer; a learnable, log-parameterised ``logit_scale`` clamped at 100 as in CLIP.

One machine, CPU (2 processes, gloo) or all visible GPUs::

    python recipes/clip.py
    python recipes/clip.py --accelerator gpu --devices 4 --batch-size 256 --backbone resnet18

Several machines with Lightning (run on each, NODE_RANK = 0 .. N-1)::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NODE_RANK=0 python recipes/clip.py --num-nodes 2 --devices 8

torchrun (Lightning reads the torchelastic environment; devices and nodes follow it)::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        recipes/clip.py
    torchrun --standalone --nproc-per-node 2 recipes/clip.py --accelerator cpu

Real data: ``--data csv:PATH`` with ``filepath`` and ``title`` columns (tab or comma separated;
``--csv-image-column``/``--csv-caption-column`` rename them). Resume: ``--resume out/checkpoints/last.ckpt``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from base import RecipeModule  # noqa: E402
from clip_data import CaptionCollate, build_datasets  # noqa: E402
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
from models import BACKBONES, TextTransformer, small_image_resnet  # noqa: E402
from shapes import chance_recall  # noqa: E402

from contrastive_dist import DistributedInfoNCE, convert_sync_batchnorm, retrieval_accuracy  # noqa: E402

METRICS = ["val/image_to_text_r1", "val/image_to_text_r5", "val/text_to_image_r1", "val/text_to_image_r5"]


class CLIP(RecipeModule):
    """Two towers, a shared embedding space and a learnable temperature."""

    def __init__(self, *, backbone: str, width: int, text_width: int, embed_dim: int, context_length: int,
                 sync_bn: bool, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        image_tower, features = small_image_resnet(backbone, width=width)
        self.image_tower = convert_sync_batchnorm(image_tower) if sync_bn else image_tower
        self.image_projection = nn.Linear(features, embed_dim, bias=False)
        self.text_tower = TextTransformer(width=text_width, context_length=context_length)
        self.text_projection = nn.Linear(text_width, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.loss = DistributedInfoNCE()
        self._val_features: list[tuple[Tensor, Tensor]] = []

    def encode(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        image = self.image_projection(self.image_tower(images))
        text = self.text_projection(self.text_tower(tokens))
        return F.normalize(image.float(), dim=-1), F.normalize(text.float(), dim=-1)

    def shared_step(self, batch: tuple[Tensor, Tensor, Tensor], sizes: tuple[int, ...]) -> Tensor:
        images, tokens, _ = batch
        image, text = self.encode(images, tokens)
        # CLIP clamps the temperature at 100; a clamp in the graph keeps the parameter untouched.
        scale = self.logit_scale.clamp(max=math.log(100)).exp()
        self.log("train/logit_scale", scale.detach(), rank_zero_only=True)
        return self.loss(image, text, scale, sizes=sizes)

    def sample_ids(self, batch: tuple[Tensor, Tensor, Tensor]) -> list[int]:
        return batch[2].tolist()

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self._val_features.append(self.encode(batch[0], batch[1]))

    def on_validation_epoch_end(self) -> None:
        image = torch.cat([pair[0] for pair in self._val_features])
        text = torch.cat([pair[1] for pair in self._val_features])
        self._val_features.clear()
        # Every rank gathers the whole held-out split: exact recall, the same value on every rank.
        for key, value in retrieval_accuracy(image, text, top_k=(1, 5)).items():
            self.log(f"val/{key}", value, prog_bar=key.endswith("r1"), sync_dist=True)  # equal on all ranks


def retrieval_grid(model: CLIP, dataset: object, path: Path, *, count: int = 8) -> None:
    """Held-out images with their top-3 retrieved captions (green: the right one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    collate = model.collate
    items = [dataset[i] for i in range(len(dataset))]  # type: ignore[index, arg-type]
    images, tokens, _ = collate(items)
    model.eval()
    with torch.no_grad():
        image, text = model.encode(images, tokens)
    top3 = (image[:count] @ text.T).topk(3, dim=1).indices
    figure, axes = plt.subplots(2, count // 2, figsize=(3.2 * count // 2, 7))
    for i, axis in enumerate(axes.flat):
        axis.imshow(items[i][0].permute(1, 2, 0).numpy())
        axis.set_xticks([]), axis.set_yticks([])
        lines = [(items[j][1], j == i) for j in top3[i].tolist()]
        axis.set_title("\n".join(f"{k + 1}. {text}" for k, (text, _) in enumerate(lines)), fontsize=7,
                       color="green" if lines[0][1] else "red")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0], batch_size=64, lr=2e-3, max_steps=400, val_every=50)
    data = parser.add_argument_group("data and model")
    data.add_argument("--data", default="shapes", help="'shapes' (generated, offline) or 'csv:PATH'")
    data.add_argument("--csv-image-column", default="filepath")
    data.add_argument("--csv-caption-column", default="title")
    data.add_argument("--csv-separator", default=None, help="default: tab if the header has one, else comma")
    data.add_argument("--deterministic-data", action="store_true",
                      help="no random augmentation of CSV images (the generated shapes have none)")
    data.add_argument("--image-size", type=int, default=32)
    data.add_argument("--train-size", type=int, default=8192, help="generated training samples")
    data.add_argument("--val-size", type=int, default=256, help="held-out samples (distinct captions)")
    data.add_argument("--backbone", choices=BACKBONES, default="resnet-small")
    data.add_argument("--width", type=int, default=16, help="resnet-small base width")
    data.add_argument("--text-width", type=int, default=64)
    data.add_argument("--embed-dim", type=int, default=64)
    data.add_argument("--context-length", type=int, default=48, help="text tokens (UTF-8 bytes + 2)")
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or Path("runs/clip")
    start = time.perf_counter()

    import lightning as L

    L.seed_everything(args.seed, workers=True, verbose=False)
    train_set, val_set = build_datasets(
        args.data, image_size=args.image_size, train_size=args.train_size, val_size=args.val_size, seed=args.seed,
        image_column=args.csv_image_column, caption_column=args.csv_caption_column, separator=args.csv_separator,
        deterministic=args.deterministic_data,
    )
    model = CLIP(
        backbone=args.backbone, width=args.width, text_width=args.text_width, embed_dim=args.embed_dim,
        context_length=args.context_length, sync_bn=not args.no_sync_bn, train_set=train_set, val_set=val_set,
        collate=CaptionCollate(context_length=args.context_length), batch_size=args.batch_size, seed=args.seed,
        num_workers=args.num_workers, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
    )
    trainer = make_trainer(args, monitor="val/image_to_text_r1")
    fit(trainer, model, args)
    if not trainer.is_global_zero:
        return
    check_children(trainer)
    rows = read_metrics(trainer)
    files = {"metrics": metrics_path(trainer),
             "checkpoints": args.output_dir / "checkpoints"}
    if not args.no_plots:
        files["curves"] = args.output_dir / "curves.png"
        plot_curves(rows, METRICS, files["curves"], f"CLIP on {args.data}")
        files["retrievals"] = args.output_dir / "retrievals.png"
        retrieval_grid(model.cpu(), val_set, files["retrievals"])
    n = len(val_set)  # type: ignore[arg-type]
    chance = {key: chance_recall(int(key[-1]), n) for key in METRICS}
    print_summary(f"CLIP, held-out split of {n}", last_values(rows, METRICS), chance,
                  time.perf_counter() - start, files, trainer.world_size)


if __name__ == "__main__":
    main()
