"""contrastive_dist.lightning under real Lightning DDP (ddp_spawn, 2 CPU processes, gloo).

One scenario per worker setting: train 2 steps of epoch 0 (a mid-epoch checkpoint), resume from
it to the end of epoch 1. Checked against a float64 one-process loop over the same global batches:
every sample exactly once per epoch in the reference order (set_epoch reshuffles), the last step
split [1, 0] (an empty rank), and the final weights.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from contrastive_dist import DistributedBatchSampler, DistributedInfoNCE

L = pytest.importorskip("lightning")
pytest.importorskip("torchdata")

from contrastive_dist.lightning import distributed_loader, step_sizes  # noqa: E402

LENGTH, BATCH_SIZE, SEED, LR, SCALE = 17, 4, 7, 0.5, 3.0  # global batches 8, 8, 1: the last splits [1, 0]
README = Path(__file__).resolve().parents[1] / "README.md"


class PointDataset(Dataset):
    """Sample i: (a float64 point (2,) made from i, the id i)."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int):
        return torch.tensor([index / LENGTH, (index % 5) - 2.0], dtype=torch.float64), index


def towers() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(2, 3).double(), nn.Linear(2, 3).double()


class PairModule(L.LightningModule):
    """A two-tower contrastive model trained with DistributedInfoNCE, recording what each step saw."""

    def __init__(self, out_dir: str, num_workers: int, tag: str) -> None:
        super().__init__()
        self.image, self.text = towers()
        self.loss = DistributedInfoNCE()
        self.out_dir, self.num_workers, self.tag = out_dir, num_workers, tag
        self.seen: list[tuple[int, int, list[int], list[int]]] = []

    def train_dataloader(self):
        return distributed_loader(PointDataset(), self.trainer, batch_size=BATCH_SIZE, seed=SEED,
                                  num_workers=self.num_workers)

    def training_step(self, batch, batch_idx):
        points, ids = batch
        sizes = step_sizes(self.trainer, batch_idx)
        self.seen.append((self.current_epoch, batch_idx, ids.tolist(), list(sizes)))
        # With sizes= the loss verifies them against the rows every rank holds: a wrong tuple raises.
        return self.loss(self.image(points), self.text(points.flip(1)), SCALE, sizes=sizes)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_train_end(self) -> None:
        weights = [p.detach().flatten().tolist() for p in self.parameters()]
        record = {"seen": self.seen, "weights": weights}
        Path(self.out_dir, f"{self.tag}-rank{self.global_rank}.json").write_text(json.dumps(record))


def reference(epochs: int) -> tuple[list[list[int]], list[list[float]]]:
    """One process, float64, a plain loop and a plain CLIP loss: (global order per epoch, weights)."""
    image, text = towers()
    optimizer = torch.optim.SGD([*image.parameters(), *text.parameters()], lr=LR)
    dataset = PointDataset()
    sampler = DistributedBatchSampler(LENGTH, 2 * BATCH_SIZE, num_replicas=1, rank=0, seed=SEED)
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append([])
        for global_batch in sampler:
            orders[-1].extend(global_batch)
            points = torch.stack([dataset[index][0] for index in global_batch])
            logits = SCALE * image(points) @ text(points.flip(1)).T
            labels = torch.arange(len(global_batch))
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    weights = [p.detach().flatten().tolist() for p in (*image.parameters(), *text.parameters())]
    return orders, weights


def trainer(**options):
    defaults = dict(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    return L.Trainer(**{**defaults, **options})


@pytest.mark.timeout(420)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ddp_mid_epoch_resume_sees_every_sample_once_and_trains_to_the_weights_of_one_process(tmp_path, num_workers):
    out = str(tmp_path)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer(max_steps=2, callbacks=[saver]).fit(PairModule(out, num_workers, "first"))
    checkpoint = tmp_path / "epoch=0-step=2.ckpt"
    assert checkpoint.exists()
    trainer(max_epochs=2, enable_checkpointing=False).fit(PairModule(out, num_workers, "resumed"), ckpt_path=checkpoint)

    # The launcher may return although a child failed: trust only what each rank wrote.
    runs = {tag: [json.loads((tmp_path / f"{tag}-rank{rank}.json").read_text()) for rank in range(2)]
            for tag in ("first", "resumed")}
    reference_orders, reference_weights = reference(2)
    assert reference_orders[0] != reference_orders[1]  # set_epoch reached the sampler
    for epoch in range(2):
        per_rank = [[entry for tag in ("first", "resumed") for entry in runs[tag][rank]["seen"] if entry[0] == epoch]
                    for rank in range(2)]
        assert [[entry[1] for entry in steps] for steps in per_rank] == [[0, 1, 2], [0, 1, 2]]  # no step twice
        assert [len(per_rank[rank][-1][2]) for rank in range(2)] == [1, 0]  # rank 1 trained on an empty batch
        assert [entry[3] for entry in per_rank[0]] == [[4, 4], [4, 4], [1, 0]]  # step_sizes, resumed included
        # Rank 0's share, then rank 1's, step by step: the global order of the epoch.
        order = [index for step in range(3) for rank in range(2) for index in per_rank[rank][step][2]]
        assert order == reference_orders[epoch]
        assert sorted(order) == list(range(LENGTH))
    assert [entry[:2] for entry in runs["resumed"][0]["seen"]][:1] == [[0, 2]]  # resumed mid-epoch 0
    for record in runs["resumed"]:
        got = [value for tensor in record["weights"] for value in tensor]
        expected = [value for tensor in reference_weights for value in tensor]
        assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)


def test_a_trainer_that_would_replace_the_sampler_is_refused():
    dataset = PointDataset()
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        distributed_loader(dataset, trainer(use_distributed_sampler=True), batch_size=4)
    loader = distributed_loader(dataset, trainer(), batch_size=4, shuffle=False)  # not launched: rank 0 of 2
    assert [ids.tolist() for _, ids in loader] == [[0, 1, 2, 3], [8, 9, 10, 11], [16]]
    with pytest.raises(TypeError, match="sets 'drop_last' itself"):
        distributed_loader(dataset, None, batch_size=4, drop_last=True)


def test_step_sizes_names_a_loader_it_cannot_read():
    class PlainTrainer:  # what step_sizes reads of a Trainer
        train_dataloader = DataLoader(PointDataset(), batch_size=4)

    with pytest.raises(TypeError, match="built by distributed_loader.*DataLoader"):
        step_sizes(PlainTrainer(), 0)


def test_importing_the_package_imports_neither_lightning_nor_torchvision():
    code = ("import sys, contrastive_dist, contrastive_dist.lightning; "
            "print(sorted(m for m in ('lightning', 'torchvision', 'torchdata') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.timeout(240)
def test_readme_lightning_module_trains_on_two_processes(tmp_path):
    (block,) = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
                if "contrastive_dist.lightning import distributed_loader" in block]
    script = tmp_path / "readme_module.py"
    script.write_text(block)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "every sample once" in result.stdout
