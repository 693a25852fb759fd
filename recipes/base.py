"""The LightningModule both recipes build on: drop-last-free loading, exact mid-epoch resume, test hooks."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import FAIL_AT_STEP, RECORD_SAMPLES
from torch.utils.data import DataLoader, Dataset

from contrastive_dist import DistributedBatchSampler, EmptySafeCollate


class RecipeModule(L.LightningModule):
    """Holds the datasets and builds one :class:`DistributedBatchSampler` per split.

    Every global batch of ``batch_size × world_size`` samples is split over the ranks as evenly
    as possible, so nothing is padded or dropped and every rank runs the same number of steps;
    the last step may leave a rank with 0 rows, which subclasses' ``shared_step`` must accept.
    The number of steps trained in the current epoch is saved in every checkpoint, so a
    resumed run continues with the very next global batch.
    """

    def __init__(self, *, train_set: Dataset, val_set: Dataset, collate: Callable[[list[Any]], Any],
                 batch_size: int, seed: int, num_workers: int, optimizer: str, lr: float,
                 weight_decay: float, val_collate: Callable[[list[Any]], Any] | None = None) -> None:
        super().__init__()
        self.train_set, self.val_set, self.collate = train_set, val_set, collate
        self.val_collate = collate if val_collate is None else val_collate
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.optimizer_name, self.lr, self.weight_decay = optimizer, lr, weight_decay
        self.train_sampler: DistributedBatchSampler | None = None
        self.step_in_epoch = 0
        self._resume_state: dict[str, Any] | None = None
        self._fail_at = int(os.environ.get(FAIL_AT_STEP, "-1"))
        self._record_dir = os.environ.get(RECORD_SAMPLES)

    # -- data -------------------------------------------------------------------------------
    def _loader(self, dataset: Dataset, sampler: DistributedBatchSampler,
                collate: Callable[[list[Any]], Any]) -> DataLoader:
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset, collate),
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def _sampler(self, dataset: Dataset, *, shuffle: bool) -> DistributedBatchSampler:
        return DistributedBatchSampler(len(dataset), self.batch_size,  # type: ignore[arg-type]
                                       num_replicas=self.trainer.world_size, rank=self.trainer.global_rank,
                                       shuffle=shuffle, seed=self.seed)

    def train_dataloader(self) -> DataLoader:
        self.train_sampler = sampler = self._sampler(self.train_set, shuffle=True)
        if self._resume_state is not None:
            sampler.set_epoch(self._resume_state["epoch"])
            sampler.load_state_dict(self._resume_state)
            self.step_in_epoch = self._resume_state["step"]
        return self._loader(self.train_set, sampler, self.collate)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self._sampler(self.val_set, shuffle=False), self.val_collate)

    def on_train_epoch_start(self) -> None:
        if self._resume_state is not None and self._resume_state["epoch"] == self.current_epoch:
            self._resume_state = None  # this epoch continues where the checkpoint left it
            return
        self._resume_state = None
        self.step_in_epoch = 0

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Steps whose optimizer update is done; Lightning's own counters lag or lead by one
        # depending on the hook that saves, and the loader has already prefetched a batch.
        if self.train_sampler is not None:
            state = self.train_sampler.state_dict()
            # The sampler's epoch is the data's epoch; Lightning's counter has moved on once an epoch ends.
            checkpoint["recipe_sampler"] = {**state, "step": int(self.step_in_epoch)}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("recipe_sampler")
        if state is None:
            return
        state = dict(state)
        steps_per_epoch = math.ceil(state["length"] / (state["batch_size"] * state["num_replicas"]))
        if state["step"] >= steps_per_epoch:  # saved at the end of an epoch: start the next one
            state.update(epoch=state["epoch"] + 1, step=0)
        self._resume_state = state

    # -- training ---------------------------------------------------------------------------
    def shared_step(self, batch: Any, sizes: tuple[int, ...]) -> torch.Tensor:
        """This rank's loss under the gradient contract; must accept a 0-row batch."""
        raise NotImplementedError

    def sample_ids(self, batch: Any) -> list[int]:
        """Dataset indices in ``batch`` (for the sample-recording test hook)."""
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.train_sampler is not None
        sizes = tuple(self.train_sampler.sizes(self.step_in_epoch))
        if self._fail_at >= 0 and self.global_step == self._fail_at and self.global_rank == self.trainer.world_size - 1:
            raise RuntimeError(f"{FAIL_AT_STEP}={self._fail_at}: rank {self.global_rank} fails on purpose")
        if self._record_dir is not None:
            with open(Path(self._record_dir) / f"rank{self.global_rank}.txt", "a") as file:
                ids = " ".join(map(str, self.sample_ids(batch)))
                file.write(f"{self.current_epoch} {self.step_in_epoch} {ids}\n")
        loss = self.shared_step(batch, sizes)
        self.step_in_epoch += 1
        # The mean over ranks of the per-rank losses is the single-process loss of the global batch.
        self.log("train/loss", loss.detach(), sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.lr)
        total = max(int(self.trainer.estimated_stepping_batches), 1)
        warmup = max(total // 20, 1)

        def schedule(step: int) -> float:  # linear warm-up, then cosine to zero
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * min(step - warmup, total) / max(total - warmup, 1)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
