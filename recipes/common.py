"""What both recipes share: command-line flags, the Trainer, launch checks and the end-of-run report."""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, Logger

# Test hooks, read from the environment so that the command a user types is the command tested:
# CONTRASTIVE_DIST_FAIL_AT_STEP=k makes the last rank raise at global step k (exit-code checks);
# CONTRASTIVE_DIST_RECORD_SAMPLES=DIR makes every rank append the sample ids of each step to DIR.
FAIL_AT_STEP = "CONTRASTIVE_DIST_FAIL_AT_STEP"
RECORD_SAMPLES = "CONTRASTIVE_DIST_RECORD_SAMPLES"

# Lightning's own use of a deprecated torch pytree name: noise for the user of a recipe.
warnings.filterwarnings("ignore", message=".*LeafSpec.*")
# The recipe restores its sampler mid-epoch itself (RecipeModule.on_load_checkpoint), which
# Lightning cannot see from a plain DataLoader.
warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")


def base_parser(
    description: str, *, batch_size: int, lr: float, max_steps: int, val_every: int
) -> argparse.ArgumentParser:
    """Flags common to both recipes; each recipe adds its own data and model flags."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    launch = parser.add_argument_group("launch (Lightning Trainer)")
    launch.add_argument("--accelerator", default="auto", help="cpu, gpu, ... ('auto': gpu when CUDA is available)")
    launch.add_argument("--devices", default=None,
                        help="processes per machine: an int, or 'auto'. Default: 2 on CPU, all visible GPUs, "
                             "or LOCAL_WORLD_SIZE under torchrun")
    launch.add_argument("--num-nodes", type=int, default=None,
                        help="machines; set MASTER_ADDR, MASTER_PORT, NODE_RANK on each (default 1, or from torchrun)")
    launch.add_argument("--strategy", default="ddp", help="Lightning strategy (ddp on CPU uses gloo, on GPUs nccl)")
    launch.add_argument("--precision", default="32-true", help="e.g. 32-true, bf16-mixed, 16-mixed")
    train = parser.add_argument_group("training")
    train.add_argument("--max-epochs", type=int, default=-1, help="-1: no epoch limit (use --max-steps)")
    train.add_argument("--max-steps", type=int, default=max_steps, help="optimizer steps; -1: no step limit")
    train.add_argument("--max-time", default=None, help="wall-clock limit, DD:HH:MM:SS (Lightning's max_time)")
    train.add_argument("--batch-size", type=int, default=batch_size, help="samples per device per step")
    train.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.05)
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                       help="sgd: plain SGD at a constant lr (used by the exactness test)")
    train.add_argument("--seed", type=int, default=0, help="seeds model init, data order and generated data")
    train.add_argument("--no-sync-bn", action="store_true",
                       help="per-rank BatchNorm statistics instead of exact global ones")
    train.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    train.add_argument("--val-every", type=int, default=val_every, help="evaluate on the held-out split every N steps")
    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", type=Path, default=None, help="default: runs/<recipe>")
    output.add_argument("--checkpoint-every", type=int, default=50, help="write last.ckpt every N steps")
    output.add_argument("--resume", type=Path, default=None, help="checkpoint to resume from (mid-epoch is fine)")
    output.add_argument("--no-plots", action="store_true", help="skip the PNG plots at the end")
    return parser


def launch_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Accelerator, devices and nodes, taking torchrun's environment into account."""
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    devices: int | str
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        # Under torchrun the processes already exist; Lightning must be told the same layout.
        devices = int(os.environ["LOCAL_WORLD_SIZE"])
        num_nodes = int(os.environ["WORLD_SIZE"]) // devices
    else:
        default = 2 if accelerator == "cpu" else "auto"
        devices = default if args.devices is None else args.devices
        if isinstance(devices, str) and devices.lstrip("-").isdigit():
            devices = int(devices)
        num_nodes = args.num_nodes or 1
    return {"accelerator": accelerator, "devices": devices, "num_nodes": num_nodes}


