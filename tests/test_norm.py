"""SyncBatchNorm against one process running nn.BatchNorm on the concatenated global batch.

The loss follows the gradient contract: with per-sample loss ``ℓ_i = Σ R_i·y_i + ½ Σ y_i²``
(``R`` a fixed random tensor), the reference is ``L = (1/N) Σ_i ℓ_i`` over the global batch and
rank ``r`` returns ``loss_r = (W/N) Σ_{i on r} ℓ_i``. Then the input gradient of rank ``r``'s rows
is ``W · ∂L/∂x`` (the gradient of the sum of all ranks' losses, which the layers before feed into
DDP's average), and the mean over ranks of the weight / bias gradients is ``∂L/∂weight``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchvision
from torch import nn

from contrastive_dist import SyncBatchNorm, convert_sync_batchnorm
from contrastive_dist._dist import get_world_size, is_distributed

CHANNELS = 3
# kind → (reference class, trailing shape after (N, C))
KINDS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "1d": (nn.BatchNorm1d, ()),
    "1d_seq": (nn.BatchNorm1d, (4,)),
    "2d": (nn.BatchNorm2d, (3, 2)),
    "3d": (nn.BatchNorm3d, (2, 2, 3)),
}
SHARDS = {
    1: [(5,), (2,)],
    2: [(1, 1), (2, 0), (0, 3), (3, 5), (0, 0)],
    3: [(5, 0, 3), (4, 4, 4), (1, 0, 1), (0, 0, 0)],
}
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 4e-2}


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add contention on a busy machine; restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _error(actual: torch.Tensor | None, expected: torch.Tensor | None) -> float:
    """Largest difference relative to max(1, largest expected magnitude); NaN → inf."""
    if actual is None or expected is None:
        return 0.0 if actual is None and expected is None else float("inf")
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape or not torch.isfinite(actual).all():
        return float("inf")
    if actual.numel() == 0:
        return 0.0
    scale = max(expected.abs().max().item(), 1.0)
    return (actual - expected).abs().max().item() / scale


def _sample_loss(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """ℓ_i per row, in float64."""
    y = y.double()
    return (weights * y + 0.5 * y.square()).flatten(1).sum(1)


def _case_data(case: dict[str, Any], world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(case["seed"])
    _, trailing = KINDS[case["kind"]]
    total = sum(case["shards"])
    steps = []
    for _ in range(case["steps"]):
        x = torch.randn(total, CHANNELS, *trailing, generator=generator, dtype=torch.float64)
        x = x * 2.0 + case["offset"]
        weights = torch.randn(x.shape, generator=generator, dtype=torch.float64)
        steps.append((x.to(case["dtype"]).double(), weights))  # rounded as the rank will see it
    return steps


def _modules(case: dict[str, Any]) -> tuple[nn.Module, SyncBatchNorm]:
    reference_class, _ = KINDS[case["kind"]]
    options = dict(momentum=case["momentum"], affine=case["affine"], track_running_stats=case["track"])
    reference = reference_class(CHANNELS, **options, dtype=torch.float64)
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    if case["affine"]:
        with torch.no_grad():
            reference.weight.copy_(torch.randn(CHANNELS, generator=generator) + 1.5)
            reference.bias.copy_(torch.randn(CHANNELS, generator=generator))
    module = SyncBatchNorm(CHANNELS, **options).to(case["module_dtype"])
    module.load_state_dict(reference.state_dict())
    with torch.no_grad():  # the reference sees the parameters as rounded in the module
        for name, tensor in module.state_dict().items():
            reference.state_dict()[name].copy_(tensor)
    return reference, module


def _check_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Run each case on this rank's shard; return its errors against the single-process reference."""
    with _one_thread():
        return [_check_case(rank, world_size, case) for case in cases]


