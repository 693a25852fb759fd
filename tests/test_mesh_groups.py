"""Every layer that takes ``group=`` agrees on a mesh's data-parallel dimension, on 4 real gloo processes.

On a 2 × 2 ``dp × tp`` mesh: the sampler and the streams (real webdataset shards) give each
data-parallel rank its samples exactly once per epoch and a data-parallel rank's tensor-parallel ranks
the same batches; with :func:`~contrastive_dist.set_default_group` and no ``group=`` anywhere, the
gather, the loss, SyncBatchNorm, the queue, the gradient cache, the retrieval metric and the
tensor-parallel collectives work over ``dp`` exactly as one process over the global batch. A rank
outside the group it is given is told so, naming the group and the rank, by every entry point.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from loss_references import clip_rows
from mesh_models import global_batch, mesh, relative_error, shard
from test_streaming import write_shards
from torch import nn

from contrastive_dist import (
    DistributedBatchSampler,
    DistributedInfoNCE,
    DistributedMemoryQueue,
    DistributedShardList,
    DistributedStreamingBatches,
    SyncBatchNorm,
    all_gather,
    copy_to_group,
    grad_cache,
    info_nce,
    reduce_from_group,
    retrieval_accuracy,
    set_default_group,
)
from contrastive_dist._dist import process_group
from contrastive_dist.lightning import streaming_loader

wds = pytest.importorskip("webdataset")

DP_OF_RANK = (0, 0, 1, 1)  # init_device_mesh lays ranks out row-major: dp = rank // 2, tp = rank % 2
SIZES = (3, 0)  # the data-parallel batches, one empty


def data_per_rank(rank: int, world_size: int, shards: list[str]) -> dict:
    """The sampler's batches (two epochs) and the stream's (one epoch, the default group set) on this rank."""
    dp = mesh("dp_tp")["dp"]
    sampler = DistributedBatchSampler(33, 4, group=dp, seed=3)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epochs.append([[batch, sampler.sizes(step)] for step, batch in enumerate(sampler)])
    set_default_group(dp)
    try:
        batches = streaming_loader(shards, None, wds.tarfile_to_samples(), wds.decode(), wds.to_tuple("cls"),
                                   batch_size=3, example=(0,))
        stream = [[ids.tolist(), batches.sizes(step)] for step, (ids,) in enumerate(batches)]
    finally:
        set_default_group(None)
    return {"sampler": epochs, "stream": stream}


def test_sampler_and_streams_give_each_dp_rank_its_samples_once_and_tp_ranks_the_same(pool, tmp_path) -> None:
    shards, ids = write_shards(tmp_path, [4, 3, 5, 2, 6])
    per_rank = pool(4).run(data_per_rank, shards, timeout=180)  # the first mesh and webdataset imports
    assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3]  # a dp rank's tp ranks: the same batches
    for epoch in range(2):
        steps = [per_rank[rank]["sampler"][epoch] for rank in (0, 2)]
        assert len(steps[0]) == len(steps[1])
        assert sorted(index for dp in steps for batch, _ in dp for index in batch) == list(range(33))
        assert steps[0][-1][1] == (1, 0)  # 33 = 4 steps × (2 dp ranks × 4) + 1: the last step split (1, 0)
    stream = [per_rank[rank]["stream"] for rank in (0, 2)]
    assert len(stream[0]) == len(stream[1])
    assert sorted(sample for dp in stream for batch, _ in dp for sample in batch) == sorted(ids)
    assert all(sizes == (len(stream[0][step][0]), len(stream[1][step][0])) for step, (_, sizes) in enumerate(stream[0]))


def layers_over_the_default_group(rank: int, world_size: int) -> dict[str, float]:
    """With the default group ``dp`` and no ``group=``: each layer's result against one process on the global batch."""
    devices = mesh("dp_tp")
    dp_rank = devices.get_local_rank("dp")
    x, y = global_batch(sum(SIZES))
    upstream = torch.linspace(-1, 1, sum(SIZES) * x.shape[1], dtype=torch.float64).reshape(x.shape)
    local_x, local_y, local_up = (shard(part, SIZES, dp_rank).clone() for part in (x, y, upstream))
    errors: dict[str, float] = {}
    set_default_group(devices["dp"])
    try:
        errors["gather sizes"] = float(all_gather(local_x).sizes != SIZES)
        # SyncBatchNorm: the global batch's statistics, and the input gradient through them.
        norm, inputs = SyncBatchNorm(x.shape[1]).double(), local_x.requires_grad_()
        (norm(inputs) * local_up).sum().backward()
        whole = x.clone().requires_grad_()
        expected = F.batch_norm(whole, None, None, training=True)
        (expected * upstream).sum().backward()
        errors["SyncBatchNorm grad"] = relative_error(inputs.grad, shard(whole.grad, SIZES, dp_rank))
        # The loss: the global batch's value on every rank; the queue: the global batch's keys, newest first.
        value = DistributedInfoNCE()(local_x.detach(), local_y, 2.0)
        rows = clip_rows(x, y, torch.tensor(2.0), None, symmetric=True)
        errors["loss"] = abs(value.item() - rows.mean().item())
        queue = DistributedMemoryQueue(8, x.shape[1], dtype=torch.float64)
        queue.enqueue(local_y)
        errors["queue"] = relative_error(queue.negatives.keys, y.flip(0))
        encoder = nn.Linear(x.shape[1], 4).double()
        torch.nn.init.constant_(encoder.weight, 0.5)
        cached = grad_cache(encoder, local_x.detach(), mini_batch_size=2)
        errors["grad_cache"] = relative_error(cached, encoder(local_x.detach()))
        accuracy = retrieval_accuracy(local_x.detach(), local_y, top_k=(1,))["image_to_text_r1"].item()
        scores = x @ y.T  # pair i retrieved at 1: no text scores above its own
        errors["retrieval"] = abs(accuracy - (scores > scores.diag()[:, None]).sum(1).eq(0).double().mean().item())
        errors["tensor-parallel all-reduce"] = abs(reduce_from_group(torch.ones(1)).item() - len(SIZES))
        errors["copy_to_group backward"] = _copy_backward_error(len(SIZES))
    finally:
        set_default_group(None)
    return errors


