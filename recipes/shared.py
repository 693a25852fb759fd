"""What the CLIP and SimCLR recipes share: the launch and training flags, the Trainer, the optimizer.

The flags import nothing heavy, so ``--help`` and a bad flag answer at once; torch, torchvision
and Lightning are imported once the flags are read. The recipes import this file as a sibling
module (``python recipes/clip.py`` puts ``recipes/`` on ``sys.path``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

# Lightning's own use of a deprecated torch pytree name: noise for the user of a recipe.
warnings.filterwarnings("ignore", message=".*LeafSpec.*")

BACKBONES = ("resnet-small", "resnet18")
NORMS = ("batch", "group")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ``(default: X)``, unless the help states the default itself or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parser_for(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the docstring's first line, in plain text."""
    return argparse.ArgumentParser(description=doc.splitlines()[0].replace("``", ""), formatter_class=HelpFormatter)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def training_flags(parser: argparse.ArgumentParser, *, batch_size: int, lr: float, max_steps: int,
                   val_every: int) -> None:
    """Add the launch, training and output flags both recipes take."""
    launch = parser.add_argument_group("launch (Lightning Trainer)")
    launch.add_argument("--accelerator", default="auto", help="cpu, gpu, ... (auto: gpu when CUDA is available)")
    launch.add_argument("--devices", default=None, help="processes per machine, an int or 'auto'; default: 2 on "
                        "CPU, all visible GPUs, or LOCAL_WORLD_SIZE under torchrun")
    launch.add_argument("--num-nodes", type=int, default=None, help="machines; set MASTER_ADDR, MASTER_PORT, "
                        "NODE_RANK on each; default: 1, or what torchrun says")
    launch.add_argument("--strategy", default="ddp", help="Lightning strategy (ddp: gloo on CPU, nccl on "
                        "GPUs, each rank a new process; ddp_fork: ranks forked from this one, quicker to start, CPU)")
    launch.add_argument("--timeout", type=float, default=600, help="seconds a rank waits in a collective for a "
                        "peer that hangs without exiting, then fails (one that exits is reported at once)")
    launch.add_argument("--precision", default="32-true", help="e.g. 32-true, bf16-mixed, 16-mixed, 64-true")
    train = parser.add_argument_group("training")
    train.add_argument("--max-epochs", type=int, default=-1, help="-1: no epoch limit (use --max-steps)")
    train.add_argument("--max-steps", type=int, default=max_steps, help="optimizer steps; -1: no step limit")
    train.add_argument("--max-time", default=None, help="wall-clock limit, DD:HH:MM:SS (Lightning's max_time)")
    train.add_argument("--batch-size", type=int, default=batch_size, help="samples per device per step; the "
                       "global batch (this × processes) gives each pair its negatives: keep it at 16 or more")
    train.add_argument("--lr", type=float, default=lr, help="peak learning rate")
    train.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay of the weight matrices")
    train.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                       help="sgd: plain SGD at a constant lr (used by the exactness test)")
    train.add_argument("--seed", type=int, default=0, help="seeds model init, data order and generated data")
    train.add_argument("--communication", choices=("gather", "ring"), default="gather",
                       help="the loss's communication: ring keeps per-rank memory independent of the number of "
                       "processes, with the same loss and gradients (docs/guides/gather-and-ring.md)")
    train.add_argument("--no-sync-bn", action="store_true", help="per-rank BatchNorm statistics, not global ones")
    train.add_argument("--grad-cache", type=non_negative_int, default=0, metavar="M",
                       help="encode each batch M rows at a time, without keeping activations, and re-encode in "
                       "backward (contrastive_dist.grad_cache): the activation memory of M rows, the same gradient "
                       "except through BatchNorm, which then sees M-row statistics; 0: off")
    train.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    train.add_argument("--val-every", type=int, default=val_every,
                       help="evaluate on the held-out split every N steps, and always after the last step")
    output = parser.add_argument_group("output")
    output.add_argument("--output-dir", type=Path, default=None, help="the run's folder, which must not hold a "
                        "run yet; default: a new runs/<recipe>/version_N")
    output.add_argument("--overwrite", action="store_true", help="let --output-dir replace the run it holds")
    output.add_argument("--checkpoint-every", type=int, default=50, help="write last.ckpt every N steps")
    output.add_argument("--resume", type=Path, default=None, metavar="RUN", help="continue a run (mid-epoch is "
                        "fine): its folder, e.g. runs/clip/version_0, or a checkpoint file in it")
    output.add_argument("--no-plots", action="store_true", help="skip the PNG plots at the end")


