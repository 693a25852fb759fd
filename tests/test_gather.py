"""The engine: all_gather / all_gather_many on real gloo processes against float64 references."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from routes import ROUTES, on_route, with_variable

from contrastive_dist import all_gather, all_gather_many

SHARDS = {
    1: [[3], [0]],
    2: [[1, 7], [0, 2], [4, 4]],
    3: [[5, 0, 3], [0, 0, 2], [2, 2, 2], [1, 1, 1]],
    4: [[4, 4, 4, 4], [3, 0, 1, 2]],
}


def make_global(total: int, dim: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A (total, 3, 2) batch with its rows moved to ``dim``: every rank builds the same one."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(total, 3, 2, generator=generator, dtype=torch.float64)
    return rows.movedim(0, dim).to(dtype)


def shard_of(full: torch.Tensor, sizes: list[int], rank: int, dim: int) -> torch.Tensor:
    return full.narrow(dim, sum(sizes[:rank]), sizes[rank])


def mixing_loss(local: torch.Tensor, gathered: torch.Tensor, dim: int, mixer: torch.Tensor) -> torch.Tensor:
    """Local rows against all gathered rows, like a contrastive loss: the gradient crosses ranks."""
    local_rows = local.movedim(dim, 0).reshape(local.shape[dim], 6)
    all_rows = gathered.movedim(dim, 0).reshape(gathered.shape[dim], 6)
    return torch.tanh(local_rows @ mixer @ all_rows.T).sum() + 0.1 * (all_rows**3).sum()


def reference_grad(full: torch.Tensor, sizes: list[int], dim: int, mixer: torch.Tensor) -> torch.Tensor:
    """Single process: the sum over ranks of each rank's loss, differentiated w.r.t. the full batch."""
    full = full.detach().clone().requires_grad_(True)
    total = sum(mixing_loss(shard_of(full, sizes, r, dim), full, dim, mixer) for r in range(len(sizes)))
    (grad,) = torch.autograd.grad(total, full)
    return grad


def check_values_and_grads(rank: int, world_size: int) -> list[str]:
    """Forward = concatenation, backward = reduce-scatter of a cross-rank loss (float64, 1e-12)."""
    failures = []
    for case, sizes in enumerate(SHARDS[world_size]):
        for dim in (0, 1, -1):
            for given in (None, tuple(sizes)):
                full = make_global(sum(sizes), dim, seed=case)
                mixer = torch.randn(6, 6, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
                local = shard_of(full, sizes, rank, dim).clone().requires_grad_(True)
                with warnings.catch_warnings():
                    warnings.simplefilter("error", FutureWarning)
                    gathered = all_gather(local, dim, sizes=given)
                    loss = mixing_loss(local, gathered.tensor, dim, mixer)
                    (grad,) = torch.autograd.grad(loss, local)
                label = f"sizes={sizes} dim={dim} given={given is not None}"
                if gathered.sizes != tuple(sizes) or gathered.offset != sum(sizes[:rank]):
                    failures.append(f"{label}: sizes {gathered.sizes} offset {gathered.offset}")
                if not torch.equal(gathered.tensor.detach(), full):
                    failures.append(f"{label}: forward differs from the concatenation")
                expected = shard_of(reference_grad(full, sizes, dim, mixer), sizes, rank, dim)
                error = (grad - expected).abs().max().item() if grad.numel() else 0.0
                if error > 1e-12:
                    failures.append(f"{label}: gradient error {error:.2e}")
    return failures


def check_closed_form(rank: int, world_size: int) -> list[str]:
    """sin(gathered).sum() on every rank → d/dx = world_size * cos(x), for float dtypes."""
    failures = []
    tolerances = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}
    for dtype, tolerance in tolerances.items():
        for sizes in SHARDS[world_size]:
            full = make_global(sum(sizes), 0, seed=7, dtype=dtype)
            local = shard_of(full, sizes, rank, 0).clone().requires_grad_(True)
            gathered = all_gather(local).tensor
            (grad,) = torch.autograd.grad(torch.sin(gathered.float()).sum(), local)
            expected = world_size * torch.cos(local.detach().float())
            error = (grad.float() - expected).abs().max().item() if grad.numel() else 0.0
            if grad.dtype != dtype or gathered.dtype != dtype or error > tolerance * world_size:
                failures.append(f"{dtype} {sizes}: dtype {grad.dtype}, error {error:.2e}")
    return failures


