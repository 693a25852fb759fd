"""``contrastive_dist.lightning`` under Lightning's ``ModelParallelStrategy`` (2 × 2, data × tensor), no ``group=``.

The ranks are the 4 gloo processes of the suite's worker pool, which Lightning joins as processes it
did not create (``LOCAL_RANK`` set, as under torchrun). ``configure_model`` applies tensor parallelism
over the strategy's ``tensor_parallel`` dimension and FSDP2 over ``data_parallel``; the loaders of
``distributed_loader`` split each global batch over the data-parallel ranks and make them the default
group, so the loss takes no ``group=``. Two epochs of SGD, the last step of each split (1, 0): every
sample once per epoch over the data-parallel ranks, the same batches on a data-parallel rank's
tensor-parallel ranks, at every step the global batch's loss (a loss over the world would count every
row twice: ``+ log 2``), and the parameters of a float64 one-process loop over the same global batches.
"""

from __future__ import annotations

import os
import tempfile
from types import SimpleNamespace

import pytest
import torch
from loss_references import clip_rows
from mesh_models import Towers, global_batch, relative_error
from torch.utils.data import Dataset

from contrastive_dist import DistributedBatchSampler, info_nce, set_default_group

L = pytest.importorskip("lightning")
pytest.importorskip("torch.distributed.fsdp")

LENGTH, BATCH, SEED, LR, EPOCHS = 13, 3, 4, 0.3, 2  # global batches of 2 × 3: 6, 6, 1, split (1, 0) last


class Pairs(Dataset):
    """Sample i: the i-th row of the shared global batch of inputs, and i."""

    def __init__(self) -> None:
        self.x, self.y = global_batch(LENGTH)

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, index: int):
        return self.x[index], self.y[index], index


class ModelParallelPairs(L.LightningModule):
    def __init__(self, communication: str) -> None:
        super().__init__()
        self.towers, self.communication = Towers(), communication
        self.seen: list[tuple[int, list[int], tuple[int, ...], float]] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        for tower in (self.towers.image, self.towers.text):
            parallelize_module(tower, self.device_mesh["tensor_parallel"], plan)
        fully_shard(self.towers, mesh=self.device_mesh["data_parallel"])

    def train_dataloader(self):
        from contrastive_dist.lightning import distributed_loader

        return distributed_loader(Pairs(), self.trainer, batch_size=BATCH, seed=SEED)

    def training_step(self, batch, batch_idx):
        from contrastive_dist.lightning import step_sizes

        x, y, ids = batch
        # no group=: the loaders made the data-parallel ranks the default group
        loss = info_nce(*self.towers(x, y), communication=self.communication)
        self.seen.append((self.current_epoch, ids.tolist(), step_sizes(self.trainer, batch_idx), loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit_under_model_parallel(rank: int, world_size: int) -> dict[str, dict]:
    """One fit in each communication mode; what each rank saw and its final weights."""
    return {communication: _fit(rank, world_size, communication) for communication in ("gather", "ring")}


def _fit(rank: int, world_size: int, communication: str) -> dict:
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor

    saved = dict(os.environ)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    try:
        module = ModelParallelPairs(communication)
        with tempfile.TemporaryDirectory() as root:
            L.Trainer(accelerator="cpu", devices=world_size, max_epochs=EPOCHS, default_root_dir=root,
                      strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2), logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, num_sanity_val_steps=0).fit(module)
        weights = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for name, p in module.towers.named_parameters()}
        return {"seen": module.seen, "weights": weights}
    finally:
        set_default_group(None)
        os.environ.clear()
        os.environ.update(saved)


