"""The gradient contract under PyTorch's engines past DDP, on 4 real gloo processes, with ``group=`` given as the mesh.

FSDP2 over a 1-D mesh, HSDP over a 2 × 2 replicate × shard mesh and data × tensor parallel on a 2 × 2
``dp × tp`` mesh (``parallelize_module``, FSDP2 over ``dp``), in both communication modes, with uneven
and empty data-parallel batches: the parameter gradients FSDP2 reduces (sharded ``DTensor`` gradients
gathered whole) equal the float64 one-process gradients of the global batch. DTensor features: a
replicated one is taken as this rank's rows, the others are refused on every rank alike. Context
parallelism: the factor ``1 / cp`` of a pooled embedding whose gradient reaches one cp rank only, and
the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from loss_references import clip_rows
from mesh_models import KINDS, Towers, full_gradients, global_batch, mesh, parallelize, relative_error, shard
from torch import nn

from contrastive_dist import all_gather, copy_to_group, info_nce, reduce_from_group

pytest.importorskip("torch.distributed.fsdp")

# Data-parallel batch sizes of the global batch, uneven with an empty rank: 4 data-parallel ranks, or 2 (dp × tp).
LAYOUTS = {4: ((3, 0, 2, 1), (0, 0, 4, 1)), 2: ((3, 0), (1, 4))}
TOLERANCE = 1e-10
COMMUNICATIONS = ("gather", "ring")


def reference(sizes: tuple[int, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, float64, the plain loop loss of the whole global batch: its value and parameter gradients."""
    model = Towers()
    images, texts, scale = model(*global_batch(sum(sizes)))
    loss = clip_rows(images, texts, scale, None, symmetric=True).mean()
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def train_step(rank: int, world_size: int, kind: str, communication: str) -> list[tuple[float, dict]]:
    """For each layout: a fresh model under ``kind``, one forward and backward; the loss and the whole gradients."""
    results = []
    for sizes in LAYOUTS[2 if kind == "dp_tp" else 4]:
        model = Towers()
        group, dp_rank = parallelize(model, kind)
        x, y = (shard(part, sizes, dp_rank) for part in global_batch(sum(sizes)))
        loss = info_nce(*model(x, y), group=group, communication=communication)
        loss.backward()
        results.append((loss.item(), full_gradients(model)))
    return results


def errors(kind: str, per_rank: list) -> dict[str, float]:
    """Relative errors against one process: each layout's loss (mean over dp ranks) and each rank's gradients."""
    dp_ranks = (0, 0, 1, 1) if kind == "dp_tp" else (0, 1, 2, 3)
    found = {}
    for index, sizes in enumerate(LAYOUTS[2 if kind == "dp_tp" else 4]):
        expected_loss, expected = reference(sizes)
        # The mean over data-parallel ranks of their losses is the global loss (the contract); tp ranks agree.
        losses = {dp_ranks[rank]: per_rank[rank][index][0] for rank in range(4)}
        found[f"{sizes} loss"] = abs(sum(losses.values()) / len(losses) - expected_loss) / abs(expected_loss)
        for rank in range(4):
            for name, grad in per_rank[rank][index][1].items():
                found[f"{sizes} rank {rank} {name}"] = relative_error(grad, expected[name])
    return found