def _check_case(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, float]:
    shards = case["shards"]
    offset, size, total = sum(shards[:rank]), shards[rank], sum(shards)
    rows = slice(offset, offset + size)
    reference, module = _modules(case)
    # Low precision: nn.BatchNorm in the same dtype, whose own error sets the bar (see _assert_close).
    same_dtype = None if case["dtype"] == torch.float64 else copy.deepcopy(reference).to(case["module_dtype"])
    errors: dict[str, float] = {}

    def note(name: str, value: float) -> None:
        errors[name] = max(errors.get(name, 0.0), value)

    for x_global, weights in _case_data(case, world_size):
        reference.zero_grad()
        module.zero_grad()
        x_ref = x_global.clone().requires_grad_(case["input_grad"])
        y_ref = reference(x_ref)
        loss_ref = _sample_loss(y_ref, weights).sum() / max(total, 1)
        if loss_ref.requires_grad:
            loss_ref.backward()

        x = x_global[rows].to(case["dtype"]).requires_grad_(case["input_grad"])
        y = module(x)
        loss = _sample_loss(y, weights[rows]).sum() * (world_size / max(total, 1))
        if loss.requires_grad:
            loss.backward()

        if same_dtype is not None:
            same_dtype.zero_grad()
            x_same = x_global.to(case["dtype"]).requires_grad_(case["input_grad"])
            y_same = same_dtype(x_same)
            if y_same.requires_grad:
                (_sample_loss(y_same, weights).sum() / max(total, 1)).backward()
            note("nn_output", _error(y_same[rows], y_ref[rows]))
            if case["input_grad"] and x_ref.grad is not None:
                note("nn_input_grad", _error(world_size * x_same.grad[rows], world_size * x_ref.grad[rows]))
            for name in ("weight", "bias"):
                if getattr(same_dtype, name) is not None:
                    note(f"nn_{name}_grad", _error(getattr(same_dtype, name).grad, getattr(reference, name).grad))
            for name in ("running_mean", "running_var"):
                note(f"nn_{name}", _error(getattr(same_dtype, name), getattr(reference, name)))

        note("output", _error(y, y_ref[rows]))
        if case["input_grad"]:
            note("input_grad", _error(x.grad, None if x_ref.grad is None else world_size * x_ref.grad[rows]))
        for name in ("weight", "bias"):
            mine, theirs = getattr(module, name), getattr(reference, name)
            if mine is None:
                continue
            grad = mine.grad.double()
            if is_distributed():
                dist.all_reduce(grad)  # what DDP does: sum over ranks, then / W
            note(f"{name}_grad", _error(grad / world_size, theirs.grad))
        for name in ("running_mean", "running_var"):
            note(name, _error(getattr(module, name), getattr(reference, name)))
        tracked_mine, tracked_ref = module.num_batches_tracked, reference.num_batches_tracked
        note("num_batches_tracked", 0.0 if _same_tracking(tracked_mine, tracked_ref) else float("inf"))

    # Eval: running statistics, or this rank's own batch statistics without them (no collective).
    module.eval()
    reference.eval()
    x_local = x_global[rows]
    if case["track"]:
        note("eval", _error(module(x_local.to(case["dtype"])), reference(x_global)[rows]))
    elif x_local.numel() // CHANNELS > 1:
        note("eval", _error(module(x_local.to(case["dtype"])), reference(x_local)))
    return errors


