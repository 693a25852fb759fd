"""Pieces of a Lightning training run that resumes mid-epoch: checkpoints, progress lines, schedule, fit.

* :class:`MidEpochCheckpoint` writes ``last.ckpt`` every few steps (mid-epoch: the loaders of
  :mod:`contrastive_dist.lightning` put their position in it) and ends every run with a validation.
* :class:`PlainProgress` prints one line per validation, for output that is not a terminal.
* :func:`warmup_cosine` is a linear warm-up then a cosine decay; :func:`planned_steps` counts the
  steps of a run without making Lightning build the training loader before a resume.
* :func:`fit` runs ``trainer.fit`` and fails when a rank process it launched failed.

Example:
    >>> import torch
    >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> schedule = warmup_cosine(optimizer, total_steps=100)
    >>> rates = []
    >>> for step in range(100):
    ...     rates.append(round(optimizer.param_groups[0]["lr"], 3)); optimizer.step(); schedule.step()
    >>> rates[0], rates[4], rates[5], rates[52], rates[99]
    (0.2, 1.0, 1.0, 0.508, 0.0)
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

__all__ = ["MidEpochCheckpoint", "PlainProgress", "fit", "planned_steps", "warmup_cosine"]


class MidEpochCheckpoint(L.Callback):
    """``last.ckpt`` every ``every`` steps and at the end, saved mid-epoch; a validation after the last step.

    Saved from ``on_train_batch_end``, a run stopped by ``max_steps`` resumes mid-epoch (the
    loader's position is in the checkpoint), on the same or another number of processes or
    workers. Asking the trainer to stop at the last step makes Lightning validate there, so every
    run ends with held-out metrics. The checkpoint records the layout that saved it
    (``layout``), and :attr:`saved_layout` is that of the checkpoint a run resumed from.

    Args:
        path: the checkpoint file, e.g. ``run/checkpoints/last.ckpt``.
        every: steps between two saves.
        layout: what to record of the run's layout besides the number of processes (batch size, workers).
    """

    def __init__(self, path: Path, every: int, *, layout: dict[str, int] | None = None) -> None:
        self.path, self.every, self.saved_at, self.start_step = Path(path), every, -1, 0
        self.extra_layout = dict(layout or {})
        self.saved_layout: dict[str, int] | None = None
        self.recovered_layout: dict[str, int] | None = None

    def layout(self, trainer: L.Trainer) -> dict[str, int]:
        """The number of processes and the ``layout`` given at construction."""
        if self.recovered_layout is not None:
            return self.recovered_layout
        return {"processes": trainer.world_size, **self.extra_layout}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Note the first step of this invocation."""
        self.start_step = trainer.global_step  # > 0 when resumed

    def on_save_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Record the layout in the checkpoint, and this invocation's first step and resumed layout."""
        checkpoint["recipe_layout"] = self.layout(trainer)
        checkpoint["recipe_invocation"] = {"start_step": self.start_step, "resumed_layout": self.saved_layout}

    def on_load_checkpoint(self, trainer: L.Trainer, module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Read the layout of the checkpoint resumed from."""
        self.saved_layout = checkpoint.get("recipe_layout")

    def recover(self) -> None:
        """Read this invocation's steps and layouts back from :attr:`path`.

        For the process that launched the ranks with ``ddp_spawn`` or ``ddp_fork``: the ranks ran
        in processes of their own, so this callback's copy here never saw the run.
        """
        checkpoint = torch.load(self.path, map_location="cpu", weights_only=False)  # our own file
        self.saved_at = checkpoint["global_step"]
        self.start_step = checkpoint["recipe_invocation"]["start_step"]
        self.saved_layout = checkpoint["recipe_invocation"]["resumed_layout"]
        self.recovered_layout = checkpoint["recipe_layout"]

    def _save(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)
        self.saved_at = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Save every ``every`` steps; stop (and so validate) at the last step."""
        last_step = 0 < trainer.max_steps <= trainer.global_step
        last_batch = (trainer.current_epoch + 1 == trainer.max_epochs
                      and batch_idx + 1 == trainer.num_training_batches)
        if last_step or last_batch:
            trainer.should_stop = True
        if trainer.global_step % self.every == 0 or last_step:
            self._save(trainer)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Save the last step when no save has."""
        if self.saved_at != trainer.global_step:  # stopped at an epoch's end or by max_time
            self._save(trainer)


class PlainProgress(L.Callback):
    """One line per validation (step, logged metrics, seconds), instead of a progress bar."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Print the line, on global rank 0."""
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        values = "  ".join(f"{key} {float(value):.4f}" for key, value in sorted(trainer.callback_metrics.items()))
        total = f"/{trainer.max_steps}" if trainer.max_steps > 0 else ""
        print(f"step {trainer.global_step}{total}  {values}  ({time.perf_counter() - self.start:.0f} s)", flush=True)


def planned_steps(module: L.LightningModule) -> float:
    """The optimizer steps of the run, for a schedule, without Lightning building its train loader early.

    ``trainer.estimated_stepping_batches`` builds the train loader when ``max_epochs`` is set, before a
    resumed checkpoint is restored, and Lightning then never gives the loader its saved position
    (Lightning issue #20550): the epoch would restart. Its length comes from a loader of our own instead.
    """
    trainer = module.trainer
    if trainer.max_epochs in (None, -1):
        return trainer.estimated_stepping_batches  # max_steps: no loader needed
    loader = module.train_dataloader()
    per_epoch = len(loader) if hasattr(loader, "__len__") else math.inf  # a stream has no length
    total = per_epoch * trainer.max_epochs
    return min(total, trainer.max_steps) if trainer.max_steps > 0 else total


def warmup_cosine(optimizer: torch.optim.Optimizer, *, total_steps: int,
                  warmup_steps: int | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps`` (default: 5 % of the run), then a cosine decay to 0; step it per step."""
    total = max(int(total_steps), 1)
    warmup = max(total // 20, 1) if warmup_steps is None else max(warmup_steps, 1)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total) / max(total - warmup, 1)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def fit(trainer: L.Trainer, module: L.LightningModule, ckpt_path: Path | None = None) -> bool:
    """``trainer.fit`` (resuming from ``ckpt_path``); True on the process that reports (global rank 0).

    Exits non-zero when a rank process this one launched failed: Lightning's ``ddp`` launcher
    watches its children only while rank 0 trains, so one that dies later would go unnoticed. After
    ``ddp_spawn`` or ``ddp_fork`` (the ranks ran in child processes) the
    :class:`MidEpochCheckpoint` callbacks read the run back from their checkpoint.
    """
    # Lightning loads a checkpoint's weights before it converts the module to the precision's dtype:
    # converted first, a float64 run (precision="64-true") resumes without a round trip through float32.
    trainer.precision_plugin.convert_module(module)  # in place (Module.double, Module.to)
    trainer.fit(module, ckpt_path=None if ckpt_path is None else str(ckpt_path), weights_only=True)
    launched = getattr(trainer.strategy.launcher, "procs", [])  # subprocess.Popen, or multiprocessing's processes
    codes = [(process.pid, process.wait() if hasattr(process, "wait") else process.exitcode) for process in launched]
    failed = [(pid, code) for pid, code in codes if code != 0]
    if failed:
        print(f"error: launched rank processes failed (pid, exit code): {failed}", file=sys.stderr)
        sys.exit(1)
    for callback in getattr(trainer, "callbacks", []):  # set by Lightning's callback connector
        if isinstance(callback, MidEpochCheckpoint) and callback.saved_at < 0 and callback.path.is_file():
            callback.recover()  # this process launched the ranks and trained none
    return trainer.is_global_zero