def reference() -> tuple[list[list[int]], list[float], dict[str, torch.Tensor]]:
    """One process, float64: the same global batches, a plain loop loss and SGD; the orders, losses, final weights."""
    model, data = Towers(), Pairs()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    sampler = DistributedBatchSampler(LENGTH, 2 * BATCH, num_replicas=1, rank=0, seed=SEED)
    orders, losses = [], []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        orders.append([index for batch in sampler for index in batch])
        for batch in sampler:
            images, texts, scale = model(data.x[batch], data.y[batch])
            loss = clip_rows(images, texts, scale, None, symmetric=True).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return orders, losses, {name: p.detach() for name, p in model.named_parameters()}


@pytest.mark.timeout(600)
def test_model_parallel_strategy_trains_to_the_weights_of_one_process_without_group(pool) -> None:
    fits = pool(4).run(fit_under_model_parallel, timeout=400)
    orders, losses, weights = reference()
    for communication in ("gather", "ring"):
        check_fit([fit[communication] for fit in fits], orders, losses, weights)


def check_fit(per_rank: list[dict], orders: list[list[int]], losses: list[float],
              weights: dict[str, torch.Tensor]) -> None:
    for first, second in ((0, 1), (2, 3)):  # a data-parallel rank's tensor-parallel ranks: the same batches and loss
        assert [entry[:3] for entry in per_rank[first]["seen"]] == [entry[:3] for entry in per_rank[second]["seen"]]
        assert [entry[3] for entry in per_rank[first]["seen"]] == pytest.approx(
            [entry[3] for entry in per_rank[second]["seen"]], rel=1e-12)
    for epoch in range(EPOCHS):
        steps = [[entry for entry in per_rank[rank]["seen"] if entry[0] == epoch] for rank in (0, 2)]
        assert [sizes for _, _, sizes, _ in steps[0]] == [(3, 3), (3, 3), (1, 0)]
        # The data-parallel ranks' shares of each step, in rank order: the global order of the epoch.
        assert [index for step in zip(*steps) for _, ids, _, _ in step for index in ids] == orders[epoch]
        # The mean over data-parallel ranks of their losses: the global batch's loss (the contract).
        got = [(first[3] + second[3]) / 2 for first, second in zip(*steps)]
        assert got == pytest.approx(losses[3 * epoch : 3 * epoch + 3], rel=1e-12)
    for record in per_rank:
        for name, expected in weights.items():
            assert relative_error(record["weights"][name], expected) <= 1e-10, name


class StandInMesh:
    """What data_parallel_group reads of a DeviceMesh: its dimensions' names, and slicing by them."""

    def __init__(self, *names: str) -> None:
        self.mesh_dim_names, self.ndim, self.shape = names, len(names), (2,) * len(names)

    def __getitem__(self, names: str | tuple[str, ...]) -> tuple[str, ...]:
        return names if isinstance(names, tuple) else (names,)


class NotLaunched:
    @property
    def device_mesh(self):
        raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")


@pytest.mark.parametrize(("strategy", "expected"), [
    (SimpleNamespace(), None),  # DDP, FSDPStrategy: no mesh, the world
    (NotLaunched(), None),
    (SimpleNamespace(device_mesh=StandInMesh("data_parallel", "tensor_parallel")), ("data_parallel",)),
    (SimpleNamespace(device_mesh=StandInMesh("dp_replicate", "dp_shard", "tp")), ("dp_replicate", "dp_shard")),
    (SimpleNamespace(device_mesh=StandInMesh("pp", "dp", "cp")), ("dp",)),
])  # fmt: skip
def test_the_data_parallel_dimensions_are_picked_by_name(strategy, expected) -> None:
    from contrastive_dist.lightning import data_parallel_group

    assert data_parallel_group(SimpleNamespace(strategy=strategy)) == expected


def test_a_mesh_without_a_data_parallel_name_is_refused() -> None:
    from contrastive_dist.lightning import data_parallel_group

    trainer = SimpleNamespace(strategy=SimpleNamespace(device_mesh=StandInMesh("rows", "columns")))
    with pytest.raises(ValueError, match=r"dimensions \('rows', 'columns'\), and none is named as data-parallel"):
        data_parallel_group(trainer)
