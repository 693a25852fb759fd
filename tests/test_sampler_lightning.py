"""DistributedBatchSampler under Lightning: DDP on 2 CPU processes, set_epoch, empty ranks, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, SequentialSampler

from contrastive_dist import DistributedBatchSampler, EmptySafeCollate

L = pytest.importorskip("lightning")

LENGTH, BATCH_SIZE, SEED, LR = 17, 4, 7, 0.1  # 2 ranks: global batches 8, 8, 1 -> last step sizes (1, 0)


class PointDataset(Dataset):
    """Sample i: (a float64 point (2,) made from i, the id i)."""

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int):
        return torch.tensor([index / LENGTH, (index % 5) - 2.0], dtype=torch.float64), index


class ResumableDataLoader(DataLoader):
    """A DataLoader Lightning treats as stateful: it saves and restores the batch sampler's position."""

    def state_dict(self):
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state):
        self.batch_sampler.load_state_dict(state)


class RecordingModule(L.LightningModule):
    def __init__(self, out_dir: str | None = None, loader_cls: type = DataLoader) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(2, 1).double()
        self.out_dir = out_dir
        self.loader_cls = loader_cls
        self.seen: list[tuple[int, int, list[int]]] = []

    def train_dataloader(self):
        dataset = PointDataset()
        # Built here: the process group exists, so rank and world come from it.
        sampler = DistributedBatchSampler(dataset, BATCH_SIZE, seed=SEED)
        return self.loader_cls(dataset, batch_sampler=sampler, collate_fn=EmptySafeCollate(dataset))

    def training_step(self, batch, batch_idx):
        points, ids = batch
        self.seen.append((self.current_epoch, batch_idx, ids.tolist()))
        sizes = self.trainer.train_dataloader.batch_sampler.sizes(batch_idx)
        output = self.layer(points)
        # The contract: loss_r = (W / N) * sum of this rank's terms, so DDP's gradient average is the
        # global-batch gradient. On a 0-row batch the sum is 0 but still connected to the weights, so
        # this rank joins DDP's gradient all-reduce. Never return None here: Lightning would skip the
        # backward on this rank alone and the other ranks would wait for it forever.
        loss = output.pow(2).sum() * (len(sizes) / sum(sizes))
        assert loss.requires_grad
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_train_end(self) -> None:
        if self.out_dir is None:
            return
        record = {
            "seen": self.seen,
            "weight": self.layer.weight.detach().flatten().tolist() + self.layer.bias.detach().tolist(),
        }
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))


def reference_training(epochs: int) -> tuple[list[list[int]], list[float]]:
    """One process, float64, plain loop over the same global batches: (global order per epoch, weights)."""
    torch.manual_seed(0)
    layer = nn.Linear(2, 1).double()
    optimizer = torch.optim.SGD(layer.parameters(), lr=LR)
    dataset = PointDataset()
    sampler = DistributedBatchSampler(LENGTH, 2 * BATCH_SIZE, num_replicas=1, rank=0, seed=SEED)
    orders = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        orders.append([])
        for global_batch in sampler:
            orders[-1].extend(global_batch)
            points = torch.stack([dataset[index][0] for index in global_batch])
            loss = layer(points).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return orders, layer.weight.detach().flatten().tolist() + layer.bias.detach().tolist()


def _trainer(**options):
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    return L.Trainer(**{**defaults, **options})


@pytest.mark.timeout(180)
def test_ddp_two_processes_every_sample_once_and_global_batch_gradients(tmp_path):
    trainer = _trainer(devices=2, strategy="ddp_spawn", max_epochs=2)
    trainer.fit(RecordingModule(str(tmp_path)))
    # The launcher may return although a child failed: trust only what each rank wrote.
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    reference_orders, reference_weights = reference_training(2)
    for epoch in range(2):
        steps = [[entry for entry in record["seen"] if entry[0] == epoch] for record in records]
        assert [len(per_rank) for per_rank in steps] == [3, 3]
        assert [len(steps[rank][-1][2]) for rank in range(2)] == [1, 0]  # rank 1 trained on an empty batch
        # Rank 0's share, then rank 1's, step by step: the global order of the epoch.
        order = [index for step in range(3) for rank in range(2) for index in steps[rank][step][2]]
        assert sorted(order) == list(range(LENGTH))
        assert order == reference_orders[epoch]
    assert reference_orders[0] != reference_orders[1]  # set_epoch reached the sampler
    for record in records:
        assert record["weight"] == pytest.approx(reference_weights, rel=1e-12, abs=1e-14)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stateful", [True, False])
def test_mid_epoch_resume(tmp_path, stateful):
    loader_cls = ResumableDataLoader if stateful else DataLoader
    first = RecordingModule(loader_cls=loader_cls)
    # A checkpoint written inside epoch 0, after its 2nd step (one written when `max_steps` ends a
    # run counts as an epoch end for Lightning, and the resumed run starts at epoch 1).
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    _trainer(devices=1, max_epochs=1, enable_checkpointing=True, callbacks=[saver]).fit(first)
    checkpoint = tmp_path / "epoch=0-step=2.ckpt"
    assert checkpoint.exists()

    resumed = RecordingModule(loader_cls=loader_cls)
    _trainer(devices=1, max_epochs=2).fit(resumed, ckpt_path=checkpoint)

    sampler = DistributedBatchSampler(LENGTH, BATCH_SIZE, num_replicas=1, rank=0, seed=SEED)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    assert [ids for _, _, ids in first.seen] == epochs[0]
    in_resumed_epoch0 = [ids for epoch, _, ids in resumed.seen if epoch == 0]
    assert [ids for epoch, _, ids in resumed.seen if epoch == 1] == epochs[1]
    if stateful:
        # Lightning saved the sampler's position and restored it: the rest of epoch 0, nothing twice.
        assert in_resumed_epoch0 == epochs[0][2:]
    else:
        # A plain DataLoader has no state: Lightning replays epoch 0 from its start for the
        # remaining number of steps, so samples repeat and others are never seen in that epoch.
        assert in_resumed_epoch0 == epochs[0][: len(epochs[0]) - 2]


def test_lightning_refuses_to_wrap_it_when_use_distributed_sampler_is_left_on():
    # What Lightning does under DDP with use_distributed_sampler=True: rebuild the loader around a
    # new sampler. It cannot for this batch sampler, and says to set use_distributed_sampler=False.
    from lightning.pytorch.utilities.data import _update_dataloader

    dataset = PointDataset()
    loader = DataLoader(dataset, batch_sampler=DistributedBatchSampler(dataset, 4, num_replicas=2, rank=0))
    with pytest.raises(TypeError, match="use_distributed_sampler=False"):
        _update_dataloader(loader, SequentialSampler(dataset))
