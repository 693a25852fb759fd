"""DistributedShardList + DistributedStreamingBatches on real webdataset tar shards and 3 gloo processes.

DataLoader workers cannot start inside the test suite's daemonic WorkerPool processes, so this
test launches its own 3 ranks (``torch.multiprocessing``, not daemonic) once, runs every scenario
in them, and bounds the whole launch in time. Every rank writes what it saw; the parent checks.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from spawned import launch_ranks
from torch.utils.data import DataLoader

from contrastive_dist import DistributedShardList, DistributedStreamingBatches, EmptySafeCollate, all_gather

wds = pytest.importorskip("webdataset")

WORLD = 3
EXAMPLE = (torch.zeros(2), 0)


def write_shards(directory: Path, counts: list[int], first_id: int = 0) -> tuple[list[str], list[int]]:
    """Tar shards holding counts[i] samples each; sample ids are unique across shards."""
    paths, ids = [], []
    next_id = first_id
    for index, count in enumerate(counts):
        path = directory / f"shard-{first_id:04d}-{index:03d}.tar"
        with wds.TarWriter(str(path)) as writer:
            for _ in range(count):
                writer.write({"__key__": f"sample{next_id:06d}", "cls": next_id})
                ids.append(next_id)
                next_id += 1
        paths.append(str(path))
    return paths, ids


def to_pair(sample: dict) -> tuple[torch.Tensor, int]:
    """Features built from the id, so the test can check each row travelled with its id."""
    value = float(sample["cls"])
    return torch.tensor([value, -value]), sample["cls"]


def pipeline(shard_list: DistributedShardList):
    return wds.DataPipeline(shard_list, wds.tarfile_to_samples(), wds.decode(), wds.map(to_pair))


def run_epochs(shards, *, shuffle, num_workers, lookahead, batch_size, epochs=2):
    """Per epoch: this rank's steps, its ids per step, the gathered ids per step, and checks' failures."""
    shard_list = DistributedShardList(shards, shuffle=shuffle, seed=5)
    # Workers forked from a process that has joined a gloo group hung at start here (some of them, in
    # C code); a forkserver starts them from a clean process.
    context = "forkserver" if num_workers else None
    loader = DataLoader(
        pipeline(shard_list),
        batch_size=batch_size,
        num_workers=num_workers,
        collate_fn=EmptySafeCollate([EXAMPLE]),
        multiprocessing_context=context,
    )
    batches = DistributedStreamingBatches(loader, lookahead=lookahead)
    report = []
    for epoch in range(epochs):
        batches.set_epoch(epoch)
        assert shard_list.epoch == epoch  # reached through the webdataset pipeline's stages
        local, gathered, failures = [], [], []
        for step, (features, ids) in enumerate(batches):
            if not torch.equal(features[:, 0], ids.to(torch.float32)):
                failures.append(f"step {step}: features do not match ids")
            exchanged = all_gather(ids)  # its own size exchange: checks the wrapper's sizes
            if exchanged.sizes != batches.sizes(step):
                failures.append(f"step {step}: sizes {batches.sizes(step)} but the ranks hold {exchanged.sizes}")
            with_sizes = all_gather(ids, sizes=batches.sizes(step))
            local.append(ids.tolist())
            gathered.append(with_sizes.tensor.tolist())
        steps = [None] * dist.get_world_size()
        dist.all_gather_object(steps, len(local))
        report.append({"local": local, "gathered": gathered, "all_steps": steps, "failures": failures})
    return report


def disagreement(rank, *, lookahead, epoch):
    """Ranks that disagree must all raise the same ValueError, quickly, and leave the group usable."""
    shard_list = DistributedShardList(["unused.tar"], shuffle=False)
    loader = DataLoader(pipeline(shard_list), batch_size=2, collate_fn=EmptySafeCollate([EXAMPLE]))
    batches = DistributedStreamingBatches(loader, lookahead=lookahead)
    batches.set_epoch(epoch)
    try:
        next(iter(batches))
    except ValueError as error:
        return str(error)
    return "no error"


def rank_main(rank, store_path, out_dir, scenarios):
    torch.set_num_threads(1)
    # Import once in the forkserver, not again in every worker of every epoch.
    torch_mp.set_forkserver_preload(["torch", "webdataset", "contrastive_dist", __name__])
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results = {"scenarios": [run_epochs(**scenario) for scenario in scenarios]}
    results["lookahead"] = disagreement(rank, lookahead=2 if rank == 0 else 1, epoch=0)
    results["epoch"] = disagreement(rank, lookahead=1, epoch=rank)
    started = time.perf_counter()
    dist.barrier()  # the group still works after the errors
    results["barrier_s"] = time.perf_counter() - started
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def launch(tmp_path: Path, scenarios: list[dict], timeout: float) -> list[dict]:
    return launch_ranks(rank_main, (str(tmp_path / "store"), str(tmp_path), scenarios), WORLD, tmp_path, timeout)


@pytest.mark.timeout(400)
def test_three_ranks_every_sample_once_equal_steps_no_hang(tmp_path):
    scenarios, expected = [], []
    # Per-rank sample counts [10, 0, 7] (one shard per rank), webdataset workers or none.
    shards, ids = write_shards(tmp_path, [10, 0, 7], first_id=0)
    for num_workers, lookahead in ((0, 1), (2, 1), (2, 4)):
        scenarios.append(dict(shards=shards, shuffle=False, num_workers=num_workers, lookahead=lookahead, batch_size=3))
        expected.append((ids, [10, 0, 7]))
    # Uneven shard counts, shuffled per epoch; and more ranks (x workers) than shards.
    shards, ids = write_shards(tmp_path, [4, 6, 0, 3, 5, 2, 1], first_id=1000)
    scenarios.append(dict(shards=shards, shuffle=True, num_workers=2, lookahead=3, batch_size=2))
    expected.append((ids, None))
    shards, ids = write_shards(tmp_path, [5, 3], first_id=2000)
    for num_workers in (0, 2):
        scenarios.append(dict(shards=shards, shuffle=True, num_workers=num_workers, lookahead=1, batch_size=4))
        expected.append((ids, None))

    results = launch(tmp_path, scenarios, timeout=300)

    for index, (all_ids, per_rank_counts) in enumerate(expected):
        for epoch in range(2):
            reports = [result["scenarios"][index][epoch] for result in results]
            assert all(not report["failures"] for report in reports), [r["failures"] for r in reports]
            steps = len(reports[0]["local"])
            assert all(report["all_steps"] == [steps] * WORLD for report in reports)  # equal step counts
            assert all(len(report["local"]) == steps for report in reports)
            # Every rank gathered the same global batches; over the epoch they hold every id once.
            assert all(report["gathered"] == reports[0]["gathered"] for report in reports)
            seen = [sample for step in reports[0]["gathered"] for sample in step]
            assert sorted(seen) == all_ids, (index, epoch)
            local = [sorted(sample for step in report["local"] for sample in step) for report in reports]
            assert sorted(sample for part in local for sample in part) == all_ids
            if per_rank_counts is not None:
                assert [len(part) for part in local] == per_rank_counts
                # The rank with 10 samples sets the pace: ceil(10 / 3) batches, the others pad with empty ones.
                assert steps == 4
                assert [len(batch) for batch in reports[1]["local"]] == [0, 0, 0, 0]

    for result in results:
        assert "same lookahead, epoch" in result["lookahead"] and "rank 0: lookahead=2" in result["lookahead"]
        assert "rank 2: lookahead=1 epoch=2" in result["epoch"]
        assert result["barrier_s"] < 30


def test_single_process_and_argument_errors(tmp_path):
    shards, ids = write_shards(tmp_path, [3, 0, 4])
    shard_list = DistributedShardList(shards, shuffle=True, seed=1)
    loader = DataLoader(pipeline(shard_list), batch_size=2, collate_fn=EmptySafeCollate([EXAMPLE]))
    batches = DistributedStreamingBatches(loader, lookahead=2)
    orders = []
    for epoch in range(2):
        batches.set_epoch(epoch)
        orders.append([sample for _, step_ids in batches for sample in step_ids.tolist()])
        assert sorted(orders[-1]) == ids
    assert orders[0] != orders[1]  # another shard order in epoch 1
    assert batches.sizes(0) == (2,)
    with pytest.raises(ValueError, match="sizes of step 99 are not known"):
        batches.sizes(99)

    with pytest.raises(TypeError, match="cannot build an empty batch.*EmptySafeCollate"):
        DistributedStreamingBatches(DataLoader(pipeline(shard_list), batch_size=2))
    with pytest.raises(ValueError, match="persistent_workers"):
        DistributedStreamingBatches(DataLoader(pipeline(shard_list), num_workers=1, persistent_workers=True))
    with pytest.raises(ValueError, match="lookahead must be an int >= 1"):
        DistributedStreamingBatches(loader, lookahead=0)
    with pytest.raises(TypeError, match="loader must be iterable"):
        DistributedStreamingBatches(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one shard"):
        DistributedShardList([])
    with pytest.raises(TypeError, match="sequence"):
        DistributedShardList("shard-{000..009}.tar")
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, num_replicas=2\)"):
        DistributedShardList(shards, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="seed must fit in a signed 64-bit int"):
        DistributedShardList(shards, seed=2**70)


def test_shard_assignment_covers_every_shard_once():
    for shards_count in (1, 2, 5, 7, 12):
        shards = [f"s{i}" for i in range(shards_count)]
        for world in (1, 3, 4):
            for num_workers in (1, 2, 3):
                for epoch in (0, 1):
                    assigned = []
                    for rank in range(world):
                        shard_list = DistributedShardList(shards, seed=2, num_replicas=world, rank=rank)
                        shard_list.set_epoch(epoch)
                        for worker in range(num_workers):
                            assigned.extend(shard_list.shards_for(worker, num_workers))
                    assert sorted(assigned) == sorted(shards)
    # Worker-major slots: 3 shards over 3 ranks x 2 workers land on 3 different ranks.
    per_rank = [DistributedShardList(["a", "b", "c"], shuffle=False, num_replicas=3, rank=r) for r in range(3)]
    assigned = [shard_list.shards_for(0, 2) + shard_list.shards_for(1, 2) for shard_list in per_rank]
    assert assigned == [["a"], ["b"], ["c"]]


def _random_streams(rank, world_size, configurations):
    """Each configuration: per-rank sample counts, batch size, lookahead. In-memory loaders, no workers."""
    reports = []
    for counts, batch_size, lookahead in configurations:
        ids = torch.arange(sum(counts[:rank]), sum(counts[: rank + 1]))
        local = list(ids.split(batch_size)) if counts[rank] else []
        empty = torch.zeros(0, dtype=torch.int64)
        batches = DistributedStreamingBatches(local, lookahead=lookahead, empty_batch=empty.clone)
        seen, sizes = [], []
        for step, batch in enumerate(batches):
            seen.append(batch.tolist())
            sizes.append(batches.sizes(step))
        reports.append({"seen": seen, "sizes": sizes})
    return reports


def test_window_sizes_and_step_counts_on_random_uneven_ranks(pool):
    generator = torch.Generator().manual_seed(7)
    configurations = []
    for _ in range(40):
        counts = torch.randint(0, 12, (WORLD,), generator=generator)
        counts[torch.randint(0, WORLD, (), generator=generator)] = 0  # always an empty rank
        batch_size, lookahead = (int(value) for value in torch.randint(1, 5, (2,), generator=generator))
        configurations.append((counts.tolist(), batch_size, lookahead))
    results = pool(WORLD).run(_random_streams, configurations)
    for index, (counts, batch_size, _) in enumerate(configurations):
        reports = [result[index] for result in results]
        batches_per_rank = [-(-count // batch_size) for count in counts]
        steps = max(batches_per_rank)
        for rank, report in enumerate(reports):
            assert len(report["seen"]) == steps
            first = sum(counts[:rank])
            expected = [list(range(first + b * batch_size, min(first + counts[rank], first + (b + 1) * batch_size)))
                        for b in range(batches_per_rank[rank])]
            assert report["seen"] == expected + [[]] * (steps - batches_per_rank[rank])  # own batches, then empty
            assert report["sizes"] == reports[0]["sizes"]
        assert [tuple(len(report["seen"][step]) for report in reports) for step in range(steps)] == [
            tuple(size) for size in reports[0]["sizes"]
        ]
