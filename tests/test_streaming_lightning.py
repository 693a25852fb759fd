"""DistributedStreamingBatches under Lightning DDP (2 CPU processes, use_distributed_sampler=False).

Webdataset shards of uneven sizes; the rank that runs out trains on empty batches; the weights after
2 epochs equal a one-process float64 run over the same global batches.

The ddp_spawn children end as Lightning ends them (``destroy_process_group`` at exit, then a normal
interpreter exit). A child once aborted there ("terminate called without an active exception"), as
a process does when gloo frees a collective's tensors on its worker thread, a moment after the call,
while the interpreter finalizes; the stream's exchange is among the last collectives of an epoch. The
package's collectives now return only once gloo has let go of their tensors (``engine/_settle.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from contrastive_dist import DistributedShardList, DistributedStreamingBatches, EmptySafeCollate

L = pytest.importorskip("lightning")
wds = pytest.importorskip("webdataset")

COUNTS, BATCH_SIZE, LR = [7, 2, 0, 4], 3, 0.1  # rank 0 reads shards 0, 2 (7 samples), rank 1 shards 1, 3 (6)


def point(sample_id: int) -> torch.Tensor:
    return torch.tensor([sample_id / len(COUNTS) / 4, (sample_id % 5) - 2.0], dtype=torch.float64)


def to_pair(sample: dict) -> tuple[torch.Tensor, int]:
    return point(sample["cls"]), sample["cls"]


class StreamingModule(L.LightningModule):
    def __init__(self, shards: list[str], out_dir: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(2, 1).double()
        self.shards, self.out_dir = shards, out_dir
        self.seen: list[tuple[int, int, list[int], list[int]]] = []

    def train_dataloader(self):
        # Built here: the process group exists, so the shard list reads rank and world from it.
        shard_list = DistributedShardList(self.shards, shuffle=False)
        dataset = wds.DataPipeline(shard_list, wds.tarfile_to_samples(), wds.decode(), wds.map(to_pair))
        loader = DataLoader(dataset, batch_size=BATCH_SIZE, collate_fn=EmptySafeCollate([(point(0), 0)]))
        self.batches = DistributedStreamingBatches(loader)
        return self.batches

    def training_step(self, batch, batch_idx):
        points, ids = batch
        # Lightning fetches a batch ahead; sizes(batch_idx) is still this step's, kept by the wrapper.
        sizes = self.batches.sizes(batch_idx)
        assert sizes[self.global_rank] == ids.shape[0]
        self.seen.append((self.current_epoch, batch_idx, ids.tolist(), list(sizes)))
        # The contract: loss_r = (W / N) * this rank's sum, connected to the weights even with 0 rows.
        return self.layer(points).pow(2).sum() * (len(sizes) / sum(sizes))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def on_train_end(self) -> None:
        weights = self.layer.weight.detach().flatten().tolist() + self.layer.bias.detach().tolist()
        Path(self.out_dir, f"rank{self.global_rank}.json").write_text(json.dumps({"seen": self.seen, "w": weights}))


@pytest.mark.timeout(240)
def test_lightning_ddp_streaming_equal_steps_every_sample_once_and_exact_weights(tmp_path):
    shards, next_id = [], 0
    for index, count in enumerate(COUNTS):
        path = tmp_path / f"shard-{index}.tar"
        with wds.TarWriter(str(path)) as writer:
            for _ in range(count):
                writer.write({"__key__": f"s{next_id:04d}", "cls": next_id})
                next_id += 1
        shards.append(str(path))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_epochs=2,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(StreamingModule(shards, str(tmp_path)))
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]

    torch.manual_seed(0)
    reference = nn.Linear(2, 1).double()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for epoch in range(2):
        steps = [[entry for entry in record["seen"] if entry[0] == epoch] for record in records]
        assert len(steps[0]) == len(steps[1]) == 3  # ceil(7 / 3) on rank 0; rank 1 has 2 batches + 1 empty
        assert [len(entry[2]) for entry in steps[1]] == [3, 3, 0]
        global_ids = []
        for step in range(3):
            ids = steps[0][step][2] + steps[1][step][2]  # rank order: the global batch
            assert steps[0][step][3] == steps[1][step][3] == [len(steps[0][step][2]), len(steps[1][step][2])]
            global_ids.extend(ids)
            loss = reference(torch.stack([point(i) for i in ids])).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        assert sorted(global_ids) == list(range(sum(COUNTS)))
    expected = reference.weight.detach().flatten().tolist() + reference.bias.detach().tolist()
    for record in records:
        assert record["w"] == pytest.approx(expected, rel=1e-12, abs=1e-14)
