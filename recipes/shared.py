"""What the CLIP and SimCLR recipes share: generated shapes, a small ResNet, the flags and Trainer, the report.

Read top to bottom: the data (coloured shapes rendered from their attributes, nothing to
download), the image backbone, the launch and training flags with the ``Trainer`` they build, and
the end-of-run report (curves over every step of the run, a summary without NaN). The recipes
import it as a sibling module (``python recipes/clip.py`` puts ``recipes/`` on ``sys.path``).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import Dataset
from torchvision.models import resnet18
from torchvision.models.resnet import BasicBlock

# Lightning's own use of a deprecated torch pytree name: noise for the user of a recipe.
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
# A short run logs less often than every 10 steps, on purpose (see make_trainer).
warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")

# -- generated data: coloured shapes whose captions name them ------------------------------------

SHAPES = ("circle", "square", "triangle", "cross", "ring")
COLOURS = {"red": (0.90, 0.15, 0.15), "green": (0.15, 0.80, 0.20), "blue": (0.20, 0.35, 0.95),
           "yellow": (0.95, 0.90, 0.15), "purple": (0.65, 0.20, 0.85), "cyan": (0.15, 0.85, 0.90)}
SIZES = {"small": 0.11, "large": 0.19}  # radius as a fraction of the image side
POSITIONS = {"top left": (0, 0), "top middle": (0, 1), "top right": (0, 2), "middle left": (1, 0), "center": (1, 1),
             "middle right": (1, 2), "bottom left": (2, 0), "bottom middle": (2, 1), "bottom right": (2, 2)}
COMBINATIONS = len(SHAPES) * len(COLOURS) * len(SIZES) * len(POSITIONS)
KINDS = len(SHAPES) * len(COLOURS)  # colour-shape kinds: what a coarse caption names
MEAN, STD = 0.5, 0.25  # uint8 images become (x / 255 - MEAN) / STD


def caption(shape: int, colour: int, size: int, position: int) -> str:
    return f"a {list(SIZES)[size]} {list(COLOURS)[colour]} {SHAPES[shape]} in the {list(POSITIONS)[position]}"


def kind_caption(shape: int, colour: int, form: int) -> str:
    """The coarse caption of a kind, in one of 4 forms: ``form`` bit 0 capitalises, bit 1 adds a full stop."""
    text = f"a {list(COLOURS)[colour]} {SHAPES[shape]}"
    return (text.capitalize() if form & 1 else text) + ("." if form & 2 else "")


def render(attributes: Tensor, image_size: int, generator: torch.Generator, *, background_noise: float = 0.04,
           tint_spread: float = 0.2) -> Tensor:
    """``(n, 4)`` attribute rows (shape, colour, size, position) → uint8 images ``(n, 3, S, S)``.

    The background is a per-image tint, uniform in ``0.2 ± tint_spread / 2`` per channel, plus
    Gaussian pixel noise of std ``background_noise``; both 0 give plain grey. The same random numbers
    are drawn whatever the two values, so only the background changes with them.
    """
    n = attributes.shape[0]
    shape, colour, size, position = attributes.unbind(1)
    grid = (torch.arange(image_size, dtype=torch.float32) + 0.5) / image_size
    y, x = grid.view(1, -1, 1), grid.view(1, 1, -1)
    cells = torch.tensor(list(POSITIONS.values()), dtype=torch.float32)[position]
    jitter = (torch.rand(n, 2, generator=generator) - 0.5) * 0.06
    centre = 0.22 + 0.28 * cells + jitter  # cell centres at 0.22, 0.5, 0.78: large shapes stay inside
    radius = torch.tensor(list(SIZES.values()))[size] * (0.9 + 0.2 * torch.rand(n, generator=generator))
    cy, cx, r = centre[:, 0].view(-1, 1, 1), centre[:, 1].view(-1, 1, 1), radius.view(-1, 1, 1)
    dy, dx = (y - cy) / r, (x - cx) / r
    masks = torch.stack([  # (shape kind, n, S, S)
        dx**2 + dy**2 <= 1,
        (dx.abs() <= 0.85) & (dy.abs() <= 0.85),
        (dy <= 0.8) & (dy >= -1) & (dx.abs() <= (dy + 1) / 1.8),
        ((dx.abs() <= 0.3) & (dy.abs() <= 1)) | ((dy.abs() <= 0.3) & (dx.abs() <= 1)),
        (dx**2 + dy**2 <= 1) & (dx**2 + dy**2 >= 0.3),
    ])
    mask = masks[shape, torch.arange(n)].unsqueeze(1)
    rgb = torch.tensor(list(COLOURS.values()))[colour]
    rgb = (rgb + (torch.rand(n, 3, generator=generator) - 0.5) * 0.15).clamp(0, 1).view(n, 3, 1, 1)
    tint = (0.2 - tint_spread / 2) + tint_spread * torch.rand(n, 3, 1, 1, generator=generator)
    background = tint + background_noise * torch.randn(n, 3, image_size, image_size, generator=generator)
    return (torch.where(mask, rgb, background).clamp(0, 1) * 255).round().to(torch.uint8)


class ShapesDataset(Dataset):
    """Items ``(image uint8 (3, S, S), caption, label = the shape, index)``, the same on every rank and run.

    ``"train"`` draws attributes at random; ``"val"`` renders distinct combinations (at most
    :data:`COMBINATIONS`), so every held-out caption is unique and retrieval has chance ``1/N``
    (unless ``duplicate_captions``).

    ``duplicate_captions=F`` makes captions repeat as on the web, where one alt-text ("a photo of a
    dog") covers many images: a fraction ``F`` of the :data:`KINDS` colour-shape kinds, the same in
    both splits, is captioned by its kind alone, written in one of the 4 forms of :func:`kind_caption`
    ("a red circle", "A red circle."); size and position go unnamed. Images do not change with ``F``.
    """

    def __init__(self, split: str, *, size: int, image_size: int = 32, seed: int = 0,
                 background_noise: float = 0.04, tint_spread: float = 0.2, duplicate_captions: float = 0.0) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if split == "val" and not 0 < size <= COMBINATIONS:
            raise ValueError(f"the held-out split has distinct combinations: size must be in [1, {COMBINATIONS}], "
                             f"got {size}")
        if size < 1 or image_size < 8:
            raise ValueError(f"expected size >= 1 and image_size >= 8, got {size} and {image_size}")
        if not (0 <= background_noise and 0 <= tint_spread <= 0.4):
            raise ValueError(f"expected background_noise >= 0 and tint_spread in [0, 0.4], "
                             f"got {background_noise} and {tint_spread}")
        if not 0 <= duplicate_captions <= 1:
            raise ValueError(f"duplicate_captions is a fraction of the colour-shape kinds, in [0, 1]; "
                             f"got {duplicate_captions}")
        generator = torch.Generator().manual_seed(seed * 2 + (split == "val"))
        ranges = (len(SHAPES), len(COLOURS), len(SIZES), len(POSITIONS))
        if split == "val":
            every = torch.tensor(list(itertools.product(*(range(k) for k in ranges))))
            attributes = every[torch.randperm(len(every), generator=generator)[:size]]
        else:
            attributes = torch.stack([torch.randint(k, (size,), generator=generator) for k in ranges], dim=1)
        # Rendered once, in chunks to bound memory.
        self.images = torch.cat([render(chunk, image_size, generator, background_noise=background_noise,
                                        tint_spread=tint_spread) for chunk in attributes.split(1024)])
        self.captions = [caption(*row) for row in attributes.tolist()]
        self.labels = attributes[:, 0].tolist()
        # Drawn after the images, so they stay the same; the kinds from the seed alone: the same in both splits.
        forms = torch.randint(4, (size,), generator=generator).tolist()
        kinds = torch.randperm(KINDS, generator=torch.Generator().manual_seed(seed))
        kinds = kinds[: round(duplicate_captions * KINDS)]
        coarse = torch.isin(attributes[:, 0] * len(COLOURS) + attributes[:, 1], kinds)
        for index in coarse.nonzero().flatten().tolist():
            self.captions[index] = kind_caption(*attributes[index, :2].tolist(), forms[index])

    def __len__(self) -> int:
        return len(self.captions)

    def __getitem__(self, index: int) -> tuple[Tensor, str, int, int]:
        return self.images[index], self.captions[index], self.labels[index], index


def normalize(images: Tensor) -> Tensor:
    return images.float().div(255).sub(MEAN).div(STD)


# -- the image backbone ---------------------------------------------------------------------------

BACKBONES = ("resnet-small", "resnet18")
NORMS = ("batch", "group")


def group_norm(channels: int) -> nn.Module:
    """GroupNorm with up to 8 groups: per-sample statistics, so mini-batching (``--grad-cache``) changes nothing."""
    return nn.GroupNorm(math.gcd(8, channels), channels)


def small_image_resnet(name: str, *, width: int = 32, stem_stride: int = 2,
                       norm: str = "batch") -> tuple[nn.Module, int]:
    """A torchvision ResNet for small images → ``(module, feature_dim)``; input ``(n, 3, H, W)``, ``n`` may be 0.

    ``"resnet18"``: torchvision's (random init) with a 3×3 stride-1 stem and no max-pool (the usual
    CIFAR change). ``"resnet-small"``: one ``BasicBlock`` per stage, widths ``width·(1, 2, 4, 8)``, a
    few MFLOPs per image, so the default runs train in minutes on a laptop CPU. ``norm="group"``
    puts :func:`group_norm` where BatchNorm would be.
    """
    norm_layer = nn.BatchNorm2d if norm == "batch" else group_norm
    if name == "resnet18":
        net = resnet18(weights=None, norm_layer=norm_layer)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()  # type: ignore[assignment]
        net.fc = nn.Identity()  # type: ignore[assignment]
        return net, 512
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, stride=stem_stride, padding=1, bias=False),
                               norm_layer(width), nn.ReLU(inplace=True)]
    channels = width
    for stage in range(4):
        out, stride = width * 2**stage, 1 if stage == 0 else 2
        downsample = None
        if stride != 1 or channels != out:
            downsample = nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), norm_layer(out))
        layers.append(BasicBlock(channels, out, stride=stride, downsample=downsample, norm_layer=norm_layer))
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()), channels


# -- flags, Trainer, optimizer --------------------------------------------------------------------


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def training_flags(parser: argparse.ArgumentParser, *, batch_size: int, lr: float, max_steps: int,
                   val_every: int) -> None:
    """Add the launch, training and output flags both recipes take."""
    launch = parser.add_argument_group("launch (Lightning Trainer)")
    launch.add_argument("--accelerator", default="auto", help="cpu, gpu, ... ('auto': gpu when CUDA is available)")
    launch.add_argument("--devices", default=None, help="processes per machine: an int or 'auto'. Default: 2 on "
                        "CPU, all visible GPUs, or LOCAL_WORLD_SIZE under torchrun")
    launch.add_argument("--num-nodes", type=int, default=None, help="machines; set MASTER_ADDR, MASTER_PORT, "
                        "NODE_RANK on each (default 1, or from torchrun)")
    launch.add_argument("--strategy", default="ddp", help="Lightning strategy (ddp: gloo on CPU, nccl on GPUs)")
    launch.add_argument("--timeout", type=float, default=600, help="seconds a rank waits in a collective for a "
                        "peer that hangs without exiting, then fails (one that exits is reported at once)")
    launch.add_argument("--precision", default="32-true", help="e.g. 32-true, bf16-mixed, 16-mixed")
    train = parser.add_argument_group("training")
    train.add_argument("--max-epochs", type=int, default=-1, help="-1: no epoch limit (use --max-steps)")
    train.add_argument("--max-steps", type=int, default=max_steps, help="optimizer steps; -1: no step limit")
    train.add_argument("--max-time", default=None, help="wall-clock limit, DD:HH:MM:SS (Lightning's max_time)")
    train.add_argument("--batch-size", type=int, default=batch_size, help="samples per device per step")
    train.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay of the weight matrices")
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                       help="sgd: plain SGD at a constant lr (used by the exactness test)")
    train.add_argument("--seed", type=int, default=0, help="seeds model init, data order and generated data")
    train.add_argument("--communication", choices=("gather", "ring"), default="gather",
                       help="the loss's communication: ring keeps per-rank memory independent of the number of "
                       "processes (same loss and gradients; README, 'Ring mode')")
    train.add_argument("--no-sync-bn", action="store_true", help="per-rank BatchNorm statistics, not global ones")
    train.add_argument("--grad-cache", type=non_negative_int, default=0, metavar="M",
                       help="encode each batch M rows at a time, without keeping activations, and re-encode in "
                       "backward (contrastive_dist.grad_cache): the activation memory of M rows, the same gradient "
                       "except through BatchNorm, which then sees M-row statistics; 0: off")
    train.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    train.add_argument("--val-every", type=int, default=val_every,
                       help="evaluate on the held-out split every N steps, and always after the last step")
    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", type=Path, default=None, help="default: runs/<recipe>")
    output.add_argument("--checkpoint-every", type=int, default=50, help="write last.ckpt every N steps")
    output.add_argument("--resume", type=Path, default=None, help="checkpoint to resume from (mid-epoch is fine)")
    output.add_argument("--no-plots", action="store_true", help="skip the PNG plots at the end")


def launch_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Accelerator, devices and nodes, following torchrun's environment when there is one."""
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    devices: int | str
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        # Under torchrun the processes already exist; Lightning must be told the same layout.
        devices = int(os.environ["LOCAL_WORLD_SIZE"])
        return {"accelerator": accelerator, "devices": devices, "num_nodes": int(os.environ["WORLD_SIZE"]) // devices}
    devices = (2 if accelerator == "cpu" else "auto") if args.devices is None else args.devices
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    return {"accelerator": accelerator, "devices": devices, "num_nodes": args.num_nodes or 1}


class EndOfRun(Callback):
    """``last.ckpt`` every ``every`` steps and at the end, saved mid-epoch; a validation after the last step.

    Saved from ``on_train_batch_end``, a run stopped by ``--max-steps`` resumes mid-epoch (the
    loader's position is in the checkpoint), on the same or another number of processes or
    workers. Asking the trainer to stop at the last step makes Lightning validate there, so every
    run ends with held-out metrics and a ``best.ckpt``. The checkpoint records the layout that saved
    it, for the summary of a run resumed on another.
    """

    def __init__(self, path: Path, every: int, *, batch_size: int, num_workers: int) -> None:
        self.path, self.every, self.saved_at, self.start_step = path, every, -1, 0
        self.batch_size, self.num_workers = batch_size, num_workers
        self.saved_layout: dict[str, int] | None = None  # of the checkpoint this run resumed from, when it says

    def layout(self, trainer: L.Trainer) -> dict[str, int]:
        return {"processes": trainer.world_size, "batch_size": self.batch_size, "num_workers": self.num_workers}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start_step = trainer.global_step  # > 0 when resumed

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint["recipe_layout"] = self.layout(trainer)

    def on_load_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.saved_layout = checkpoint.get("recipe_layout")

    def _save(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)
        self.saved_at = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        last_step = 0 < trainer.max_steps <= trainer.global_step
        last_batch = (trainer.current_epoch + 1 == trainer.max_epochs
                      and batch_idx + 1 == trainer.num_training_batches)
        if last_step or last_batch:
            trainer.should_stop = True
        if trainer.global_step % self.every == 0 or last_step:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.saved_at != trainer.global_step:  # stopped at an epoch's end or by --max-time
            self._save(trainer)


class PlainProgress(Callback):
    """One line per validation, for output that is not a terminal (a log file, CI) instead of a progress bar."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        values = "  ".join(f"{key} {float(value):.4f}" for key, value in sorted(trainer.callback_metrics.items()))
        total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        print(f"step {trainer.global_step}{total}  {values}  ({time.perf_counter() - self.start:.0f} s)", flush=True)


def strategy(args: argparse.Namespace) -> str | DDPStrategy:
    """``--strategy``; DDP with ``--timeout`` as the process group's bound on a peer that hangs."""
    if args.strategy in ("ddp", "ddp_spawn"):
        start_method = "spawn" if args.strategy == "ddp_spawn" else "popen"
        return DDPStrategy(timeout=timedelta(seconds=args.timeout), start_method=start_method)
    return args.strategy


def make_trainer(args: argparse.Namespace, *, monitor: str, callbacks: Sequence[Callback] = ()) -> L.Trainer:
    """A Trainer with CSV and TensorBoard logs, best/last checkpoints, drop-last-free loading."""
    checkpoints = args.output_dir / "checkpoints"
    best = ModelCheckpoint(dirpath=checkpoints, filename="best", monitor=monitor, mode="max", save_top_k=1,
                           auto_insert_metric_name=False, enable_version_counter=False, save_on_train_epoch_end=False)
    interactive = sys.stdout.isatty()
    return L.Trainer(
        **launch_settings(args), strategy=strategy(args), precision=args.precision, max_epochs=args.max_epochs,
        max_steps=args.max_steps, max_time=args.max_time,
        # contrastive_dist.lightning's loaders split every global batch themselves: no padding, no drop.
        use_distributed_sampler=False,
        logger=[CSVLogger(args.output_dir, name="logs"), TensorBoardLogger(args.output_dir, name="tensorboard")],
        callbacks=[best, EndOfRun(checkpoints / "last.ckpt", args.checkpoint_every, batch_size=args.batch_size,
                                  num_workers=args.num_workers),
                   *([] if interactive else [PlainProgress()]), *callbacks],
        enable_progress_bar=interactive, default_root_dir=args.output_dir, val_check_interval=args.val_every,
        check_val_every_n_epoch=None, num_sanity_val_steps=0,
        log_every_n_steps=max(1, min(10, args.val_every, args.max_steps if args.max_steps > 0 else 10)),
    )


def planned_steps(module: L.LightningModule, args: argparse.Namespace) -> float:
    """The optimizer steps of the run, for the schedule, without Lightning building its train loader early.

    ``trainer.estimated_stepping_batches`` builds the train loader when ``max_epochs`` is set, before a
    resumed checkpoint is restored, and Lightning then never gives the loader its saved position
    (Lightning issue #20550): the epoch would restart. Its length comes from a loader of our own instead.
    """
    if args.max_epochs == -1:
        return module.trainer.estimated_stepping_batches  # max_steps: no loader needed
    loader = module.train_dataloader()
    per_epoch = len(loader) if hasattr(loader, "__len__") else math.inf  # a stream has no length
    total = per_epoch * args.max_epochs
    return min(total, args.max_steps) if args.max_steps > 0 else total


def optimizer_and_schedule(module: L.LightningModule, args: argparse.Namespace) -> Any:
    """AdamW without decay on biases and norms, linear warm-up then cosine; or plain SGD (``--optimizer sgd``)."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=args.lr)
    groups = [{"params": [p for p in module.parameters() if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = max(int(planned_steps(module, args)), 1)
    warmup = max(total // 20, 1)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total) / max(total - warmup, 1)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(trainer: L.Trainer, module: L.LightningModule, args: argparse.Namespace) -> bool:
    """``trainer.fit`` (resuming from ``--resume``); True on the process that reports (global rank 0).

    Exits non-zero when a rank process this one launched failed: Lightning's ``ddp`` launcher
    watches its children only while rank 0 trains, so one that dies later would go unnoticed.
    """
    # Lightning loads a checkpoint's weights before it converts the module to the precision's dtype:
    # converted first, a float64 run (--precision 64-true) resumes without a round trip through float32.
    trainer.precision_plugin.convert_module(module)  # in place (Module.double, Module.to)
    trainer.fit(module, ckpt_path=None if args.resume is None else str(args.resume), weights_only=True)
    failed = [(process.pid, process.wait()) for process in getattr(trainer.strategy.launcher, "procs", [])]
    failed = [(pid, code) for pid, code in failed if code != 0]
    if failed:
        print(f"error: launched rank processes failed (pid, exit code): {failed}", file=sys.stderr)
        sys.exit(1)
    return trainer.is_global_zero


# -- the end-of-run report ------------------------------------------------------------------------


def read_metrics(output_dir: Path) -> list[dict[str, float]]:
    """Every logged row of the whole run: all ``logs/version_*`` (one per invocation), resumed steps replaced."""
    rows: list[dict[str, float]] = []
    versions = sorted(output_dir.glob("logs/version_*/metrics.csv"), key=lambda path: int(path.parent.name[8:]))
    for path in versions:
        with open(path) as file:
            new = [{key: float(value) for key, value in row.items() if value != ""} for row in csv.DictReader(file)]
        if new:  # a resumed invocation starts at its checkpoint's step: it replaces what came after it
            rows = [row for row in rows if row["step"] < new[0]["step"]] + new
    return rows


def plot_curves(rows: list[dict[str, float]], keys: Sequence[str], path: Path, title: str) -> None:
    """Training loss and held-out metrics against the step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(11, 4))
    # Lightning logs the 0-based index of the step; the axis counts optimizer steps done.
    loss = [(row["step"] + 1, row["train/loss"]) for row in rows if "train/loss" in row]
    if loss:
        loss_axis.plot(*zip(*loss), marker="." if len(loss) < 30 else None,
                       label="train loss (global, = single-process loss)")
        loss_axis.legend()
    loss_axis.set(xlabel="step", ylabel="loss", title="training loss")
    for key in keys:
        points = [(row["step"] + 1, row[key]) for row in rows if key in row]
        if points:
            metric_axis.plot(*zip(*points), marker="o", label=key)
            metric_axis.legend()
    metric_axis.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title="held-out")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_summary(title: str, rows: list[dict[str, float]], chance: dict[str, float], *, trainer: L.Trainer,
                  seconds: float, files: dict[str, Path]) -> None:
    """One screen: the last held-out value of each metric against chance, the run's length, the files."""
    (end_of_run,) = [callback for callback in trainer.callbacks if isinstance(callback, EndOfRun)]
    first, last = end_of_run.start_step, trainer.global_step
    steps = f"{last} steps" if first == 0 else f"steps {first + 1}-{last} (resumed; the run has {last} steps)"
    saved, now = end_of_run.saved_layout, end_of_run.layout(trainer)
    if first and saved is not None and saved != now:
        same = saved["processes"] * saved["batch_size"] == now["processes"] * now["batch_size"]
        steps += (f", resumed on {now['processes']} process(es) × {now['batch_size']} with {now['num_workers']} "
                  f"worker(s) from {saved['processes']} × {saved['batch_size']} with {saved['num_workers']} "
                  f"({'the same' if same else 'another'} global batch)")
    lines = [f"== {title}: done in {seconds:.0f} s on {trainer.world_size} process(es), {steps} =="]
    for key, reference in chance.items():
        values = [row[key] for row in rows if key in row]
        if not values:
            lines.append(f"  {key:<28} not measured")
            continue
        lines.append(f"  {key:<28} {values[-1]:.3f}   (chance {reference:.3f}, x{values[-1] / reference:.1f})")
    lines += [f"  {name:<28} {path}" for name, path in files.items()]
    print("\n".join(lines), flush=True)