def _same_tracking(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> bool:
    if mine is None or theirs is None:
        return mine is None and theirs is None
    return int(mine) == int(theirs)


def _cases(world_size: int, dtype: torch.dtype = torch.float64, **fixed: Any) -> list[dict[str, Any]]:
    cases = []
    combos = itertools.product(SHARDS[world_size], KINDS, (True, False), (0.1, None), (True, False))
    for seed, (shards, kind, affine, momentum, track) in enumerate(combos):
        if sum(shards) * (4 if kind == "1d_seq" else 1) == 1:
            continue
        case = dict(
            seed=seed,
            shards=shards,
            kind=kind,
            affine=affine,
            momentum=momentum,
            track=track,
            dtype=dtype,
            module_dtype=dtype,
            offset=0.5,
            steps=2,
            input_grad=seed % 5 != 4,  # some layers see inputs that need no gradient
        )
        case.update(fixed)
        cases.append(case)
    return cases


def _assert_close(cases: list[dict[str, Any]], per_rank: list[list[dict[str, float]]], tolerance: float) -> None:
    failures = []
    for rank, results in enumerate(per_rank):
        for case, errors in zip(cases, results, strict=True):
            # Never worse than 4x what nn.BatchNorm itself loses in the same dtype (float32 and
            # bfloat16 near-cancellations, e.g. the input gradient of a 2-value batch).
            bad = {
                name: value
                for name, value in errors.items()
                if not name.startswith("nn_") and not value <= max(tolerance, 4 * errors.get(f"nn_{name}", 0.0))
            }
            if bad:
                shown = {key: case[key] for key in ("shards", "kind", "affine", "momentum", "track", "dtype")}
                failures.append(f"rank {rank} {shown}: {bad}")
    assert not failures, f"{len(failures)} failures, first: " + "\n".join(failures[:5])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_matches_single_process_float64(pool: Any, world_size: int) -> None:
    # Options vary fastest in _cases: a stride of 3 (prime to the 8 option combinations) keeps
    # every combination for every kind while running a third of the product on several ranks.
    cases = _cases(world_size)[:: 1 if world_size == 1 else 3]
    _assert_close(cases, pool(world_size).run(_check_cases, cases), TOLERANCE[torch.float64])


def _values_per_channel(case: dict[str, Any]) -> int:
    return sum(case["shards"]) * math.prod(KINDS[case["kind"]][1])


def test_matches_single_process_float32(pool: Any) -> None:
    # With 2 values per channel the normalized output hardly depends on x (only through eps):
    # the input gradient is a near-total cancellation whose float32 rounding (ε·|weight·invstd·dy|,
    # in nn.BatchNorm as here) exceeds the 1e-5 bar, so those batches are left to float64.
    cases = [case for case in _cases(3, torch.float32) if _values_per_channel(case) > 2][::5]
    _assert_close(cases, pool(3).run(_check_cases, cases), TOLERANCE[torch.float32])


def test_float32_with_large_mean(pool: Any) -> None:
    # mean 1e3, std 2: Σx²/N − mean² in float32 would keep about one digit of the variance.
    # With this offset even nn.BatchNorm in float32 is off by ~3e-2 from float64 on 2-value
    # batches; batches of 8+ rows are compared.
    cases = [case for case in _cases(3, torch.float32, offset=1e3) if sum(case["shards"]) >= 8][::3]
    _assert_close(cases, pool(3).run(_check_cases, cases), 1e-3)


@pytest.mark.parametrize("module_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_input(pool: Any, module_dtype: torch.dtype) -> None:
    cases = _cases(2, torch.bfloat16, module_dtype=module_dtype)[::5]
    _assert_close(cases, pool(2).run(_check_cases, cases), TOLERANCE[torch.bfloat16])


def _one_value_per_channel(
    rank: int, world_size: int, cases: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> list[str]:
    with _one_thread():
        return [_one_value_message(rank, shards, trailing) for shards, trailing in cases]


def _one_value_message(rank: int, shards: tuple[int, ...], trailing: tuple[int, ...]) -> str:
    module = SyncBatchNorm(CHANNELS)
    try:
        module(torch.randn(shards[rank], CHANNELS, *trailing))
        message = "no error"
    except ValueError as error:
        message = str(error)
    # The layer still works for the next batch: no rank is left inside a collective.
    module(torch.randn(2, CHANNELS, *trailing))
    return message


def test_one_value_per_channel_raises_on_every_rank(pool: Any) -> None:
    cases = [((1, 0, 0), ()), ((0, 0, 1), (1,)), ((0, 1, 0), (1, 1)), ((1, 0, 0), (1, 1, 1))]
    for messages in pool(3).run(_one_value_per_channel, cases):
        assert all(message.startswith("Expected more than 1 value per channel when training") for message in messages)


def _wrong_channels(rank: int, world_size: int) -> str:
    torch.manual_seed(rank)
    module = SyncBatchNorm(CHANNELS)
    x = torch.randn(2, CHANNELS + (rank == 1), 4)
    try:
        module(x)
    except ValueError as error:
        return str(error)
    return "no error"


def test_wrong_shape_on_one_rank_raises_everywhere(pool: Any) -> None:
    for message in pool(2).run(_wrong_channels):
        assert "rank(s) [1]" in message


class _SmallNet(nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Conv2d(4, 6, 3, stride=2),
            nn.BatchNorm2d(6, momentum=None),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(6, 5),
            nn.BatchNorm1d(5),  # a head that per-rank BatchNorm cannot run on 1 sample
        )
        self.double()


# Per step and rank: a rank with 1 sample, a rank with 0, uneven everywhere.
_DDP_SHARDS = [(3, 1, 2), (2, 0, 3), (1, 4, 0), (0, 2, 2), (2, 2, 1)]


def _ddp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(sum(s), 3, 7, 7, generator=generator, dtype=torch.float64),
            torch.randint(5, (sum(s),), generator=generator),
        )
        for s in _DDP_SHARDS
    ]


def _ddp_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels, reduction="none") + 0.1 * logits.square().sum(1)


def _ddp_training(rank: int, world_size: int, broadcast_buffers: bool) -> dict[str, float]:
    with _one_thread():
        return _ddp_run(rank, world_size, broadcast_buffers)


