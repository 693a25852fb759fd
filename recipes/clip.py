"""Train a small CLIP with Lightning DDP and DistributedInfoNCE; runs as shipped, no download.

The default data are generated images of coloured shapes whose captions name them ("a small red
circle in the top left", :mod:`contrastive_dist.shapes`). Image tower: a small torchvision ResNet;
text tower: a byte-level transformer; a learnable ``logit_scale`` clamped at 100 as in CLIP.
Held-out image→text / text→image recall@1/@5 over the whole split (gathered from every rank) is
reported against chance, counted by id: a query is right when one of its k best answers has its id
(its caption's, or the CSV's id column). Each run writes to a new ``runs/clip/version_N``.

One machine, CPU (2 processes, gloo) or all visible GPUs::

    python recipes/clip.py
    python recipes/clip.py --accelerator gpu --devices 4 --batch-size 256 --backbone resnet18
    python recipes/clip.py --max-steps 600 --resume runs/clip/version_0    # continue a run

Several machines with Lightning (run on each, NODE_RANK = 0 .. N-1)::

    MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NODE_RANK=0 python recipes/clip.py --num-nodes 2 --devices 8

torchrun (Lightning reads the torchelastic environment; devices and nodes follow it)::

    torchrun --nnodes 2 --nproc-per-node 8 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        recipes/clip.py
    torchrun --standalone --nproc-per-node 2 recipes/clip.py --accelerator cpu

Real data: ``--data csv:PATH`` (columns ``filepath``, ``title`` and, optionally, ``id``) or
``--data webdataset:PATH`` (``.tar`` shards as img2dataset writes them; ``--write-shards DIR``
writes the shapes as shards to try it). Repeated captions: ``--caption-ids mask`` (see ``--help``).
Several captions per image: ``--several-captions`` with a CSV that repeats an image's path or lists
its captions as JSON in one cell.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from shared import BACKBONES, NORMS, parser_for, training_flags

DATA_KINDS = ("shapes", "csv", "webdataset")


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The flags; a bad ``--data`` ends here, in one line, before torch and Lightning are imported."""
    parser = parser_for(__doc__)
    training_flags(parser, batch_size=64, lr=2e-3, max_steps=400, val_every=50)
    data = parser.add_argument_group("data and model")
    data.add_argument("--data", default="shapes", help="shapes (generated, offline), csv:PATH (a CSV or TSV file "
                      "of image paths and captions), or webdataset:PATH (a directory or brace pattern of .tar "
                      "shards whose samples hold an image, jpg, jpeg, png or webp, and a caption, txt)")
    data.add_argument("--val-data", default=None, help="webdataset: held-out shards (directory or brace pattern); "
                      "default: the last shard of --data")
    data.add_argument("--fixed-shard-order", action="store_true",
                      help="webdataset: the same shard order every epoch (reproducible comparisons)")
    data.add_argument("--write-shards", type=Path, default=None, metavar="DIR", help="write the generated shapes "
                      "as .tar shards to DIR and exit; then train on them with --data webdataset:DIR")
    data.add_argument("--shard-size", type=int, default=1000, help="training pairs per shard for --write-shards")
    data.add_argument("--csv-image-column", default="filepath", help="CSV column of image paths (relative to the CSV)")
    data.add_argument("--csv-caption-column", default="title", help="CSV column of captions")
    data.add_argument("--csv-id-column", default="id", help="CSV column of pair ids (a label, a group): used as "
                      "the loss's ids= when the CSV has it; integers as they are, other values hashed")
    data.add_argument("--csv-separator", default=None, help="default: tab if the header has one, else comma")
    data.add_argument("--several-captions", action="store_true", help="csv: rows that share an image path (or a "
                      "caption cell holding a JSON list) train as one image with all of its captions, each a "
                      "positive of its image alone (image_ids= and text_ids=); held-out recall stays per row")
    data.add_argument("--deterministic-data", action="store_true",
                      help="no random augmentation of CSV images (the generated shapes have none)")
    data.add_argument("--image-size", type=int, default=32, help="image side in pixels")
    data.add_argument("--train-size", type=int, default=8192, help="generated training samples")
    data.add_argument("--val-size", type=int, default=256,
                      help="held-out samples (shapes: distinct attributes; CSV: the last rows)")
    data.add_argument("--duplicate-captions", type=fraction, default=0.0, metavar="F",
                      help="shapes only: caption every image of a fraction F of the 30 colour-shape kinds by its "
                      "kind alone ('a red circle', 'A red circle.'), in both splits, as web alt-text repeats")
    data.add_argument("--caption-ids", choices=("none", "mask", "positive"), default=None,
                      help="ids for the loss (ids=), on any --data: the CSV's id column when it has one, else a "
                      "hash of the caption (case and punctuation aside); mask: pairs with the same id are not each "
                      "other's negatives; positive: they are each other's positives. Without ids, a caption that "
                      "appears k times in a global batch keeps the loss at about log(k) or more. Default: mask "
                      "when the CSV has an id column, else none")
    data.add_argument("--backbone", choices=BACKBONES, default="resnet-small", help="image tower")
    data.add_argument("--norm", choices=NORMS, default="batch",
                      help="the image tower's normalization; group: no batch statistics, so --grad-cache is exact")
    data.add_argument("--width", type=int, default=16, help="resnet-small base width")
    data.add_argument("--text-width", type=int, default=64, help="text transformer width")
    data.add_argument("--embed-dim", type=int, default=64, help="shared embedding dimension")
    data.add_argument("--context-length", type=int, default=48, help="text tokens (UTF-8 bytes + 2)")
    args = parser.parse_args(argv)
    kind, _, location = args.data.partition(":")
    args.csv_ids = False
    if kind not in DATA_KINDS:
        sys.exit(f"error: --data must be one of {DATA_KINDS} (with ':PATH' where needed), got {args.data!r}")
    if args.duplicate_captions and kind != "shapes":
        sys.exit(f"error: --duplicate-captions changes the generated shapes' captions; --data is {args.data!r}")
    if args.shard_size < 1:
        sys.exit(f"error: --shard-size must be >= 1, got {args.shard_size}")
    if kind == "csv":
        if not Path(location).expanduser().is_file():
            sys.exit(f"error: --data csv:{location}: no such file; give a CSV or TSV file whose header names the "
                     f"image-path and caption columns ({args.csv_image_column!r}, {args.csv_caption_column!r})")
        with open(Path(location).expanduser()) as file:
            header = file.readline().strip()
        args.csv_ids = args.csv_id_column in header.split("\t" if "\t" in header else ",")
    if args.several_captions and (kind != "csv" or args.caption_ids not in (None, "none")):
        sys.exit("error: --several-captions takes --data csv:PATH, and its positives come from the images: "
                 f"no --caption-ids (got --data {args.data!r}, --caption-ids {args.caption_ids})")
    args.caption_ids = "none" if args.several_captions else args.caption_ids or ("mask" if args.csv_ids else "none")
    return args


