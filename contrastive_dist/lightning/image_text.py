"""Image–caption pairs from a CSV file or from webdataset shards, and the shards of a dataset.

* A CSV (or TSV) file in open_clip's layout: :func:`csv_rows` reads its image paths, captions and
  ids (an optional id column; else a hash of the caption, :func:`caption_id`), and
  :class:`CsvImageText` loads the images.
* Shards as img2dataset writes them: each sample is the files of one key in a ``.tar``, an image
  (``jpg``, ``jpeg``, ``png`` or ``webp``) and its caption (``txt``). :func:`shard_urls` lists a
  directory or expands a brace pattern; :class:`ImageText` turns a decoded sample into
  ``(image, caption, id)`` for :func:`contrastive_dist.lightning.streaming_loader`;
  :func:`write_shards` writes ``(image, caption, ...)`` items as such shards (webdataset needed).
* :class:`CaptionCollate` batches any of these items (or the generated shapes) for a CLIP step:
  normalised images, byte tokens, ids and indices.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> folder = Path(tempfile.mkdtemp())
    >>> for name in ("b.tar", "a.tar"): (folder / name).touch()
    >>> [Path(url).name for url in shard_urls(str(folder))]
    ['a.tar', 'b.tar']
"""

from __future__ import annotations

import csv
import hashlib
import re
from collections.abc import Callable, Sequence
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from contrastive_dist.lightning.towers import ByteTokenizer
from contrastive_dist.shapes import normalize