def check_other_inputs(rank: int, world_size: int) -> list[str]:
    """Integers, bools, non-contiguous views, inputs without grad, several tensors at once."""
    failures = []
    sizes = [rank + 1 if rank != 1 else 0 for rank in range(world_size)]
    ids = torch.arange(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    gathered_ids = all_gather(ids)
    if gathered_ids.tensor.tolist() != list(range(sum(sizes))) or gathered_ids.tensor.dtype != torch.int64:
        failures.append(f"integer gather: {gathered_ids.tensor.tolist()}")
    flags = (ids % 2 == 0)
    if all_gather(flags).tensor.tolist() != [i % 2 == 0 for i in range(sum(sizes))]:
        failures.append("bool gather")
    wide = torch.arange(4 * sum(sizes), dtype=torch.float32).reshape(4, sum(sizes))
    view = wide.T[sum(sizes[:rank]) : sum(sizes[: rank + 1])]  # non-contiguous rows
    if not torch.equal(all_gather(view).tensor, wide.T):
        failures.append("non-contiguous gather")
    if all_gather(view).tensor.requires_grad:
        failures.append("input without grad produced an output requiring grad")
    for given in (None, sizes):  # rows of zero width: nothing moves, shapes and autograd still right
        no_width = torch.randn(sizes[rank], 0, requires_grad=True)
        gathered_empty = all_gather(no_width, sizes=given).tensor
        gathered_empty.sum().backward()
        if gathered_empty.shape != (sum(sizes), 0) or no_width.grad is None or no_width.grad.shape != no_width.shape:
            failures.append(f"zero-width gather (sizes given: {given is not None}): {tuple(gathered_empty.shape)}")
    image = torch.randn(sizes[rank], 5, dtype=torch.float64, requires_grad=True)
    text = torch.randn(sizes[rank], 2, 3, dtype=torch.float64, requires_grad=True)
    many = all_gather_many((image, text, ids))
    alone = [all_gather(t.detach()).tensor for t in (image, text, ids)]
    if not all(torch.equal(a, b) for a, b in zip(many.tensors, alone)):
        failures.append("all_gather_many forward differs from separate gathers")
    (many.tensors[0].sum() * 2 + many.tensors[1].pow(2).sum()).backward()
    if not torch.allclose(image.grad, torch.full_like(image, 2.0 * world_size)):
        failures.append("all_gather_many image gradient")
    if not torch.allclose(text.grad, 2 * world_size * text.detach()):
        failures.append("all_gather_many text gradient")
    return failures


def check_subgroup(rank: int, world_size: int) -> list[str]:
    """A subgroup of a 4-process world: only its members gather, with their own ranks and sizes."""
    members = [0, 2, 3]
    group = dist.new_group(members)
    failures = []
    if rank in members:
        sizes = {0: 2, 2: 0, 3: 1}
        x = torch.full((sizes[rank], 2), float(rank), requires_grad=True)
        gathered = all_gather(x, group=group)
        expected = [[0.0, 0.0], [0.0, 0.0], [3.0, 3.0]]
        if gathered.tensor.tolist() != expected or gathered.sizes != (2, 0, 1):
            failures.append(f"subgroup forward {gathered.tensor.tolist()} {gathered.sizes}")
        if gathered.rank != members.index(rank):
            failures.append(f"subgroup rank {gathered.rank}")
        gathered.tensor.sum().backward()
        if not torch.equal(x.grad, torch.full_like(x, 3.0)):
            failures.append("subgroup backward")
    dist.barrier()
    return failures


BAD_INPUTS = [
    "trailing",
    "ndim",
    "dtype",
    "not_tensor",
    "dim_range",
    "sizes_mismatch",
    "sizes_length",
    "grad_mismatch",
    "grad_mismatch_sizes",
    "many_sizes_mismatch",
    "zero_width_sizes_mismatch",
    "zero_width_grad_mismatch_sizes",
]


def raise_bad_input(rank: int, world_size: int, kind: str) -> None:
    """Rank 1 passes something that disagrees with the others."""
    bad = rank == 1
    width = 3
    if kind.startswith("zero_width_"):  # rows of shape (0,): no data moves, yet the check must happen
        kind, width = kind.removeprefix("zero_width_"), 0
    x = torch.randn(2, width)
    sizes = None
    if kind == "trailing" and bad:
        x = torch.randn(2, 4)
    elif kind == "ndim" and bad:
        x = torch.randn(2, 3, 1)
    elif kind == "dtype" and bad:
        x = x.double()
    elif kind == "not_tensor" and bad:
        x = [[1.0, 2.0, 3.0]]  # type: ignore[assignment]
    elif kind == "sizes_mismatch":
        sizes = [2] * world_size
        x = torch.randn(3 if bad else 2, width)
    elif kind == "sizes_length":
        sizes = [2] * (world_size + 1)
    elif kind.startswith("grad_mismatch"):
        # e.g. an empty rank that skipped its model: its gather would never join the backward.
        x.requires_grad_(not bad)
        sizes = [2] * world_size if kind.endswith("sizes") else None
    elif kind == "many_sizes_mismatch":
        rows = 3 if bad else 2
        all_gather_many((torch.randn(rows, 3), torch.randn(rows, 2, 2)), sizes=[2] * world_size)
        return
    all_gather(x, 5 if (kind == "dim_range" and bad) else 0, sizes=sizes)


def count_transport_calls(rank: int, world_size: int) -> dict[str, int]:
    """Which raw collectives the transport runs for even, uneven and empty shards, with and without sizes=."""
    from contrastive_dist.engine import _wire

    calls: Counter[str] = Counter()
    names = {"broadcast": _wire.dist, "all_to_all_single": _wire.dist}
    originals = {name: getattr(module, name) for name, module in names.items()}
    originals["all_gather_single"] = _wire.all_gather_single
    originals["_reduce_scatter_single"] = _wire._reduce_scatter_single

    def counting(name: str):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name, module in names.items():
            setattr(module, name, counting(name))
        _wire.all_gather_single = counting("all_gather_single")
        _wire._reduce_scatter_single = counting("_reduce_scatter_single")
        for sizes in ((2, 2), (3, 0)):
            for given in (None, sizes):
                x = torch.randn(sizes[rank], 3, requires_grad=True)
                all_gather(x, sizes=given).tensor.sum().backward()
    finally:
        for name, module in names.items():
            setattr(module, name, originals[name])
        _wire.all_gather_single = originals["all_gather_single"]
        _wire._reduce_scatter_single = originals["_reduce_scatter_single"]
    return dict(calls)


@pytest.mark.parametrize("route", ROUTES)
def test_the_route_switch_chooses_the_collectives(pool, route):
    calls = pool(2).run(on_route, route, count_transport_calls)[0]
    if route == "auto":  # CPU: broadcasts forward, all-to-all backward, nothing else
        assert set(calls) == {"broadcast", "all_to_all_single"}, calls
    else:  # the accelerator routes: each single collective on even sizes, all-to-all on uneven ones
        assert set(calls) == {"all_gather_single", "_reduce_scatter_single", "all_to_all_single"}, calls


def test_an_unknown_route_is_rejected(pool):
    errors = pool(2).run(on_route, "nccl", gather_after_errors, return_exceptions=True, timeout=20)
    assert all(isinstance(error, ValueError) and "CONTRASTIVE_DIST_ROUTE" in str(error) for error in errors), errors


SIZES_VIOLATIONS = ["differing", "some_ranks_only", "wrong_rows", "loss_input_with_sizes"]


def violate_sizes(rank: int, world_size: int, kind: str) -> None:
    """Rank 1 breaks the sizes= contract; without the debug switch gloo aborts or hangs here."""
    bad = rank == 1
    sizes: list[int] | None = [2] * world_size
    x = torch.randn(2, 3, requires_grad=True)
    if kind == "differing" and bad:
        sizes = [2, 2, 3]
    elif kind == "some_ranks_only" and bad:
        sizes = None
    elif kind == "wrong_rows" and bad:
        x = torch.randn(3, 3, requires_grad=True)
    elif kind == "loss_input_with_sizes":
        from contrastive_dist import info_nce

        info_nce(x, x[:, :2] if bad else x, sizes=sizes)  # rank 1 fails its own checks, before any gather
        return
    all_gather(x, sizes=sizes).tensor.sum().backward()


@pytest.mark.parametrize("kind", SIZES_VIOLATIONS)
def test_debug_switch_turns_a_sizes_violation_into_one_clear_error_on_every_rank(pool, kind):
    workers = pool(3)
    errors = workers.run(
        with_variable, "CONTRASTIVE_DIST_DEBUG", "1", violate_sizes, kind, return_exceptions=True, timeout=20
    )
    assert all(isinstance(error, ValueError) for error in errors), errors
    assert len({str(error) for error in errors}) == 1, "ranks disagree on the message"
    message = str(errors[0])
    assert "rank 1" in message, message
    if kind == "differing":
        assert "CONTRASTIVE_DIST_DEBUG=1" in message and "sizes=(2, 2, 3)" in message, message
    elif kind == "some_ranks_only":
        assert "CONTRASTIVE_DIST_DEBUG=1" in message and "no sizes=" in message, message
    elif kind == "wrong_rows":
        assert "float32 (3, 3)" in message, message
    assert workers.run(gather_after_errors) == [[0, 1, 2]] * 3


def gather_with_sizes(rank: int, world_size: int) -> list[int]:
    return all_gather(torch.tensor([rank]), sizes=[1] * world_size).tensor.tolist()


def test_an_unknown_debug_value_is_rejected(pool):
    errors = pool(2).run(
        with_variable, "CONTRASTIVE_DIST_DEBUG", "yes", gather_with_sizes, return_exceptions=True, timeout=20
    )
    assert all(isinstance(error, ValueError) and "CONTRASTIVE_DIST_DEBUG" in str(error) for error in errors), errors


def test_debug_switch_keeps_correct_gathers_exact(pool):
    assert pool(3).run(with_variable, "CONTRASTIVE_DIST_DEBUG", "1", check_values_and_grads) == [[]] * 3


def gather_after_errors(rank: int, world_size: int) -> list[int]:
    return all_gather(torch.tensor([rank])).tensor.tolist()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_values_and_gradients_match_single_process(pool, world_size, route):
    assert pool(world_size).run(on_route, route, check_values_and_grads) == [[]] * world_size


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_closed_form_gradient_for_every_float_dtype(pool, world_size, route):
    assert pool(world_size).run(on_route, route, check_closed_form) == [[]] * world_size


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_integers_bools_views_and_several_tensors(pool, world_size, route):
    assert pool(world_size).run(on_route, route, check_other_inputs) == [[]] * world_size


@pytest.mark.parametrize("route", ROUTES)
def test_subgroup_of_a_four_process_world(pool, route):
    assert pool(4).run(on_route, route, check_subgroup) == [[]] * 4


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_input_raises_the_same_clear_error_on_every_rank(pool, kind, route):
    workers = pool(3)
    errors = workers.run(on_route, route, raise_bad_input, kind, return_exceptions=True, timeout=20)
    assert all(isinstance(error, (ValueError, TypeError)) for error in errors), errors
    if kind != "sizes_length":
        assert len({str(error) for error in errors}) == 1, "ranks disagree on the message"
        assert "rank 1" in str(errors[0])
    if "grad_mismatch" in kind:
        assert "autograd" in str(errors[0]) and "requires_grad" in str(errors[0])
    if "sizes_mismatch" in kind:
        assert "sizes[1]=2 was given, but the input has 3 rows" in str(errors[0])
    # Nothing was poisoned: the group still works.
    assert workers.run(gather_after_errors) == [[0, 1, 2]] * 3


def test_without_process_group_it_is_the_identity():
    x = torch.randn(4, 3, requires_grad=True)
    gathered = all_gather(x, -1)
    assert gathered.tensor is x and gathered.sizes == (3,) and gathered.offset == 0
    assert all_gather(x, sizes=[4]).sizes == (4,)
    with pytest.raises(ValueError, match="sizes"):
        all_gather(x, sizes=[5])
    with pytest.raises(ValueError, match="out of range"):
        all_gather(x, 2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        all_gather([1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of tensors"):
        all_gather_many(x)  # type: ignore[arg-type]


def compiled_step(x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    gathered = all_gather(x, sizes=sizes).tensor
    return torch.tanh(x @ gathered.T).sum()


def check_compiled_matches_eager(rank: int, world_size: int) -> list[str]:
    failures = []
    compiled = torch.compile(compiled_step, fullgraph=True, backend="aot_eager")
    for sizes in ((3, 0, 2), (2, 2, 2)):
        x = torch.randn(sizes[rank], 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
        value = compiled(x, sizes)
        (grad,) = torch.autograd.grad(value, x)
        eager_value = compiled_step(x, sizes)
        (eager_grad,) = torch.autograd.grad(eager_value, x)
        if not (torch.allclose(value, eager_value) and torch.allclose(grad, eager_grad)):
            failures.append(f"{sizes}: compiled {value.item()} vs eager {eager_value.item()}")
    return failures


def test_torch_compile_fullgraph_with_given_sizes(pool):
    assert pool(3).run(check_compiled_matches_eager, timeout=120) == [[]] * 3


def second_derivative(rank: int, world_size: int) -> str:
    x = torch.randn(2, 3, requires_grad=True)
    (grad,) = torch.autograd.grad(all_gather(x).tensor.pow(2).sum(), x, create_graph=True)
    try:
        grad.sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_second_derivative_raises_instead_of_being_wrong(pool):
    messages = pool(2).run(second_derivative)
    assert all("once_differentiable" in message or "double backward" in message.lower() for message in messages)


def test_moved_public_modules_keep_their_old_import_paths() -> None:
    import importlib

    import contrastive_dist

    moved = {
        "collate": "data.collate",
        "collectives": "engine.collectives",
        "gather": "engine.gather",
        "norm": "nn.norm",
        "sampler": "data.sampler",
        "shards": "data.shards",
        "streaming": "data.streaming",
    }
    for old, new in moved.items():
        module = importlib.import_module(f"contrastive_dist.{old}")
        assert module is importlib.import_module(f"contrastive_dist.{new}"), old
    from contrastive_dist.sampler import DistributedBatchSampler

    assert DistributedBatchSampler is contrastive_dist.DistributedBatchSampler