if __name__ == "__main__":
    parse_args(None)  # --help and bad flags answer at once: the imports below take seconds

import math
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from shared import make_trainer, optimizer_and_schedule
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchvision.transforms import v2

from contrastive_dist import DistributedInfoNCE, all_gather_many, convert_sync_batchnorm, grad_cache
from contrastive_dist.lightning import distributed_loader, step_sizes, streaming_loader
from contrastive_dist.lightning.image_captions import CaptionsCollate, CsvImageCaptions, captions_by_image
from contrastive_dist.lightning.image_text import CaptionCollate, CsvImageText, csv_rows, shard_stream, write_shards
from contrastive_dist.lightning.report import report_run
from contrastive_dist.lightning.retrieval import recall_by_chance, recall_by_id, retrieval_grid
from contrastive_dist.lightning.runs import check_global_batch, run_folder
from contrastive_dist.lightning.towers import TextTransformer, small_image_resnet
from contrastive_dist.lightning.training import fit
from contrastive_dist.shapes import ShapesDataset

# -- data -----------------------------------------------------------------------------------------


def transforms(args: argparse.Namespace) -> tuple[v2.Transform, v2.Transform]:
    """(training, held-out) transforms of real images to uint8 ``(3, S, S)``; training ones augment."""
    to_uint8 = [v2.ToImage(), v2.ToDtype(torch.uint8, scale=True)]
    held_out = v2.Compose([v2.Resize(args.image_size, antialias=True), v2.CenterCrop(args.image_size), *to_uint8])
    augment = v2.Compose([v2.RandomResizedCrop(args.image_size, scale=(0.7, 1.0), antialias=True), *to_uint8])
    return held_out if args.deterministic_data else augment, held_out