__all__ = ["CaptionCollate", "CsvImageText", "ImageText", "caption_id", "csv_rows", "shard_stream", "shard_urls",
           "write_shards"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


def caption_id(text: str) -> int:
    """The caption's id, in [0, 2**63): a hash of its words, so case, punctuation and spacing do not count.

    BLAKE2 gives every process the same id (Python's ``hash`` of a string differs between processes);
    with 63 bits, two different captions share an id with probability ~1e-19 per pair.

    Example:
        >>> caption_id("A red circle.") == caption_id("a red  circle") != caption_id("a red square")
        True
    """
    words = " ".join(re.findall(r"\w+", text.lower()))
    return int.from_bytes(hashlib.blake2b(words.encode(), digest_size=8).digest(), "little") >> 1


def csv_rows(path: Path, *, image_column: str = "filepath", caption_column: str = "title", id_column: str = "id",
             separator: str | None = None) -> tuple[list[tuple[str, str, int]], bool]:
    """``(image path, caption, id)`` rows of a CSV, and whether it has ``id_column``.

    The id is the id column's value (an integer as it is, any other value hashed by
    :func:`caption_id`), or without that column the caption's :func:`caption_id`. ``separator``:
    default tab when the header has one, else comma.

    Raises:
        ValueError: the header lacks the image or caption column (the message names both).
    """
    with open(path, newline="") as file:
        separator = separator or ("\t" if "\t" in file.readline() else ",")
        file.seek(0)
        reader = csv.DictReader(file, delimiter=separator)
        columns = reader.fieldnames or []
        if not {image_column, caption_column} <= set(columns):
            raise ValueError(f"{path}: expected columns {(image_column, caption_column)} in the header, found "
                             f"{columns}; rename them with --csv-image-column and --csv-caption-column")
        has_ids = id_column in columns
        rows = [(row[image_column], row[caption_column], row[id_column] if has_ids else row[caption_column])
                for row in reader]
    return [(image, text, int(key) if key.strip().lstrip("-").isdigit() else caption_id(key))
            for image, text, key in rows], has_ids


class CsvImageText:
    """``(transform(image), caption, id, index)`` from :func:`csv_rows`' rows, image paths relative to ``root``."""

    def __init__(self, rows: Sequence[tuple[str, str, int]], root: Path, transform: Callable[[Any], Any]) -> None:
        self.rows, self.root, self.transform = list(rows), Path(root), transform

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[Any, str, int, int]:
        from PIL import Image

        path, text, pair_id = self.rows[index]
        with Image.open(self.root / path) as image:
            return self.transform(image.convert("RGB")), text, pair_id, index


class ImageText:
    """A decoded webdataset sample → ``(transform(image), caption, id)``; picklable for DataLoader workers.

    The id is the sample's key as an int when it is a number (img2dataset's keys are), else -1.
    """

    def __init__(self, transform: Callable[[Any], Any]) -> None:
        self.transform = transform

    def __call__(self, sample: dict[str, Any]) -> tuple[Any, str, int]:
        """The sample's image (transformed), caption and id; a ``ValueError`` names a sample without them."""
        image = next((sample[key] for key in IMAGE_EXTENSIONS if key in sample), None)
        if image is None or not isinstance(sample.get("txt"), str):
            raise ValueError(f"sample {sample.get('__key__')!r} of {sample.get('__url__')}: expected an image "
                             f"({', '.join(IMAGE_EXTENSIONS)}) and a caption (txt), found {sorted(sample)}")
        key = str(sample["__key__"]).rsplit("/", 1)[-1]
        return self.transform(image.convert("RGB")), sample["txt"], int(key) if key.isdigit() else -1


class CaptionCollate:
    """``(image uint8, caption, ..., index)`` items → ``(images, tokens, ids, indices)``; picklable for workers.

    The images are normalised (:func:`contrastive_dist.shapes.normalize`), the captions tokenized by
    a :class:`~contrastive_dist.lightning.towers.ByteTokenizer`. The ids are the items' field
    ``id_field`` (``2``: a CSV's id column, as :class:`CsvImageText` gives it) or, with ``None``,
    :func:`caption_id` of the captions.

    Shape:
        - output: ``(n, 3, S, S)`` float32, ``(n, context_length)`` int64, ``(n,)`` int64, ``(n,)`` int64.

    Example:
        >>> import torch
        >>> items = [(torch.zeros(3, 4, 4, dtype=torch.uint8), "a red circle", 7, 0),
        ...          (torch.zeros(3, 4, 4, dtype=torch.uint8), "A red circle.", 8, 1)]
        >>> images, tokens, ids, indices = CaptionCollate(16)(items)
        >>> tuple(images.shape), tuple(tokens.shape), bool(ids[0] == ids[1]), indices.tolist()
        ((2, 3, 4, 4), (2, 16), True, [0, 1])
        >>> CaptionCollate(16, id_field=2)(items)[2].tolist()
        [7, 8]
    """

    def __init__(self, context_length: int, id_field: int | None = None) -> None:
        self.tokenize, self.id_field = ByteTokenizer(context_length), id_field

    def __call__(self, items: list[tuple[Any, ...]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Collate a list of items (a rank's non-empty share of a step)."""
        captions = [item[1] for item in items]
        ids = [item[self.id_field] for item in items] if self.id_field else [caption_id(text) for text in captions]
        return (normalize(torch.stack([item[0] for item in items])), self.tokenize(captions),
                torch.tensor(ids, dtype=torch.long), torch.tensor([item[-1] for item in items]))


def shard_urls(location: str) -> list[str]:
    """A directory's ``*.tar`` files (sorted), or a brace pattern's expansion; local files must exist.

    Raises:
        ValueError: no shard, or a local shard of the pattern is missing.
    """
    import braceexpand  # a dependency of webdataset

    path = Path(location).expanduser()
    urls = sorted(map(str, path.glob("*.tar"))) if path.is_dir() else list(braceexpand.braceexpand(location))
    missing = [url for url in urls if "://" not in url and not url.startswith("pipe:") and not Path(url).is_file()]
    if not urls or missing:
        raise ValueError(f"webdataset:{location}: expected a directory of .tar shards or a brace pattern of shard "
                         f"files, found {len(urls)} shard(s)" + (f", {len(missing)} missing: {missing[0]}" if missing
                                                                 else ""))
    return urls


def shard_stream(location: str, *, held_out: str | None, held_out_size: int, transform: Callable[[Any], Any],
                 held_out_transform: Callable[[Any], Any]) -> tuple[list[str], tuple[Any, ...], list[Any]]:
    """Training shards, their webdataset stages, and the first ``held_out_size`` held-out samples.

    The held-out samples are read from the shards of ``held_out`` (a directory or brace pattern), or
    without it from the last shard of ``location``, which is then not trained on. The training
    urls and stages go to :func:`contrastive_dist.lightning.streaming_loader`; each sample
    becomes ``(transform(image), caption, id)`` (:class:`ImageText`).

    Raises:
        ValueError: no shard to train on, or no held-out sample.
    """
    import webdataset as wds

    urls = shard_urls(location)
    held_out_urls = shard_urls(held_out) if held_out else urls[-1:]
    urls = urls if held_out else urls[:-1]
    if not urls:
        raise ValueError(f"webdataset:{location} has one shard, held out for evaluation: add shards or --val-data")
    reader = wds.DataPipeline(wds.SimpleShardList(held_out_urls), wds.tarfile_to_samples(), wds.decode("pil"),
                              wds.map(ImageText(held_out_transform)))
    samples = list(islice(reader, held_out_size))
    if not samples:
        raise ValueError(f"the held-out shards {held_out_urls[:3]} hold no sample")
    return urls, (wds.tarfile_to_samples(), wds.decode("pil"), wds.map(ImageText(transform))), samples


def write_shards(directory: Path, train: Sequence[Any], held_out: Sequence[Any], *, shard_size: int,
                 prefix: str = "shard") -> list[Path]:
    """Items ``(uint8 image (3, H, W), caption, ...)`` as PNG + txt shards, ``shard_size`` a shard, then ``held_out``.

    ``held_out`` is one last shard, which a reader can hold out by taking the last shard. Keys count
    the samples from 0 (held-out keys follow the training ones), so a sample's key is its id.
    Returns the shards' paths, in order.
    """
    import webdataset as wds

    directory.mkdir(parents=True, exist_ok=True)
    groups = [(train, range(start, min(start + shard_size, len(train)))) for start in range(0, len(train), shard_size)]
    paths, key = [], 0
    for number, (split, indices) in enumerate([*groups, (held_out, range(len(held_out)))]):
        paths.append(directory / f"{prefix}-{number:06d}.tar")
        with wds.TarWriter(str(paths[-1])) as sink:
            for index in indices:
                image, text = split[index][:2]
                sink.write({"__key__": f"{key:09d}", "png": image.permute(1, 2, 0).numpy(), "txt": text})
                key += 1
    return paths
