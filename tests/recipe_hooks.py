"""Run a recipe as its command line does, with test hooks added from here (the recipes carry none).

    python tests/recipe_hooks.py clip|simclr [recipe flags...]

Hooks, read from the environment (Lightning's ddp launcher starts the other ranks with the same
command and environment, so every rank gets them):

* ``RECIPE_FAIL_AT_STEP=k``: the last rank raises at global step k (exit-code checks);
* ``RECIPE_RECORD_SAMPLES=DIR``: every rank appends ``epoch step ids...`` of each step to ``DIR/rank<r>.txt``.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L

# The recipes import their shared helper as a sibling module, as `python recipes/clip.py` allows.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))


class Hooks(L.Callback):
    def __init__(self) -> None:
        self.fail_at = int(os.environ.get("RECIPE_FAIL_AT_STEP", "-1"))
        self.record = os.environ.get("RECIPE_RECORD_SAMPLES")

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.fail_at and trainer.global_rank == trainer.world_size - 1:
            raise RuntimeError(f"RECIPE_FAIL_AT_STEP={self.fail_at}: rank {trainer.global_rank} fails on purpose")
        if self.record is not None:
            ids = " ".join(map(str, batch[-1].tolist()))  # both recipes' batches end with the sample ids
            with open(Path(self.record) / f"rank{trainer.global_rank}.txt", "a") as file:
                file.write(f"{trainer.current_epoch} {batch_idx} {ids}\n")


if __name__ == "__main__":
    recipe = importlib.import_module(sys.argv[1])
    recipe.main(sys.argv[2:], callbacks=[Hooks()])