def shapes_data(location: str, args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    options = {"image_size": args.image_size, "seed": args.seed, "duplicate_captions": args.duplicate_captions}
    return ShapesDataset("train", size=args.train_size, **options), ShapesDataset("val", size=args.val_size, **options)


def csv_data(location: str, args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """open_clip's CSV layout, with an optional id column; the last ``--val-size`` rows are held out."""
    path = Path(location).expanduser()
    rows, args.csv_ids = csv_rows(path, image_column=args.csv_image_column, caption_column=args.csv_caption_column,
                                  id_column=args.csv_id_column, separator=args.csv_separator)
    if len(rows) <= args.val_size:
        raise ValueError(f"{path} has {len(rows)} rows, but the last --val-size={args.val_size} are held out and "
                         "training needs at least one more: add rows or lower --val-size")
    train, held_out = transforms(args)
    held_out_set = CsvImageText(rows[-args.val_size :], path.parent, held_out)
    if args.several_captions:  # an image and all of its training captions a sample
        return CsvImageCaptions(captions_by_image(rows[: -args.val_size]), path.parent, train), held_out_set
    return CsvImageText(rows[: -args.val_size], path.parent, train), held_out_set


def webdataset_data(location: str, args: argparse.Namespace) -> tuple[Any, list[tuple[Tensor, str, int]]]:
    """Training shards streamed; the first ``--val-size`` samples of ``--val-data`` (or of the last shard) held out."""
    if args.max_steps <= 0 and args.optimizer == "adamw":
        raise ValueError("--data webdataset: has no length to plan the learning-rate schedule: give --max-steps")
    try:
        from importlib.metadata import version

        found = version("webdataset")
    except ImportError:
        found = "none"
    if found == "none" or tuple(int(part) for part in found.split(".")[:3]) < (0, 2, 96):
        raise ValueError(f"--data webdataset: needs webdataset 0.2.96 or later (its tar reader keeps shards apart), "
                         f"found {found}: pip install 'contrastive-dist[webdataset]'")
    urls, stages, val_set = shard_stream(location, held_out=args.val_data, held_out_size=args.val_size,
                                         transform=transforms(args)[0], held_out_transform=transforms(args)[1])
    return (urls, stages, val_set[0]), val_set


# --data KIND[:LOCATION] → (train, held-out); a new source is one function and one entry here.
DATA_SOURCES = {"shapes": shapes_data, "csv": csv_data, "webdataset": webdataset_data}

# -- model ----------------------------------------------------------------------------------------


def unit_rows(features: Tensor) -> Tensor:
    """Rows of length 1, in float32 at least (bf16 under autocast becomes float32; float64 stays)."""
    return F.normalize(features.to(torch.promote_types(features.dtype, torch.float32)), dim=-1)


class CLIP(L.LightningModule):
    """Two towers, a shared embedding space and a learnable temperature."""

    def __init__(self, args: argparse.Namespace, train_set: Any, val_set: Any) -> None:
        super().__init__()
        self.args, self.train_set, self.val_set = args, train_set, val_set
        image_tower, features = small_image_resnet(args.backbone, width=args.width, norm=args.norm)
        self.image_tower = image_tower if args.no_sync_bn else convert_sync_batchnorm(image_tower)
        self.image_projection = nn.Linear(features, args.embed_dim, bias=False)
        self.text_tower = TextTransformer(width=args.text_width, context_length=args.context_length)
        self.text_projection = nn.Linear(args.text_width, args.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        same_id = "positive" if args.caption_ids == "positive" else "mask"
        self.loss = DistributedInfoNCE(communication=args.communication, same_id=same_id)
        self.collate = CaptionCollate(args.context_length, id_field=2 if getattr(args, "csv_ids", False) else None)
        self.train_collate = CaptionsCollate(args.context_length) if args.several_captions else self.collate
        self.top_k = (1, 5) if len(val_set) >= 5 else (1,)
        self.val_features: list[tuple[Tensor, Tensor, Tensor]] = []

    def train_dataloader(self) -> Any:
        args = self.args
        if isinstance(self.train_set, tuple):  # --data webdataset:PATH: (urls, stages, an example sample)
            urls, stages, example = self.train_set
            return streaming_loader(urls, self.trainer, *stages, batch_size=args.batch_size, example=example,
                                    collate_fn=self.collate, shuffle=not args.fixed_shard_order, seed=args.seed,
                                    num_workers=args.num_workers)
        return distributed_loader(self.train_set, self.trainer, batch_size=args.batch_size, seed=args.seed,
                                  collate_fn=self.train_collate, num_workers=args.num_workers)

    def val_dataloader(self) -> Any:
        return distributed_loader(self.val_set, self.trainer, batch_size=self.args.batch_size, shuffle=False,
                                  collate_fn=self.collate, num_workers=self.args.num_workers)

    def encode_image(self, images: Tensor) -> Tensor:
        return unit_rows(self.image_projection(self.image_tower(images)))

    def encode_text(self, tokens: Tensor) -> Tensor:
        return unit_rows(self.text_projection(self.text_tower(tokens)))

    def encode(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        return self.encode_image(images), self.encode_text(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        images, tokens, ids, text_ids = batch  # the last step of an epoch may leave this rank 0 rows
        sizes = step_sizes(self.trainer, batch_idx)  # the images' (--several-captions: each has its own texts)
        several = self.args.several_captions
        if self.args.grad_cache:  # --grad-cache M: each tower encodes M rows at a time, re-encoded in backward
            image = grad_cache(self.encode_image, images, mini_batch_size=self.args.grad_cache, sizes=sizes)
            text = grad_cache(self.encode_text, tokens, mini_batch_size=self.args.grad_cache,
                              sizes=None if several else sizes)
        else:
            image, text = self.encode(images, tokens)
        scale = self.logit_scale.clamp(max=math.log(100)).exp()  # CLIP's clamp, inside the graph
        # Every rank gets the single-process loss of the global batch (its gradient: this rank's share); with
        # --caption-ids, pairs that share an id, on any rank, are not each other's negatives.
        # --several-captions: each caption a positive of its image alone, wherever either is.
        pairs = {"image_ids": ids, "text_ids": text_ids} if several else {
            "ids": None if self.args.caption_ids == "none" else ids}
        loss = self.loss(image, text, scale, sizes=sizes, **pairs)
        self.log("train/loss", loss.detach(), prog_bar=True)  # the global loss as it is: no sync_dist needed
        self.log_dict({"train/logit_scale": scale.detach(), "train/samples": float(sum(sizes))}, rank_zero_only=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self.val_features.append((*self.encode(batch[0], batch[1]), batch[2]))

    def on_validation_epoch_end(self) -> None:
        local = [torch.cat(parts) for parts in zip(*self.val_features)]
        self.val_features.clear()
        # Every rank gathers the whole held-out split (uneven shares too): the same recall on every rank.
        image, text, ids = all_gather_many(local).tensors
        for key, value in recall_by_id(image, text, ids, top_k=self.top_k).items():
            self.log(f"val/{key}", value, prog_bar=key.endswith("r1"), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return optimizer_and_schedule(self, self.args)


def main(argv: Sequence[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True, verbose=False)
    if args.write_shards is not None:
        paths = write_shards(args.write_shards, *shapes_data("", args), shard_size=args.shard_size, prefix="shapes")
        print(f"wrote {len(paths)} shards ({len(paths) - 1} training, the last held out) to {args.write_shards}; "
              f"train with: python {sys.argv[0]} --data webdataset:{args.write_shards}")
        return
    kind, _, location = args.data.partition(":")
    try:  # the data first: a run that cannot start leaves no folder
        train_set, val_set = DATA_SOURCES[kind](location, args)
        args.output_dir, checkpoint = run_folder(Path("runs/clip"), output_dir=args.output_dir, resume=args.resume,
                                                 overwrite=args.overwrite)
    except (OSError, ValueError) as error:
        sys.exit(f"error: {error}")
    model = CLIP(args, train_set, val_set)
    trainer = make_trainer(args, monitor="val/image_to_text_r1", callbacks=callbacks)
    if trainer.is_global_zero:
        check_global_batch(args.batch_size * trainer.world_size, negatives=args.batch_size * trainer.world_size - 1,
                           advice="raise --batch-size or --devices (the global batch is --batch-size × processes)")
    if not fit(trainer, model, checkpoint):
        return
    items = [val_set[i] for i in range(len(val_set))]
    images, tokens, ids, _ = model.collate(items)
    chance = {f"val/{key}": value for key, value in recall_by_chance(ids, model.top_k).items()}
    files: dict[str, Path] = {}
    if not args.no_plots:
        files["retrievals"] = args.output_dir / "retrievals.png"
        model.cpu().eval()
        with torch.no_grad():
            image, text = model.encode(images, tokens)
        retrieval_grid(torch.stack([item[0] for item in items]), [item[1] for item in items], image @ text.T, ids,
                       files["retrievals"])
    counted = "the CSV's id column" if args.csv_ids else "caption"
    report_run(args.output_dir, trainer, chance, title=f"CLIP, held-out split of {len(val_set)}, recall by "
               f"{counted}", plot_title=None if args.no_plots else f"CLIP on {args.data}",
               seconds=time.perf_counter() - start, files=files)


if __name__ == "__main__":
    main()