def _ddp_run(rank: int, world_size: int, broadcast_buffers: bool) -> dict[str, float]:
    reference = _SmallNet()
    model = nn.parallel.DistributedDataParallel(
        convert_sync_batchnorm(_SmallNet()), broadcast_buffers=broadcast_buffers
    )
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (reference, model)]
    for (images, labels), shards in zip(_ddp_batches(), _DDP_SHARDS, strict=True):
        total, rows = sum(shards), slice(sum(shards[:rank]), sum(shards[: rank + 1]))
        for optimizer in optimizers:
            optimizer.zero_grad()
        (_ddp_sample_loss(reference(images), labels).sum() / total).backward()
        local_loss = _ddp_sample_loss(model(images[rows]), labels[rows]).sum() * (world_size / total)
        local_loss.backward()
        for optimizer in optimizers:
            optimizer.step()
    errors = {}
    mine = dict(model.module.state_dict())
    for name, expected in reference.state_dict().items():
        errors[name] = 0.0 if torch.equal(mine[name], expected) else _error(mine[name], expected)
    return errors


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_ddp_training_matches_single_process(pool: Any, broadcast_buffers: bool) -> None:
    for errors in pool(3).run(_ddp_training, broadcast_buffers):
        assert len(errors) == 21 and max(errors.values()) <= 1e-10, errors


@_one_thread()
def test_single_process_is_nn_batchnorm() -> None:
    assert not is_distributed() and get_world_size() == 1
    for (kind, (reference_class, trailing)), training in itertools.product(KINDS.items(), (True, False)):
        reference = reference_class(CHANNELS, momentum=None)
        module = convert_sync_batchnorm(copy.deepcopy(reference))
        assert isinstance(module, SyncBatchNorm)
        reference.train(training)
        module.train(training)
        x = torch.randn(4, CHANNELS, *trailing)
        assert torch.equal(module(x), reference(x)), kind
        assert all(
            torch.equal(a, b)
            for a, b in zip(module.state_dict().values(), reference.state_dict().values(), strict=True)
        )
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        SyncBatchNorm(CHANNELS)(torch.randn(1, CHANNELS))


@_one_thread()
def test_state_dict_round_trip_resnet18() -> None:
    original = torchvision.models.resnet18(weights=None)
    original.layer1[0].bn1.weight.requires_grad_(False)
    original.eval()
    converted = convert_sync_batchnorm(copy.deepcopy(original))
    batchnorms = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(batchnorms) == 20 and all(isinstance(m, SyncBatchNorm) for m in batchnorms)
    assert not converted.training and not converted.layer1[0].bn1.weight.requires_grad
    converted.load_state_dict(original.state_dict(), strict=True)
    back = torchvision.models.resnet18(weights=None)
    back.load_state_dict(converted.state_dict(), strict=True)
    for name, tensor in original.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(converted(x), original(x))


def test_convert_keeps_tensors_and_options() -> None:
    layer = nn.BatchNorm2d(5, eps=1e-3, momentum=None, affine=False, track_running_stats=True, dtype=torch.float64)
    layer.running_mean.fill_(2.0)
    model = nn.Sequential(nn.Conv2d(2, 5, 1), layer, nn.Sequential(nn.BatchNorm1d(4)))
    model.eval()
    running_mean = layer.running_mean
    converted = convert_sync_batchnorm(model)
    assert converted is model
    sync = model[1]
    assert isinstance(sync, SyncBatchNorm) and isinstance(model[2][0], SyncBatchNorm)
    assert (sync.eps, sync.momentum, sync.affine, sync.weight) == (1e-3, None, False, None)
    assert sync.running_mean is running_mean and sync.running_mean.dtype == torch.float64
    assert not sync.training
    single = convert_sync_batchnorm(nn.BatchNorm1d(3))
    assert isinstance(single, SyncBatchNorm)
    assert convert_sync_batchnorm(single) is single
    with pytest.raises(ValueError, match="forward"):
        convert_sync_batchnorm(nn.LazyBatchNorm1d())
    with pytest.raises(TypeError, match="nn.Module"):
        convert_sync_batchnorm("model")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_features=0), dict(num_features=2.0), dict(num_features=2, momentum=1.5), dict(num_features=2, eps=-1.0)],
)
def test_invalid_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SyncBatchNorm(**kwargs)


def test_rejects_one_dimensional_input() -> None:
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        SyncBatchNorm(3)(torch.randn(3))


def test_converted_layers_keep_their_input_rank_check():
    model = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.BatchNorm1d(3)))
    with pytest.raises(ValueError, match="expected 4D input, got 3D"):
        model[0](torch.randn(2, 3, 4))
    assert model[1](torch.randn(4, 3)).shape == (4, 3) and model[1](torch.randn(4, 3, 5)).shape == (4, 3, 5)