@pytest.mark.parametrize("communication", COMMUNICATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_parameter_gradients_equal_the_one_process_gradients(pool, kind: str, communication: str) -> None:
    found = errors(kind, pool(4).run(train_step, kind, communication, timeout=180))
    assert max(found.values()) <= TOLERANCE, found


def dtensor_inputs(rank: int, world_size: int) -> dict[str, str]:
    """On the dp × tp mesh: what the loss and the gather make of DTensor features (an error's message, or a check)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    devices = mesh("dp_tp")
    tp, dp = devices["tp"], devices["dp"]
    torch.manual_seed(devices.get_local_rank("dp"))  # the tp ranks of a dp rank hold the same rows
    rows = torch.randn(3, 4, dtype=torch.float64)
    column = nn.Linear(4, 4).double()
    parallelize_module(column, tp, ColwiseParallel(use_local_output=False))
    cases = {
        "features split over tp (Shard(1))": lambda: info_nce(column(rows), column(rows), group=dp),
        "pending sums over tp (Partial)": lambda: info_nce(rows, DTensor.from_local(rows, tp, [Partial()]), group=dp),
        "replicated over tp, group the world": lambda: info_nce(rows, DTensor.from_local(rows, tp, [Replicate()])),
        "rows split over tp": lambda: all_gather(DTensor.from_local(rows, tp, [Shard(0)]), group=dp),
    }
    outcome = {}
    for name, case in cases.items():
        try:
            case()
            outcome[name] = "no error"
        except ValueError as error:
            outcome[name] = str(error).split("\n")[0]
    # Accepted: replicated over tp, and rows split over dp on the whole mesh: taken as this rank's rows.
    replicated = DTensor.from_local(rows, tp, [Replicate()])
    outcome["replicated"] = str(torch.equal(info_nce(rows, replicated, group=dp), info_nce(rows, rows, group=dp)))
    split_rows = DTensor.from_local(rows, devices, [Shard(0), Replicate()])
    gathered = all_gather(split_rows, group=dp).tensor
    outcome["rows over dp"] = str(torch.equal(gathered, all_gather(rows, group=dp).tensor))
    return outcome


def test_dtensor_features_are_taken_as_local_rows_when_replicated_and_refused_otherwise(pool) -> None:
    per_rank = pool(4).run(dtensor_inputs, timeout=180)
    assert all(outcome == per_rank[0] for outcome in per_rank), per_rank  # the same error on every rank
    outcome = per_rank[0]
    assert outcome["replicated"] == outcome["rows over dp"] == "True"
    assert "splits its dimension 1 over mesh dimension 'tp'" in outcome["features split over tp (Shard(1))"]
    assert "output_layouts=Replicate()" in outcome["features split over tp (Shard(1))"]
    assert "pending sums (Partial) over mesh dimension 'tp'" in outcome["pending sums over tp (Partial)"]
    assert "replicated over mesh dimension 'tp'" in outcome["replicated over tp, group the world"]
    assert "mesh['dp']" in outcome["replicated over tp, group the world"]
    assert "splits its rows over mesh dimension 'tp'" in outcome["rows split over tp"]


TOKENS, CONTEXT = 4, 2  # tokens per sample, split over the 2 ranks of the cp dimension


class SequenceTowers(nn.Module):
    """A token encoder mean-pooled over a sequence split across cp ranks, a head after the pooling, a text tower."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.token, self.head, self.text = nn.Linear(6, 5).double(), nn.Linear(5, 5).double(), nn.Linear(6, 5).double()
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))

    def forward(self, tokens: torch.Tensor, y: torch.Tensor, pool=None):
        pooled = self.token(tokens).sum(1) if pool is None else pool(self.token(tokens).sum(1))
        return F.normalize(self.head(pooled / TOKENS), dim=-1), F.normalize(self.text(y), dim=-1), 2.0


def sequences(total: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return (torch.randn(total, TOKENS, 6, generator=generator, dtype=torch.float64),
            torch.randn(total, 6, generator=generator, dtype=torch.float64))


def context_parallel_step(rank: int, world_size: int, sizes: tuple[int, ...]) -> dict[str, dict]:
    """FSDP2 over dp × cp flattened (as context parallelism averages), the loss over dp; pooled both ways."""
    from torch.distributed.fsdp import fully_shard

    devices = mesh("dp_cp")
    cp, dp = devices["cp"], devices["dp"]
    tokens, texts = (shard(part, sizes, devices.get_local_rank("dp")) for part in sequences(sum(sizes)))
    span = slice(cp.get_local_rank() * TOKENS // CONTEXT, (cp.get_local_rank() + 1) * TOKENS // CONTEXT)
    pools = {
        # the all-reduce of the partial sums; its gradient goes back to each cp rank's own tokens only
        "all-reduce, identity backward": lambda partial: reduce_from_group(partial, group=cp),
        # the fix: the gradients of every cp rank's (identical) loss summed, as one rank of dp would have it
        "all-reduce both ways": lambda partial: copy_to_group(reduce_from_group(partial, group=cp), group=cp),
    }
    grads = {}
    for name, pool in pools.items():
        model = SequenceTowers()
        fully_shard(model, mesh=devices._flatten())
        info_nce(*model(tokens[:, span], texts, pool), group=dp).backward()
        grads[name] = full_gradients(model)
    return grads


def test_context_parallelism_gives_one_over_cp_of_the_encoder_gradient_unless_the_pooling_sums_it(pool) -> None:
    sizes = (3, 0)
    per_rank = pool(4).run(context_parallel_step, sizes, timeout=180)
    model = SequenceTowers()
    images, texts, scale = model(*sequences(sum(sizes)))
    clip_rows(images, texts, torch.tensor(scale), None, symmetric=True).mean().backward()
    expected = {name: p.grad for name, p in model.named_parameters()}
    for grads in per_rank:
        plain, fixed = grads["all-reduce, identity backward"], grads["all-reduce both ways"]
        for name, grad in expected.items():
            # Before the pooling (the sequence-split encoder) 1 / cp of the gradient; the head and text tower exact.
            factor = 1 / CONTEXT if name.startswith("token") else 1.0
            assert relative_error(plain[name], factor * grad) <= TOLERANCE, name
            assert relative_error(fixed[name], grad) <= TOLERANCE, name


if __name__ == "__main__":  # the numbers of the scale-out guide: python tests/test_meshes.py
    from contrastive_dist.testing import WorkerPool

    with WorkerPool(4, timeout=600) as workers:
        for kind in KINDS:
            for communication in COMMUNICATIONS:
                found = errors(kind, workers.run(train_step, kind, communication))
                print(f"{kind} {communication}: largest relative error {max(found.values()):.1e}", flush=True)