class LastCheckpoint(Callback):
    """Write ``last.ckpt`` every ``every`` steps and after the final step, from inside the loop.

    Saved from ``on_train_batch_end``, a run stopped by ``--max-steps`` mid-epoch resumes
    mid-epoch. ``ModelCheckpoint(save_last=True)`` also saves from ``on_train_end``, after
    Lightning has marked the epoch finished, so resuming from it would skip the epoch's rest.
    """

    def __init__(self, path: Path, every: int) -> None:
        self.path, self.every, self.saved_at = path, every, -1

    def _save(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(self.path)
        self.saved_at = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0 or 0 < trainer.max_steps <= trainer.global_step:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.saved_at != trainer.global_step:  # stopped by --max-epochs: the epoch is complete
            self._save(trainer)


def make_trainer(args: argparse.Namespace, *, monitor: str) -> L.Trainer:
    """A Trainer with CSV (+ TensorBoard) logs, best/last checkpoints, and drop-last-free data loading."""
    output_dir: Path = args.output_dir
    loggers: list[Logger] = [CSVLogger(output_dir, name="logs")]
    try:
        import tensorboard  # noqa: F401
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(output_dir, name="tensorboard"))
    except ImportError:
        pass
    checkpoints = output_dir / "checkpoints"
    best = ModelCheckpoint(dirpath=checkpoints, filename="best", monitor=monitor, mode="max",
                           save_top_k=1, auto_insert_metric_name=False, enable_version_counter=False,
                           save_on_train_epoch_end=False)
    return L.Trainer(
        **launch_settings(args),
        strategy=args.strategy,
        precision=args.precision,
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        max_time=args.max_time,
        # The recipe's DistributedBatchSampler splits every global batch itself: no padding, no drop.
        use_distributed_sampler=False,
        logger=loggers,
        callbacks=[best, LastCheckpoint(checkpoints / "last.ckpt", args.checkpoint_every)],
        default_root_dir=output_dir,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=min(10, args.val_every),
    )


def fit(trainer: L.Trainer, module: L.LightningModule, args: argparse.Namespace) -> float:
    """``trainer.fit``, resuming from ``--resume``; returns the wall time in seconds."""
    start = time.perf_counter()
    resume = str(args.resume) if args.resume is not None else None
    trainer.fit(module, ckpt_path=resume, weights_only=True)
    return time.perf_counter() - start


def check_children(trainer: L.Trainer) -> None:
    """Exit non-zero when a process this one launched failed.

    Lightning's ``ddp`` launcher starts ranks 1.. as subprocesses of rank 0 and watches them only
    while rank 0 trains: a child that dies after rank 0 is done would go unnoticed and the
    command would exit 0.
    """
    failed = []
    for process in getattr(trainer.strategy.launcher, "procs", []):
        code = process.wait()
        if code != 0:
            failed.append((process.pid, code))
    if failed:
        print(f"error: launched rank processes failed (pid, exit code): {failed}", file=sys.stderr)
        sys.exit(1)


def metrics_path(trainer: L.Trainer) -> Path:
    """This run's CSV metrics file."""
    return Path(trainer.loggers[0].log_dir or ".") / "metrics.csv"


def read_metrics(trainer: L.Trainer) -> list[dict[str, float]]:
    """Rows of this run's metrics.csv (empty values dropped)."""
    path = metrics_path(trainer)
    if not path.exists():
        return []
    with open(path) as file:
        return [{key: float(value) for key, value in row.items() if value != ""} for row in csv.DictReader(file)]


def plot_curves(rows: list[dict[str, float]], keys: list[str], path: Path, title: str) -> None:
    """Training loss and held-out metrics against the step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(11, 4))
    loss = [(row["step"], row["train/loss"]) for row in rows if "train/loss" in row]
    if loss:
        loss_axis.plot(*zip(*loss), label="train loss (global, = single-process loss)")
    loss_axis.set(xlabel="step", ylabel="loss", title="training loss")
    loss_axis.legend()
    for key in keys:
        points = [(row["step"], row[key]) for row in rows if key in row]
        if points:
            metric_axis.plot(*zip(*points), marker="o", label=key)
    metric_axis.set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title="held-out")
    metric_axis.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_summary(title: str, metrics: dict[str, float], chance: dict[str, float], wall_s: float,
                  files: dict[str, Path], world_size: int) -> None:
    """A one-screen summary at the end of a run."""
    lines = [f"== {title}: done in {wall_s:.0f} s on {world_size} process(es) =="]
    for key, value in metrics.items():
        reference = chance.get(key)
        suffix = f"   (chance {reference:.3f}, x{value / reference:.1f})" if reference else ""
        lines.append(f"  {key:<28} {value:.3f}{suffix}")
    lines += [f"  {name:<28} {path}" for name, path in files.items()]
    print("\n".join(lines), flush=True)


def last_values(rows: list[dict[str, float]], keys: list[str]) -> dict[str, float]:
    """The last logged value of each key (NaN when never logged)."""
    found = {key: math.nan for key in keys}
    for row in rows:
        found.update({key: row[key] for key in keys if key in row})
    return found
