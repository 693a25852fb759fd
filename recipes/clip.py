"""Train a small CLIP with Lightning DDP and ``DistributedInfoNCE``; runs as shipped, no download.

The default data are generated images of coloured shapes with captions that name them ("a small
red circle in the top left"); image→text / text→image recall@1/@5 over the whole held-out split
(gathered from every rank) is reported against chance. Recall counts by caption: a query is a hit
when one of its k best answers carries the query's caption (any copy of it), which is ordinary
recall when captions are distinct (the default held-out split). Image tower: a torchvision ResNet
for small images; text tower: a byte-level transformer; a learnable, log-parameterised
``logit_scale`` clamped at 100 as in CLIP. Loading is drop-last-free and resumable mid-epoch
(``contrastive_dist.lightning``). Read this file and ``shared.py`` (shapes, backbone, flags,
Trainer, report).

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
``--csv-image-column``/``--csv-caption-column`` rename them); the last ``--val-size`` rows are held
out. Resume: ``--resume runs/clip/checkpoints/last.ckpt`` (mid-epoch is fine, on another number of
devices too: keep ``--batch-size`` × devices to continue with the very same global batches). Batches
beyond what the activations allow: ``--grad-cache M`` encodes M rows at a time and re-encodes them in backward
(``contrastive_dist.grad_cache``; exact with ``--norm group``, BatchNorm sees M-row statistics).

Repeated captions, as web data has them: ``--duplicate-captions 0.5`` captions every image of half
the colour-shape kinds by its kind alone ("a red circle", "A red circle."), in both splits;
``--caption-ids mask`` passes each pair's caption id to the loss (``ids=``: a hash of the caption up
to case and punctuation), so pairs with the same caption are not each other's negatives;
``--caption-ids positive`` makes them each other's positives (``same_id="positive"``)::

    python recipes/clip.py --duplicate-captions 0.5 --caption-ids mask

Sharded streams: ``--data webdataset:PATH``, PATH a directory of ``.tar`` shards or a brace pattern
(``shards/{000000..000999}.tar``; URLs and ``pipe:`` commands as webdataset reads them). Each sample
is the files of one key in a shard: an image (``jpg``, ``jpeg``, ``png`` or ``webp``) and its caption
(``txt``), as img2dataset writes them; a numeric key is the sample's id in the logs. Each rank and
DataLoader worker reads its own shards, a new order each epoch; a rank that runs out trains on
empty batches until every rank has (``contrastive_dist.lightning.streaming_loader``); ``--resume``
continues mid-epoch with the samples not yet consumed, on any number of devices and workers. The
first ``--val-size`` samples of ``--val-data PATH`` are held out (default: of the last shard, which is
then not trained on). No download needed to try it::

    python recipes/clip.py --write-shards shards/            # the shapes data as .tar shards
    python recipes/clip.py --data webdataset:shards/
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from shared import (
    BACKBONES,
    NORMS,
    ShapesDataset,
    fit,
    make_trainer,
    normalize,
    optimizer_and_schedule,
    plot_curves,
    print_summary,
    read_metrics,
    small_image_resnet,
    training_flags,
)
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchvision.transforms import v2

from contrastive_dist import DistributedInfoNCE, all_gather_many, convert_sync_batchnorm, grad_cache
from contrastive_dist.lightning import distributed_loader, step_sizes, streaming_loader

# -- data -----------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 3..258) between begin (1) and end (2), padded with 0: no vocabulary."""

    pad, begin, end, vocab_size = 0, 1, 2, 259

    def __init__(self, context_length: int) -> None:
        self.context_length = context_length

    def __call__(self, texts: list[str]) -> Tensor:
        tokens = torch.full((len(texts), self.context_length), self.pad, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [self.begin, *(byte + 3 for byte in text.encode()[: self.context_length - 2]), self.end]
            tokens[row, : len(ids)] = torch.tensor(ids)
        return tokens


def caption_id(text: str) -> int:
    """The caption's id, in [0, 2**63): a hash of its words, so case, punctuation and spacing do not count.

    BLAKE2 gives every process the same id (Python's ``hash`` of a string differs between processes);
    with 63 bits, two different captions share an id with probability ~1e-19 per pair.
    """
    words = " ".join(re.findall(r"\w+", text.lower()))
    return int.from_bytes(hashlib.blake2b(words.encode(), digest_size=8).digest(), "little") >> 1


class CaptionCollate:
    """``(image uint8, caption, ..., index)`` items → ``(images, tokens, caption ids, indices)``; picklable."""

    def __init__(self, context_length: int) -> None:
        self.tokenize = ByteTokenizer(context_length)

    def __call__(self, items: list[tuple[Any, ...]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        images = normalize(torch.stack([item[0] for item in items]))
        captions = [item[1] for item in items]
        ids = torch.tensor([caption_id(text) for text in captions], dtype=torch.long)
        return images, self.tokenize(captions), ids, torch.tensor([item[-1] for item in items])


class CsvCaptions(Dataset):
    """``(image uint8 (3, S, S), caption, index)`` from rows ``(image path, caption)``; paths relative to ``root``."""

    def __init__(self, rows: list[tuple[str, str]], root: Path, transform: v2.Transform) -> None:
        self.rows, self.root, self.transform = rows, root, transform

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Tensor, str, int]:
        from PIL import Image

        path, text = self.rows[index]
        with Image.open(self.root / path) as image:
            return self.transform(image.convert("RGB")), text, index


def shapes_data(location: str, args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    options = {"image_size": args.image_size, "seed": args.seed, "duplicate_captions": args.duplicate_captions}
    return ShapesDataset("train", size=args.train_size, **options), ShapesDataset("val", size=args.val_size, **options)


def csv_data(location: str, args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """open_clip's CSV layout; the last ``--val-size`` rows are held out. Errors say how to fix the input."""
    path = Path(location).expanduser()
    if not path.is_file():
        raise ValueError(f"--data csv:{location}: no such file; give a CSV or TSV file whose header names the "
                         f"image-path and caption columns ({args.csv_image_column!r}, {args.csv_caption_column!r})")
    with open(path, newline="") as file:
        delimiter = args.csv_separator or ("\t" if "\t" in file.readline() else ",")
        file.seek(0)
        reader = csv.DictReader(file, delimiter=delimiter)
        columns = (args.csv_image_column, args.csv_caption_column)
        if not set(columns) <= set(reader.fieldnames or []):
            raise ValueError(f"{path}: expected columns {columns} in the header, found {reader.fieldnames}; "
                             "rename them with --csv-image-column and --csv-caption-column")
        rows = [(row[columns[0]], row[columns[1]]) for row in reader]
    if len(rows) <= args.val_size:
        raise ValueError(f"{path} has {len(rows)} rows, but the last --val-size={args.val_size} are held out and "
                         "training needs at least one more: add rows or lower --val-size")
    to_uint8 = [v2.ToImage(), v2.ToDtype(torch.uint8, scale=True)]
    held_out = v2.Compose([v2.Resize(args.image_size, antialias=True), v2.CenterCrop(args.image_size), *to_uint8])
    augment = v2.Compose([v2.RandomResizedCrop(args.image_size, scale=(0.7, 1.0), antialias=True), *to_uint8])
    train = held_out if args.deterministic_data else augment
    return (CsvCaptions(rows[: -args.val_size], path.parent, train),
            CsvCaptions(rows[-args.val_size :], path.parent, held_out))


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


class WebDatasetPair:
    """A decoded webdataset sample → ``(image uint8 (3, S, S), caption, id)``; picklable for workers.

    The id is the sample's key as an int when it is a number (img2dataset's keys are), else -1.
    """

    def __init__(self, transform: v2.Transform) -> None:
        self.transform = transform

    def __call__(self, sample: dict[str, Any]) -> tuple[Tensor, str, int]:
        image = next((sample[key] for key in IMAGE_EXTENSIONS if key in sample), None)
        if image is None or not isinstance(sample.get("txt"), str):
            raise ValueError(f"sample {sample.get('__key__')!r} of {sample.get('__url__')}: expected an image "
                             f"({', '.join(IMAGE_EXTENSIONS)}) and a caption (txt), found {sorted(sample)}")
        key = str(sample["__key__"]).rsplit("/", 1)[-1]
        return self.transform(image.convert("RGB")), sample["txt"], int(key) if key.isdigit() else -1


@dataclass
class Shards:
    """The training shards of a stream; ``train_dataloader`` reads them through ``streaming_loader``."""

    urls: list[str]
    pair: WebDatasetPair
    example: tuple[Tensor, str, int]

    def loader(self, trainer: L.Trainer, args: argparse.Namespace, collate: CaptionCollate) -> Any:
        import webdataset as wds

        return streaming_loader(self.urls, trainer, wds.tarfile_to_samples(), wds.decode("pil"), wds.map(self.pair),
                                batch_size=args.batch_size, example=self.example, collate_fn=collate,
                                shuffle=not args.fixed_shard_order, seed=args.seed, num_workers=args.num_workers)


def shard_urls(location: str) -> list[str]:
    """A directory's ``*.tar`` files (sorted), or a brace pattern's expansion; local files must exist."""
    import braceexpand  # a dependency of webdataset

    path = Path(location).expanduser()
    urls = sorted(map(str, path.glob("*.tar"))) if path.is_dir() else list(braceexpand.braceexpand(location))
    missing = [url for url in urls if "://" not in url and not url.startswith("pipe:") and not Path(url).is_file()]
    if not urls or missing:
        raise ValueError(f"webdataset:{location}: expected a directory of .tar shards or a brace pattern of shard "
                         f"files, found {len(urls)} shard(s)" + (f", {len(missing)} missing: {missing[0]}" if missing
                                                                 else ""))
    return urls


def webdataset_data(location: str, args: argparse.Namespace) -> tuple[Shards, list[tuple[Tensor, str, int]]]:
    """Training shards streamed; the first ``--val-size`` samples of ``--val-data`` (or of the last shard) held out."""
    import webdataset as wds

    if args.max_steps <= 0 and args.optimizer == "adamw":
        raise ValueError("--data webdataset: has no length to plan the learning-rate schedule: give --max-steps")
    urls = shard_urls(location)
    held_out_urls = shard_urls(args.val_data) if args.val_data else urls[-1:]
    urls = urls if args.val_data else urls[:-1]
    if not urls:
        raise ValueError(f"webdataset:{location} has one shard, held out for evaluation: add shards or --val-data")
    to_uint8 = [v2.ToImage(), v2.ToDtype(torch.uint8, scale=True)]
    held_out = v2.Compose([v2.Resize(args.image_size, antialias=True), v2.CenterCrop(args.image_size), *to_uint8])
    augment = v2.Compose([v2.RandomResizedCrop(args.image_size, scale=(0.7, 1.0), antialias=True), *to_uint8])
    reader = wds.DataPipeline(wds.SimpleShardList(held_out_urls), wds.tarfile_to_samples(), wds.decode("pil"),
                              wds.map(WebDatasetPair(held_out)))
    val_set = list(islice(reader, args.val_size))
    if not val_set:
        raise ValueError(f"the held-out shards {held_out_urls[:3]} hold no sample")
    pair = WebDatasetPair(held_out if args.deterministic_data else augment)
    return Shards(urls, pair, val_set[0]), val_set


def write_shards(directory: Path, args: argparse.Namespace) -> list[Path]:
    """The generated shapes as webdataset shards: ``--shard-size`` training pairs a shard, then the held-out split.

    Keys are the sample ids (held-out ids follow the training ones); images are lossless PNG.
    """
    import webdataset as wds

    train, val = shapes_data("", args)
    directory.mkdir(parents=True, exist_ok=True)
    groups = [(train, range(start, min(start + args.shard_size, len(train))))
              for start in range(0, len(train), args.shard_size)] + [(val, range(len(val)))]
    paths, key = [], 0
    for number, (dataset, indices) in enumerate(groups):
        paths.append(directory / f"shapes-{number:06d}.tar")
        with wds.TarWriter(str(paths[-1])) as sink:
            for index in indices:
                image, text = dataset[index][:2]
                sink.write({"__key__": f"{key:09d}", "png": image.permute(1, 2, 0).numpy(), "txt": text})
                key += 1
    return paths


# --data KIND[:LOCATION] → (train, held-out); a new source is one function and one entry here.
DATA_SOURCES: dict[str, Callable[[str, argparse.Namespace], tuple[Any, Any]]] = {
    "shapes": shapes_data,
    "csv": csv_data,
    "webdataset": webdataset_data,
}

# -- model ----------------------------------------------------------------------------------------


class TextTransformer(nn.Module):
    """A small pre-norm transformer over byte tokens, pooled at the end token as in CLIP: (n, L) → (n, width)."""

    def __init__(self, *, width: int, context_length: int, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(ByteTokenizer.vocab_size, width)
        self.position = nn.Parameter(torch.randn(context_length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.shape[0] == 0:
            # Attention cannot take 0 rows; one padding row keeps every parameter in the graph (DDP
            # needs this rank's backward to reach them) and is sliced away.
            return self.forward(tokens.new_full((1, tokens.shape[1]), ByteTokenizer.end))[:0]
        x = self.encoder(self.embed(tokens) + self.position, src_key_padding_mask=tokens == ByteTokenizer.pad)
        end = (tokens == ByteTokenizer.end).float().argmax(dim=1)
        return self.norm(x[torch.arange(tokens.shape[0]), end])


class CLIP(L.LightningModule):
    """Two towers, a shared embedding space and a learnable temperature."""

    def __init__(self, args: argparse.Namespace, train_set: Dataset | Shards, val_set: Any) -> None:
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
        self.collate = CaptionCollate(args.context_length)
        self.top_k = (1, 5) if len(val_set) >= 5 else (1,)  # type: ignore[arg-type]
        self.val_features: list[tuple[Tensor, Tensor, Tensor]] = []
        self.chance = recall_by_chance(torch.arange(len(val_set)), self.top_k)  # type: ignore[arg-type]

    def train_dataloader(self) -> Any:
        if isinstance(self.train_set, Shards):  # --data webdataset:PATH
            return self.train_set.loader(self.trainer, self.args, self.collate)
        return distributed_loader(self.train_set, self.trainer, batch_size=self.args.batch_size, seed=self.args.seed,
                                  collate_fn=self.collate, num_workers=self.args.num_workers)

    def val_dataloader(self) -> Any:
        return distributed_loader(self.val_set, self.trainer, batch_size=self.args.batch_size, shuffle=False,
                                  collate_fn=self.collate, num_workers=self.args.num_workers)

    def encode_image(self, images: Tensor) -> Tensor:
        return F.normalize(self.image_projection(self.image_tower(images)).float(), dim=-1)

    def encode_text(self, tokens: Tensor) -> Tensor:
        return F.normalize(self.text_projection(self.text_tower(tokens)).float(), dim=-1)

    def encode(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        return self.encode_image(images), self.encode_text(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor, Tensor, Tensor], batch_idx: int) -> Tensor:
        images, tokens, captions, _ = batch  # the last step of an epoch may leave this rank 0 rows
        sizes = step_sizes(self.trainer, batch_idx)
        if self.args.grad_cache:  # --grad-cache M: each tower encodes M rows at a time, re-encoded in backward
            image = grad_cache(self.encode_image, images, mini_batch_size=self.args.grad_cache, sizes=sizes)
            text = grad_cache(self.encode_text, tokens, mini_batch_size=self.args.grad_cache, sizes=sizes)
        else:
            image, text = self.encode(images, tokens)
        scale = self.logit_scale.clamp(max=math.log(100)).exp()  # CLIP's clamp, inside the graph
        # The mean over ranks of the per-rank losses is the single-process loss of the global batch; with
        # --caption-ids, pairs that share a caption, on any rank, are not each other's negatives.
        loss = self.loss(image, text, scale, sizes=sizes, ids=None if self.args.caption_ids == "none" else captions)
        self.log("train/loss", loss.detach(), sync_dist=True, prog_bar=True)
        self.log("train/logit_scale", scale.detach(), rank_zero_only=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor, Tensor, Tensor], batch_idx: int) -> None:
        self.val_features.append((*self.encode(batch[0], batch[1]), batch[2]))

    def on_validation_epoch_end(self) -> None:
        local = [torch.cat(parts) for parts in zip(*self.val_features)]
        self.val_features.clear()
        # Every rank gathers the whole held-out split (uneven shares too): the same recall on every rank.
        image, text, captions = all_gather_many(local).tensors
        for key, value in recall_by_caption(image, text, captions, top_k=self.top_k).items():
            self.log(f"val/{key}", value, prog_bar=key.endswith("r1"), sync_dist=True)
        self.chance = recall_by_chance(captions, self.top_k)

    def configure_optimizers(self) -> Any:
        return optimizer_and_schedule(self, self.args)


# -- held-out recall, by caption ------------------------------------------------------------------


def recall_by_caption(image: Tensor, text: Tensor, captions: Tensor, *, top_k: Sequence[int]) -> dict[str, Tensor]:
    """Recall@k of each image among the texts and of each text among the images, counted by caption.

    A query is a hit at ``k`` when fewer than ``k`` answers *with another caption* score strictly
    higher than its best answer with its own caption: an image that finds any copy of its caption
    is right, and so is a text that finds any image it captions; none of the runs is rewarded or
    penalised for how it orders copies of one caption. With distinct captions this is
    :func:`contrastive_dist.retrieval_accuracy` (ties count for the query there too).

    Shape:
        image, text: ``(N, D)``, row ``i`` a pair; captions: ``(N,)`` int64 caption ids.
    """
    same = captions[:, None] == captions[None, :]
    recall = {}
    for name, scores in (("image_to_text", image @ text.T), ("text_to_image", text @ image.T)):
        best_right = scores.masked_fill(~same, -math.inf).amax(dim=1, keepdim=True)
        wrong_above = (scores.masked_fill(same, -math.inf) > best_right).sum(dim=1)
        recall.update({f"{name}_r{k}": (wrong_above < k).to(scores.dtype).mean() for k in top_k})
    return recall


def recall_by_chance(captions: Tensor, top_k: Sequence[int]) -> dict[str, float]:
    """:func:`recall_by_caption` of a random order: a query with ``m`` right answers among ``N`` misses at ``k``
    with probability ``C(N - m, k) / C(N, k)``; the same in both directions."""
    _, inverse, counts = torch.unique(captions, return_inverse=True, return_counts=True)
    n, right = len(captions), counts[inverse].tolist()
    return {f"val/{direction}_r{k}": sum(1 - math.comb(n - m, k) / math.comb(n, k) for m in right) / n
            for direction in ("image_to_text", "text_to_image") for k in top_k}


def retrieval_grid(model: CLIP, dataset: Any, path: Path, *, panels: int = 8) -> None:
    """Held-out images with their top-3 retrieved captions: right ones marked, the true one shown if missed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    items = [dataset[i] for i in range(len(dataset))]
    images, tokens, *_ = model.collate(items)
    model.eval()
    with torch.no_grad():
        image, text = model.encode(images, tokens)
    panels, top = min(panels, len(items)), min(3, len(items))
    retrieved = (image[:panels] @ text.T).topk(top, dim=1).indices.tolist()
    columns = min(panels, 4)
    rows = -(-panels // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(max(3.3 * columns, 8), 3.6 * rows + 0.7), squeeze=False)
    for axis in axes.flat:
        axis.axis("off")
    for i, axis in enumerate(axes.flat[:panels]):
        axis.imshow(items[i][0].permute(1, 2, 0).numpy(), interpolation="nearest")
        right = [caption_id(items[j][1]) == caption_id(items[i][1]) for j in retrieved[i]]  # any copy counts
        lines = [(f"{'✓' if hit else '✗'} {k + 1}. {items[j][1][:42]}", "green" if hit else "dimgray")
                 for k, (j, hit) in enumerate(zip(retrieved[i], right))]
        if not any(right):
            lines.append((f"true: {items[i][1][:42]}", "crimson"))
        for row, (line, colour) in enumerate(lines):
            axis.text(0.0, -0.05 - 0.1 * row, line, transform=axis.transAxes, va="top", fontsize=7, color=colour)
    figure.suptitle(f"held-out images and their top-{top} retrieved captions\n✓ green: the right caption (any copy)   "
                    "✗ grey: a wrong one   red 'true:': the right caption, when it is not among them", fontsize=9)
    figure.subplots_adjust(left=0.02, right=0.98, top=0.86, bottom=0.12, hspace=0.75, wspace=0.15)
    figure.savefig(path, dpi=110, bbox_inches="tight")  # the caption lines sit below the axes
    plt.close(figure)


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    training_flags(parser, batch_size=64, lr=2e-3, max_steps=400, val_every=50)
    data = parser.add_argument_group("data and model")
    data.add_argument("--data", default="shapes", help="'shapes' (generated, offline), 'csv:PATH', or "
                      "'webdataset:PATH': a directory or brace pattern of .tar shards whose samples hold an image "
                      "(jpg, jpeg, png or webp) and a caption (txt), as img2dataset writes them")
    data.add_argument("--val-data", default=None, help="webdataset: held-out shards (directory or brace pattern); "
                      "default: the last shard of --data")
    data.add_argument("--fixed-shard-order", action="store_true",
                      help="webdataset: the same shard order every epoch (reproducible comparisons)")
    data.add_argument("--write-shards", type=Path, default=None, metavar="DIR",
                      help="write the generated shapes (--train-size, --val-size) as .tar shards to DIR and exit; "
                      "then train on them with --data webdataset:DIR")
    data.add_argument("--shard-size", type=int, default=1000, help="training pairs per shard for --write-shards")
    data.add_argument("--csv-image-column", default="filepath", help="CSV column of image paths (relative to the CSV)")
    data.add_argument("--csv-caption-column", default="title", help="CSV column of captions")
    data.add_argument("--csv-separator", default=None, help="default: tab if the header has one, else comma")
    data.add_argument("--deterministic-data", action="store_true",
                      help="no random augmentation of CSV images (the generated shapes have none)")
    data.add_argument("--image-size", type=int, default=32, help="image side in pixels")
    data.add_argument("--train-size", type=int, default=8192, help="generated training samples")
    data.add_argument("--val-size", type=int, default=256,
                      help="held-out samples (shapes: distinct attributes; CSV: the last rows)")
    data.add_argument("--duplicate-captions", type=fraction, default=0.0, metavar="F",
                      help="shapes: caption every image of a fraction F of the 30 colour-shape kinds by its kind "
                      "alone ('a red circle', 'A red circle.'), in both splits, as web alt-text repeats one caption "
                      "for many images")
    data.add_argument("--caption-ids", choices=("none", "mask", "positive"), default="none",
                      help="give the loss each pair's caption id (ids=; case and punctuation aside): pairs with the "
                      "same caption are not each other's negatives (mask) or are each other's positives (positive)")
    data.add_argument("--backbone", choices=BACKBONES, default="resnet-small", help="image tower")
    data.add_argument("--norm", choices=NORMS, default="batch",
                      help="the image tower's normalization; group: no batch statistics, so --grad-cache is exact")
    data.add_argument("--width", type=int, default=16, help="resnet-small base width")
    data.add_argument("--text-width", type=int, default=64, help="text transformer width")
    data.add_argument("--embed-dim", type=int, default=64, help="shared embedding dimension")
    data.add_argument("--context-length", type=int, default=48, help="text tokens (UTF-8 bytes + 2)")
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir or Path("runs/clip")
    return args


def main(argv: Sequence[str] | None = None, callbacks: Sequence[L.Callback] = ()) -> None:
    start = time.perf_counter()
    args = parse_args(argv)
    L.seed_everything(args.seed, workers=True, verbose=False)
    if args.write_shards is not None:
        if args.shard_size < 1:
            sys.exit(f"error: --shard-size must be >= 1, got {args.shard_size}")
        paths = write_shards(args.write_shards, args)
        print(f"wrote {len(paths)} shards ({len(paths) - 1} training, the last held out) to {args.write_shards}; "
              f"train with: python {sys.argv[0]} --data webdataset:{args.write_shards}")
        return
    kind, _, location = args.data.partition(":")
    if kind not in DATA_SOURCES:
        sys.exit(f"error: --data must be one of {sorted(DATA_SOURCES)} (with ':PATH' where needed), got {args.data!r}")
    if args.duplicate_captions and kind != "shapes":
        sys.exit(f"error: --duplicate-captions changes the generated shapes' captions; --data is {args.data!r}")
    try:
        train_set, val_set = DATA_SOURCES[kind](location, args)
    except (OSError, ValueError) as error:
        sys.exit(f"error: {error}")
    model = CLIP(args, train_set, val_set)
    trainer = make_trainer(args, monitor="val/image_to_text_r1", callbacks=callbacks)
    if not fit(trainer, model, args):
        return
    files = {"metrics": Path(trainer.loggers[0].log_dir or ".") / "metrics.csv",
             "checkpoints": args.output_dir / "checkpoints"}
    rows = read_metrics(args.output_dir)
    if not args.no_plots:
        files["curves"] = args.output_dir / "curves.png"
        plot_curves(rows, list(model.chance), files["curves"], f"CLIP on {args.data}")
        files["retrievals"] = args.output_dir / "retrievals.png"
        retrieval_grid(model.cpu(), val_set, files["retrievals"])
    print_summary(f"CLIP, held-out split of {len(val_set)}", rows, model.chance, trainer=trainer,
                  seconds=time.perf_counter() - start, files=files)


if __name__ == "__main__":
    main()
