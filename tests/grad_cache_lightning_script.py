"""Lightning DDP on 2 CPU processes, automatic optimization, with or without grad_cache.

    python tests/grad_cache_lightning_script.py cached|reference OUTPUT_DIR [STRATEGY]

Float64, dropout 0.1, CLIP loss with a learnable ``logit_scale``, 17 samples in global batches of
8, 8, 1 (the last split [1, 0]: an empty rank) for 2 epochs, gradients accumulated over 2 steps.
Each rank saves its final ``state_dict`` to ``OUTPUT_DIR/<mode>-rank<r>.pt``. With ``STRATEGY``
``ddp`` (the default) Lightning starts rank 1 by running this same command; ``ddp_fork`` forks both.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from grad_cache_models import Contrastive, make_batches, reference_encode
from torch.utils.data import Dataset

from contrastive_dist import grad_cache
from contrastive_dist.lightning import distributed_loader, step_sizes

LENGTH, BATCH_SIZE, MINI_BATCH_SIZE = 17, 4, 2


class Ids(Dataset):
    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int) -> int:
        return index


class Module(L.LightningModule):
    def __init__(self, mode: str, output: Path) -> None:
        super().__init__()
        self.mode, self.output = mode, output
        self.model = Contrastive("clip", 0.1)
        self.model.loss_options = {"chunk_size": 3}
        self.data = make_batches(1, LENGTH, seed=5)[0]

    def train_dataloader(self) -> object:
        return distributed_loader(Ids(), self.trainer, batch_size=BATCH_SIZE, seed=1)

    def on_train_start(self) -> None:
        torch.manual_seed(100 + self.global_rank)  # the dropout masks, the same in both modes

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        sizes = step_sizes(self.trainer, batch_idx)
        if self.mode == "cached":
            self.model.encode = lambda module, *x: grad_cache(module, *x, mini_batch_size=MINI_BATCH_SIZE, sizes=sizes)
        else:
            self.model.encode = lambda module, *x: reference_encode(module, *x, mini_batch_size=MINI_BATCH_SIZE,
                                                                    largest=max(sizes))
        rows = self.data.rows(0, LENGTH)
        for name in ("x", "views", "tokens", "mask", "labels"):
            setattr(rows, name, getattr(rows, name)[ids])
        return self.model(rows)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def on_train_end(self) -> None:
        torch.save(self.model.state_dict(), self.output / f"{self.mode}-rank{self.global_rank}.pt")


if __name__ == "__main__":
    mode, output, strategy = sys.argv[1], Path(sys.argv[2]), (sys.argv[3:] or ["ddp"])[0]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true", max_epochs=2,
                        accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(Module(mode, output))
