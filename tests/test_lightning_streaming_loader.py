"""``contrastive_dist.lightning.streaming_loader`` and ``step_sizes`` under real Lightning DDP (CPU processes, gloo).

The module's code is what a user writes: ``streaming_loader(...)`` in ``train_dataloader`` and
``step_sizes(self.trainer, batch_idx)`` in ``training_step``, the same step as for map-style data.
Uneven webdataset shards, shuffled per epoch, read by 2 DataLoader workers per rank; the weights
after 2 epochs equal a one-process float64 loop over the recorded global batches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from forked_runs import forked_runs
from test_streaming_lightning import BATCH_SIZE, COUNTS, LR, StreamingModule, point, to_pair
from torch import nn

from contrastive_dist import DistributedStreamingBatches
from contrastive_dist.lightning import step_sizes, streaming_loader

L = pytest.importorskip("lightning")
wds = pytest.importorskip("webdataset")


class LoaderModule(StreamingModule):
    def __init__(self, shards: list[str], out_dir: str, num_workers: int) -> None:
        super().__init__(shards, out_dir)
        self.num_workers = num_workers

    def train_dataloader(self):
        return streaming_loader(self.shards, self.trainer, wds.tarfile_to_samples(), wds.decode(), wds.map(to_pair),
                                batch_size=BATCH_SIZE, example=(point(0), 0), seed=1, num_workers=self.num_workers)

    def training_step(self, batch, batch_idx):
        points, ids = batch
        sizes = step_sizes(self.trainer, batch_idx)
        assert sizes[self.global_rank] == ids.shape[0]
        self.seen.append((self.current_epoch, batch_idx, ids.tolist(), list(sizes)))
        return self.layer(points).pow(2).sum() * (len(sizes) / sum(sizes))


def write_shards(directory: Path) -> list[str]:
    shards, next_id = [], 0
    for index, count in enumerate(COUNTS):
        path = directory / f"shard-{index}.tar"
        with wds.TarWriter(str(path)) as writer:
            for _ in range(count):
                writer.write({"__key__": f"s{next_id:04d}", "cls": next_id})
                next_id += 1
        shards.append(str(path))
    return shards


def trainer(**options):
    defaults = dict(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=2, use_distributed_sampler=False,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0)
    return L.Trainer(**{**defaults, **options})


def fit_on_two_ranks(shards: list[str], out_dir: str) -> None:
    """Fit a :class:`LoaderModule` with 2 workers on 2 ranks forked from this process (tests/forked_runs.py)."""
    # Each rank's workers start from its forkserver: imported there once, not in each worker of each epoch.
    torch.multiprocessing.set_forkserver_preload(["torch", "lightning", "webdataset", __name__])
    trainer(strategy="ddp_fork").fit(LoaderModule(shards, out_dir, num_workers=2))


@pytest.mark.timeout(300)
def test_streaming_loader_under_ddp_equal_steps_every_sample_once_and_exact_weights(tmp_path: Path) -> None:
    fitted = forked_runs().call("test_lightning_streaming_loader.fit_on_two_ranks", write_shards(tmp_path),
                                str(tmp_path), cwd=tmp_path, timeout=240)
    assert fitted.returncode == 0, fitted.stderr[-4000:]
    # The launcher may return although a child failed: trust only what each rank wrote.
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    torch.manual_seed(0)
    reference = nn.Linear(2, 1).double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    orders = []
    for epoch in range(2):
        steps = [[entry for entry in record["seen"] if entry[0] == epoch] for record in records]
        assert [entry[1] for entry in steps[0]] == [entry[1] for entry in steps[1]] == list(range(len(steps[0])))
        orders.append([])
        for step in range(len(steps[0])):
            sizes = [len(steps[0][step][2]), len(steps[1][step][2])]
            assert steps[0][step][3] == steps[1][step][3] == sizes  # step_sizes: the same on both ranks
            ids = steps[0][step][2] + steps[1][step][2]  # rank order: the global batch
            orders[-1].extend(ids)
            loss = reference(torch.stack([point(i) for i in ids])).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert sorted(orders[-1]) == list(range(sum(COUNTS)))  # every sample once, none repeated to pad
        assert 0 in [len(entry[2]) for rank_steps in steps for entry in rank_steps]  # a rank ran out first
    assert orders[0] != orders[1]  # Lightning's set_epoch reached the shard order
    expected = reference.weight.detach().flatten().tolist() + reference.bias.detach().tolist()
    for record in records:
        assert record["w"] == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_one_process_options_and_refusals(tmp_path: Path) -> None:
    shards = write_shards(tmp_path)
    stages = (wds.tarfile_to_samples(), wds.decode(), wds.map(to_pair))
    batches = streaming_loader(shards, None, *stages, batch_size=BATCH_SIZE, example=(point(0), 0), shuffle=False)
    assert isinstance(batches, DistributedStreamingBatches)
    ids = [batch[1].tolist() for batch in batches]
    assert ids == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12]]  # shards in order, batches across shards
    assert batches.sizes(4) == (1,)

    class Trainer:  # what step_sizes reads of a Trainer
        train_dataloader = batches

    assert step_sizes(Trainer(), 3) == (3,)
    with pytest.raises(ValueError, match="sizes of step 7 are not known here; known steps: \\[0, 4\\]"):
        step_sizes(Trainer(), 7)
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        streaming_loader(shards, trainer(use_distributed_sampler=True), *stages, batch_size=2, example=(point(0), 0))
    rank1 = streaming_loader(shards, trainer(), *stages, batch_size=2, example=(point(0), 0), shuffle=False)
    assert rank1.loader.dataset.shard_list.rank == 0 and rank1.loader.dataset.shard_list.num_replicas == 2
    assert rank1.caller_prefetch == 1 and batches.caller_prefetch == 0  # Lightning fetches one batch ahead
    with pytest.raises(TypeError, match="sets 'persistent_workers' itself"):
        streaming_loader(shards, None, *stages, batch_size=2, example=(point(0), 0), persistent_workers=True)
    with pytest.raises(TypeError, match="example must be one sample.*found <class .object.>"):
        streaming_loader(shards, None, *stages, batch_size=2, example=object())


def test_importing_the_package_imports_neither_lightning_nor_webdataset() -> None:
    code = ("import sys, contrastive_dist, contrastive_dist.lightning; "
            "print(sorted(m for m in ('lightning', 'webdataset', 'torchdata') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