def _copy_backward_error(world_size: int) -> float:
    value = torch.ones(2, requires_grad=True)
    copy_to_group(value).sum().backward()
    return float((value.grad - world_size).abs().max())


def test_with_the_default_group_every_layer_works_over_the_data_parallel_ranks(pool) -> None:
    for errors in pool(4).run(layers_over_the_default_group, timeout=180):
        assert all(error <= 1e-12 for error in errors.values()), errors


def outside_the_group(rank: int, world_size: int) -> dict[str, str]:
    """On ranks 2 and 3, every entry point called with a group (or mesh) of ranks 0 and 1: what each raised."""
    from torch.distributed.device_mesh import DeviceMesh

    group, small_mesh = dist.new_group([0, 1]), DeviceMesh("cpu", [0, 1])  # made on every rank
    if rank < 2:
        return {}
    x = torch.randn(2, 3)
    calls = {
        "info_nce": lambda group: info_nce(x, x, group=group),
        "all_gather": lambda group: all_gather(x, group=group),
        "copy_to_group": lambda group: copy_to_group(x, group=group),
        "retrieval_accuracy": lambda group: retrieval_accuracy(x, x, group=group),
        "SyncBatchNorm": lambda group: SyncBatchNorm(3, group=group)(x),
        "grad_cache": lambda group: grad_cache(nn.Linear(3, 3), x, mini_batch_size=1, group=group),
        "queue": lambda group: DistributedMemoryQueue(4, 3, group=group).enqueue(x),
        "sampler": lambda group: DistributedBatchSampler(8, 2, group=group),
        "shard list": lambda group: DistributedShardList(["a.tar", "b.tar"], group=group),
        "streams": lambda group: list(DistributedStreamingBatches([x], empty_batch=lambda: x[:0], group=group)),
        "set_default_group": set_default_group,
    }
    raised = {}
    for given_name, given in (("group", group), ("mesh", small_mesh)):
        for name, call in calls.items():
            try:
                call(given)
                raised[f"{name} ({given_name})"] = "no error"
            except ValueError as error:
                raised[f"{name} ({given_name})"] = str(error)
    return raised


def test_a_rank_outside_the_group_is_told_so_by_every_entry_point(pool) -> None:
    per_rank = pool(4).run(outside_the_group, timeout=180)
    assert per_rank[:2] == [{}, {}]
    for rank in (2, 3):
        assert len(per_rank[rank]) == 22
        for call, message in per_rank[rank].items():
            assert f"this process (global rank {rank}) is not" in message, (call, message)
            named = "the device mesh DeviceMesh((2,), 'cpu', stride=(1,)) (global ranks [0, 1])" if call.endswith(
                "(mesh)") else "NON_GROUP_MEMBER"
            assert named in message, (call, message)


@pytest.mark.parametrize("group", ["dp", 3, nn.Linear(2, 2)])
def test_a_group_of_another_kind_is_refused(group) -> None:
    with pytest.raises(TypeError, match="group must be a torch.distributed.ProcessGroup, a DeviceMesh or None, got"):
        process_group(group)
    with pytest.raises(TypeError, match="group must be"):
        info_nce(torch.randn(2, 3), torch.randn(2, 3), group=group)