def make_trainer(args: argparse.Namespace, *, monitor: str, callbacks: Any = ()) -> Any:
    """The Trainer of the flags: CSV and TensorBoard logs, best/last checkpoints, drop-last-free loading."""
    from datetime import timedelta

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.strategies import DDPStrategy

    from contrastive_dist.lightning.training import MidEpochCheckpoint, PlainProgress

    accelerator = ("gpu" if torch.cuda.is_available() else "cpu") if args.accelerator == "auto" else args.accelerator
    if "TORCHELASTIC_RUN_ID" in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        # Under torchrun the processes already exist; Lightning must be told the same layout.
        devices: int | str = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // devices
    else:
        devices = (2 if accelerator == "cpu" else "auto") if args.devices is None else args.devices
        devices = int(devices) if isinstance(devices, str) and devices.lstrip("-").isdigit() else devices
        nodes = args.num_nodes or 1
    strategy = args.strategy
    if strategy in ("ddp", "ddp_spawn", "ddp_fork"):  # --timeout bounds the wait for a peer that hangs
        strategy = DDPStrategy(timeout=timedelta(seconds=args.timeout),
                               start_method={"ddp": "popen"}.get(strategy, strategy[4:]))
    checkpoints = args.output_dir / "checkpoints"
    best = ModelCheckpoint(dirpath=checkpoints, filename="best", monitor=monitor, mode="max", save_top_k=1,
                           auto_insert_metric_name=False, enable_version_counter=False, save_on_train_epoch_end=False)
    last = MidEpochCheckpoint(checkpoints / "last.ckpt", args.checkpoint_every,
                              layout={"batch_size": args.batch_size, "num_workers": args.num_workers})
    interactive = sys.stdout.isatty()
    return L.Trainer(
        accelerator=accelerator, devices=devices, num_nodes=nodes, strategy=strategy, precision=args.precision,
        max_epochs=args.max_epochs, max_steps=args.max_steps, max_time=args.max_time,
        # contrastive_dist.lightning's loaders split every global batch themselves: no padding, no drop.
        use_distributed_sampler=False,
        logger=[CSVLogger(args.output_dir, name="logs"), TensorBoardLogger(args.output_dir, name="tensorboard")],
        callbacks=[best, last, *([] if interactive else [PlainProgress()]), *callbacks],
        enable_progress_bar=interactive, default_root_dir=args.output_dir, val_check_interval=args.val_every,
        check_val_every_n_epoch=None, num_sanity_val_steps=0,
        log_every_n_steps=1,  # every step, with its rows: the loss curve is a mean weighted by them
    )


def optimizer_and_schedule(module: Any, args: argparse.Namespace) -> Any:
    """AdamW without decay on biases and norms, warm-up then cosine; or plain SGD (``--optimizer sgd``)."""
    import torch

    from contrastive_dist.lightning.training import planned_steps, warmup_cosine

    if args.optimizer == "sgd":
        return torch.optim.SGD(module.parameters(), lr=args.lr)
    groups = [{"params": [p for p in module.parameters() if p.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in module.parameters() if p.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    scheduler = warmup_cosine(optimizer, total_steps=int(min(planned_steps(module), 2**62)))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
