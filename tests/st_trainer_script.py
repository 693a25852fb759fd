"""sentence-transformers' own ``SentenceTransformerTrainer`` with the drop-ins, on one or two CPU processes.

    python tests/st_trainer_script.py MODEL_DIR OUTPUT_DIR                            one process
    torchrun --standalone --nproc-per-node 2 tests/st_trainer_script.py MODEL_DIR OUTPUT_DIR    two (gloo)

The trainer's default arguments (DDP with ``find_unused_parameters=True``; the BERT's pooler is unused)
with ``gather_across_devices=True``, SGD (so that a step is its gradient, not Adam's sign of it) and
``dataloader_drop_last=False``, which the trainer turns back on under DDP and this script turns off
again: 14 rows in per-device batches of 4 on two processes, 8 on one. The trainer's batch sampler
draws one seeded permutation; two processes take its batches in turn, so their steps hold the rows
of the one process's steps, split [4, 4] and then [4, 2]. For the plain loss and the cached one
(``mini_batch_size=3``: rank 1's last batch has one mini-batch, rank 0's two), with and without a
hard-negative column, each rank saves ``OUTPUT_DIR/<case>-rank<r>.pt``: the gradients DDP averaged
before each optimizer step, the losses the trainer logged, the loss's class and whether
``MatryoshkaLoss`` around the cached loss trained.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss
from tiny_bert import sentence_model
from transformers import TrainerCallback

from contrastive_dist.compat.sentence_transformers import (
    CachedMultipleNegativesRankingLoss,
    MultipleNegativesRankingLoss,
)

ROWS, WORDS = 14, "a b c d e f g h i j k l m n o p".split()
CASES = [(kind, negatives) for kind in ("mnrl", "cached") for negatives in (False, True)] + [("matryoshka", True)]


def dataset(negatives: bool) -> Dataset:
    generator = torch.Generator().manual_seed(0)

    def texts() -> list[str]:
        lengths = torch.randint(1, 7, (ROWS,), generator=generator).tolist()
        return [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=generator)) for n in lengths]

    columns = {"anchor": texts(), "positive": texts()}
    return Dataset.from_dict({**columns, "negative": texts()} if negatives else columns)


class Recorder(TrainerCallback):
    """The averaged gradients before each optimizer step, and the logged losses."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.grads.append({name: p.grad.detach().clone() for name, p in model.named_parameters()
                           if p.grad is not None})

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def run(model_dir: Path, output: Path, kind: str, negatives: bool) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = sentence_model(model_dir)
    if kind == "mnrl":
        loss: torch.nn.Module = MultipleNegativesRankingLoss(model, gather_across_devices=True)
    else:
        loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=3, gather_across_devices=True)
        if kind == "matryoshka":
            loss = MatryoshkaLoss(model, loss, matryoshka_dims=[16, 8])
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output / "trainer"), per_device_train_batch_size=8 // world_size, num_train_epochs=1,
        learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, use_cpu=True)
    args.dataloader_drop_last = False  # the trainer's __post_init__ sets it under DDP: uneven last steps here
    recorder = Recorder()
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=dataset(negatives), loss=loss,
                                         callbacks=[recorder])
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    torch.save({"grads": recorder.grads, "losses": recorder.losses, "class": type(trainer.loss).__qualname__,
                "module": type(trainer.loss).__module__}, output / f"{kind}-{negatives}-w{world_size}-rank{rank}.pt")


if __name__ == "__main__":
    model_dir, output = Path(sys.argv[1]), Path(sys.argv[2])
    for kind, negatives in CASES:
        run(model_dir, output, kind, negatives)
