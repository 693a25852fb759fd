"""contrastive_dist.lightning under real Lightning DDP (CPU processes, gloo).

One scenario per worker setting: train 1 step of epoch 0 on 2 devices × 6 (a mid-epoch checkpoint),
resume from it on 3 devices × 4, the same global batch of 12, to the end of epoch 1, with another
number of DataLoader workers. Checked against a float64 one-process loop over the same global
batches: every sample exactly once per epoch in the reference order (set_epoch reshuffles), the
last step split [1, 0, 0] (empty ranks), and the final weights. A resume that would change the
number of steps of the epoch (3 devices × 6) is refused before any step.
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
from forked_runs import forked_runs
from torch import nn
from torch.utils.data import DataLoader, Dataset

from contrastive_dist import DistributedBatchSampler, DistributedInfoNCE

L = pytest.importorskip("lightning")

from contrastive_dist.lightning import distributed_loader, step_sizes  # noqa: E402

LENGTH, GLOBAL_BATCH, SEED, LR, SCALE = 37, 12, 7, 0.5, 3.0  # global batches 12, 12, 12, 1: the last one alone


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

    def __init__(self, out_dir: str, num_workers: int, tag: str, batch_size: int) -> None:
        super().__init__()
        self.image, self.text = towers()
        self.loss = DistributedInfoNCE()
        self.out_dir, self.num_workers, self.tag, self.batch_size = out_dir, num_workers, tag, batch_size
        self.seen: list[tuple[int, int, list[int], list[int]]] = []

    def train_dataloader(self):
        return distributed_loader(PointDataset(), self.trainer, batch_size=self.batch_size, seed=SEED,
                                  num_workers=self.num_workers)

    def training_step(self, batch, batch_idx):
        points, ids = batch
        sizes = step_sizes(self.trainer, batch_idx)
        self.seen.append((self.current_epoch, batch_idx, ids.tolist(), list(sizes)))
        with open(Path(self.out_dir, f"{self.tag}-rank{self.global_rank}.steps"), "a") as steps:
            steps.write(f"{self.current_epoch} {batch_idx}\n")  # written as it happens, kept if a later step fails
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
    sampler = DistributedBatchSampler(LENGTH, GLOBAL_BATCH, num_replicas=1, rank=0, seed=SEED)
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


def fit_pairs(out_dir: str, num_workers: int, tag: str, batch_size: int, devices: int, options: dict,
              ckpt_path: str | None) -> None:
    """Fit a :class:`PairModule` on ``devices`` ranks forked from this process (a run of tests/forked_runs.py).

    ``options``: the Trainer's; ``every_step_checkpoints``: a ``ModelCheckpoint`` after every step.
    """
    # Each rank's workers start from its forkserver: imported there once, not in each worker of each epoch.
    torch.multiprocessing.set_forkserver_preload(["torch", "lightning", __name__])
    callbacks = []
    if options.pop("every_step_checkpoints", False):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=out_dir, every_n_train_steps=1, save_top_k=-1))
    module = PairModule(out_dir, num_workers, tag, batch_size)
    trainer(devices=devices, strategy="ddp_fork", callbacks=callbacks, **options).fit(module, ckpt_path=ckpt_path)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("workers_saved", "workers_resumed"), [(0, 2), (2, 0)])
def test_ddp_resume_on_three_devices_sees_every_sample_once_and_trains_to_the_weights_of_one_process(
    tmp_path, workers_saved, workers_resumed
):
    def fit(tag: str, num_workers: int, batch_size: int, devices: int, options: dict,
            ckpt_path: Path | None = None) -> subprocess.CompletedProcess[str]:
        return forked_runs().call("test_lightning.fit_pairs", str(tmp_path), num_workers, tag, batch_size, devices,
                                  options, None if ckpt_path is None else str(ckpt_path), cwd=tmp_path, timeout=240)

    first = fit("first", workers_saved, GLOBAL_BATCH // 2, 2, {"max_steps": 1, "every_step_checkpoints": True})
    checkpoint = tmp_path / "epoch=0-step=1.ckpt"
    assert first.returncode == 0 and checkpoint.exists(), first.stderr[-4000:]
    resumed = fit("resumed", workers_resumed, GLOBAL_BATCH // 3, 3, {"max_epochs": 2, "enable_checkpointing": False},
                  checkpoint)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    # The launcher may return although a child failed: trust only what each rank wrote.
    runs = {tag: [json.loads(path.read_text()) for path in sorted(tmp_path.glob(f"{tag}-rank*.json"))]
            for tag in ("first", "resumed")}
    assert [len(runs["first"]), len(runs["resumed"])] == [2, 3]
    reference_orders, reference_weights = reference(2)
    assert reference_orders[0] != reference_orders[1]  # set_epoch reached the sampler
    for epoch in range(2):
        # step -> (per-rank ids, step_sizes), from whichever run took the step.
        steps = {}
        for tag in ("first", "resumed"):
            for rank_record in runs[tag]:
                for entry_epoch, step, ids, sizes in rank_record["seen"]:
                    if entry_epoch == epoch:
                        steps.setdefault(step, {"ids": [], "sizes": sizes, "tag": tag})["ids"].append(ids)
        assert sorted(steps) == [0, 1, 2, 3]  # no step twice, none missing
        assert [steps[step]["tag"] for step in range(4)] == (["first"] + ["resumed"] * 3 if epoch == 0 else
                                                              ["resumed"] * 4)
        assert [steps[step]["sizes"] for step in range(4)] == ([[6, 6]] if epoch == 0 else [[4, 4, 4]]) + [
            [4, 4, 4]] * 2 + [[1, 0, 0]]  # step_sizes, resumed included; two ranks with an empty last batch
        # Ranks' shares in rank order, step by step: the global order of the epoch.
        order = [index for step in range(4) for part in steps[step]["ids"] for index in part]
        assert order == reference_orders[epoch]
        assert sorted(order) == list(range(LENGTH))
    for record in runs["resumed"]:
        got = [value for tensor in record["weights"] for value in tensor]
        expected = [value for tensor in reference_weights for value in tensor]
        assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)

    # 3 devices × 8 is another global batch: the rest of epoch 0 would take 2 steps after the first, 3 in
    # all, but Lightning keeps every epoch at the 2 steps of a fresh one. Refused before any step (and
    # before any loader starts its workers: checked once, 3 processes of ~5 s of imports each).
    if workers_resumed:
        return
    refused = fit("refused", workers_resumed, 8, 3, {"max_epochs": 2, "enable_checkpointing": False}, checkpoint)
    assert refused.returncode != 0
    assert re.search("12 of its 37 samples.*end after 3 steps.*at the 2 steps of a fresh one", refused.stderr)
    assert not list(tmp_path.glob("refused-rank*"))  # no rank took a step


def test_a_trainer_that_would_replace_the_sampler_is_refused():
    dataset = PointDataset()
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        distributed_loader(dataset, trainer(use_distributed_sampler=True), batch_size=4)
    loader = distributed_loader(dataset, trainer(), batch_size=4, shuffle=False)  # not launched: rank 0 of 2
    assert [ids.tolist() for _, ids in loader] == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19], [24, 25, 26, 27],
                                                   [32, 33, 34]]
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


def test_step_sizes_refuses_a_step_that_is_not_the_loaders_batch():
    # What a resumed run looks like when Lightning never gave the loader its saved position (Lightning
    # issue #20550): its batch_idx continues from the checkpoint, the loader starts the epoch again.
    class ResumedTrainer:  # what step_sizes reads of a Trainer
        train_dataloader = distributed_loader(PointDataset(), None, batch_size=4)

    next(iter(ResumedTrainer.train_dataloader))
    assert step_sizes(ResumedTrainer(), 0) == (4,)
    with pytest.raises(ValueError, match="Lightning trains step 2 of the epoch, but the loader's batch is its step 0 "
                                         r"\(a run resumed .*issue #20550"):
        step_sizes(ResumedTrainer(), 2)
