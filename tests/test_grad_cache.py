"""grad_cache in one process: exact against the memory-hungry reference (float64, dropout on), every loss.

The reference encodes the same mini-batches with gradient and concatenates them
(``grad_cache_models.reference_encode``); without dropout both equal plain full-batch training.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from grad_cache_models import KINDS, ImageTower, Setting, TextTower, reference_encode, train
from torch import Tensor, nn

from contrastive_dist import grad_cache, info_nce

SHARDS = (7,)  # mini-batches of 2: 2, 2, 2, 1


def assert_same_run(first: tuple[dict[str, Tensor], list[float]], second: tuple[dict[str, Tensor], list[float]],
                    what: str, tolerance: float = 1e-10) -> None:
    assert first[1] == pytest.approx(second[1], rel=tolerance, abs=tolerance), what
    assert first[0].keys() == second[0].keys()
    for name, value in first[0].items():
        torch.testing.assert_close(value, second[0][name], rtol=tolerance, atol=tolerance, msg=f"{what} {name}")


CASES = [Setting(kind, communication, chunk_size) for kind, communication, chunk_size
         in itertools.product(KINDS, ("gather", "ring"), (None, 3))]


@pytest.mark.parametrize("setting", CASES, ids=lambda s: f"{s.kind}-{s.communication}-chunk{s.chunk_size}")
def test_three_steps_with_dropout_equal_the_memory_hungry_reference(setting: Setting) -> None:
    cached = train(setting, SHARDS, 0)
    reference = train(Setting(**{**setting.__dict__, "strategy": "reference"}), SHARDS, 0)
    assert_same_run(cached, reference, f"{setting}")
    initial = Setting(**{**setting.__dict__, "strategy": "plain"})
    moved = train(initial, SHARDS, 0, steps=0)[0]
    assert any(not torch.allclose(moved[name], value) for name, value in cached[0].items())  # it trained


@pytest.mark.parametrize("kind", KINDS)
def test_without_dropout_three_steps_equal_plain_full_batch_training(kind: str) -> None:
    for mini_batch_size in (1, 2, 7, 100):
        cached = train(Setting(kind, dropout=0.0, mini_batch_size=mini_batch_size), SHARDS, 0)
        plain = train(Setting(kind, dropout=0.0, strategy="plain"), SHARDS, 0)
        assert_same_run(cached, plain, f"{kind} m={mini_batch_size}")


def test_the_replayed_random_state_is_what_makes_it_exact() -> None:
    # Sensitivity of the check above: other dropout masks move the weights by far more than 1e-10.
    cached = train(Setting("clip"), SHARDS, 0)
    other_masks = train(Setting("clip", strategy="reference"), SHARDS, 1)  # rank 1's seed
    assert max((cached[0][name] - value).abs().max().item() for name, value in other_masks[0].items()) > 1e-4


def _counting(module: nn.Module) -> list[bool]:
    calls: list[bool] = []
    module.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    return calls


def test_encodes_once_without_graph_then_once_with_and_each_parameter_gets_one_gradient() -> None:
    torch.manual_seed(0)
    tower = ImageTower(0.1).double()
    calls = _counting(tower)
    arrivals = {name: 0 for name, _ in tower.named_parameters()}
    for name, parameter in tower.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda _, key=name: arrivals.__setitem__(key, arrivals[key] + 1))
    x = torch.randn(7, 6, dtype=torch.float64)
    out = grad_cache(tower, x, mini_batch_size=2)
    assert calls == [False] * 4 and out.shape == (7, 5) and out.requires_grad
    out.square().sum().backward()
    assert calls == [False] * 4 + [True] * 4
    assert set(arrivals.values()) == {1}  # once per backward: one DDP reducer hook per parameter


def test_outputs_and_input_gradients_equal_the_reference_and_no_grad_mode_keeps_no_graph() -> None:
    torch.manual_seed(0)
    tower = TextTower(0.0).double()
    tokens, mask = torch.randint(1, 11, (5, 4)), torch.rand(5, 4) > 0.3
    embedding, gate = grad_cache(tower, tokens, mask, mini_batch_size=2)
    expected = tower(tokens, mask)
    torch.testing.assert_close(embedding, expected[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gate, expected[1], rtol=1e-12, atol=1e-12)
    image = ImageTower(0.0).double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    (grad_cached,) = torch.autograd.grad(grad_cache(image, x, mini_batch_size=3).sin().sum(), x)
    (grad_plain,) = torch.autograd.grad(image(x).sin().sum(), x)
    torch.testing.assert_close(grad_cached, grad_plain, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        assert not grad_cache(image, x, mini_batch_size=2).requires_grad


def test_gradient_accumulation_and_a_bound_method_encoder() -> None:
    torch.manual_seed(0)
    image, text = ImageTower(0.0).double(), nn.Linear(3, 5).double()

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.image, self.text = image, text

        def encode_image(self, x: Tensor) -> Tensor:
            return F.normalize(self.image(x), dim=-1)

    model = Model()
    micro_batches = [(torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)) for _ in "ab"]
    for x, y in micro_batches:  # .grad accumulates over micro-batches, as without the cache
        info_nce(grad_cache(model.encode_image, x, mini_batch_size=2), text(y), 5.0).backward()
    cached = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    for x, y in micro_batches:
        info_nce(model.encode_image(x), text(y), 5.0).backward()
    for got, expected in zip(cached, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_batch_norm_sees_mini_batch_statistics_and_updates_running_stats_once_per_mini_batch() -> None:
    def tower() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 5)).double()

    x = torch.randn(8, 6, dtype=torch.float64)  # mini-batches of 3, 3, 2
    cached_tower, reference_tower = tower(), tower()
    cached = grad_cache(cached_tower, x, mini_batch_size=3)
    reference = reference_encode(reference_tower, x, mini_batch_size=3, largest=8)
    assert isinstance(reference, Tensor)
    cached.sin().sum().backward()
    reference.sin().sum().backward()
    torch.testing.assert_close(cached, reference, rtol=1e-12, atol=1e-12)
    for (name, value), expected in zip(cached_tower.state_dict().items(), reference_tower.state_dict().values()):
        torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12, msg=name)  # running stats: 3 updates
    assert int(cached_tower[1].num_batches_tracked) == 3 and cached_tower[1].track_running_stats
    for got, expected in zip(cached_tower.parameters(), reference_tower.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(cached, tower()(x))  # full-batch statistics differ: not the same as plain


def test_bf16_autocast_state_is_replayed() -> None:
    torch.manual_seed(0)
    cached_tower = ImageTower(0.1)
    reference_tower = ImageTower(0.1)
    reference_tower.load_state_dict(cached_tower.state_dict())
    x, target = torch.randn(9, 6), torch.randn(9, 5)
    grads = []
    for tower, encode in ((cached_tower, grad_cache), (reference_tower, None)):
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = (grad_cache(tower, x, mini_batch_size=4) if encode else
                   reference_encode(tower, x, mini_batch_size=4, largest=9))
            assert isinstance(out, Tensor) and out.dtype == torch.bfloat16
            loss = (out.float() - target).square().mean()
        loss.backward()  # outside autocast, as recommended: the cache brings back the bf16 state itself
        grads.append([p.grad for p in tower.parameters()])
    for got, expected in zip(*grads):
        # Same bf16 products; only where the mini-batch gradients are summed differs (float32 here,
        # bfloat16 in the reference's cast node): measured at most 5.1e-3 relative over 30 seeds.
        assert (got - expected).abs().max() <= 2e-2 * expected.abs().max()  # type: ignore[operator]


def test_bad_input_raises_a_clear_error() -> None:
    tower, x = ImageTower(0.0), torch.randn(4, 6)

    class Returns(nn.Module):
        def __init__(self, result: object) -> None:
            super().__init__()
            self.result = result

        def forward(self, x: Tensor) -> object:
            return self.result(x) if callable(self.result) else self.result

    cases: list[tuple[type[Exception], str, object]] = [
        (ValueError, "mini_batch_size must be a positive int, got 0", lambda: grad_cache(tower, x, mini_batch_size=0)),
        (TypeError, "mini_batch_size must be a positive int, got float",
         lambda: grad_cache(tower, x, mini_batch_size=2.0)),
        (TypeError, "mini_batch_size must be a positive int, got bool",
         lambda: grad_cache(tower, x, mini_batch_size=True)),
        (ValueError, r"same leading \(batch\) size, got shapes \[\(4, 6\), \(3, 6\)\]",
         lambda: grad_cache(tower, x, x[:3], mini_batch_size=2)),
        (TypeError, "every input must be a torch.Tensor or a mapping of names to tensors, got list at position 0",
         lambda: grad_cache(tower, [1.0], mini_batch_size=2)),
        (TypeError, "at least one input tensor", lambda: grad_cache(tower, mini_batch_size=2)),
        (TypeError, "nn.Module or a bound method of one, got function",
         lambda: grad_cache(lambda x: x, x, mini_batch_size=2)),
        (TypeError, "return a tensor, a tuple of tensors or a dict of tensors, got dict",
         lambda: grad_cache(Returns(lambda x: {"z": 1.0}), x, mini_batch_size=2)),
        (TypeError, "return a tensor, a tuple of tensors or a dict of tensors, got list",
         lambda: grad_cache(Returns(lambda x: [x]), x, mini_batch_size=2)),
        (ValueError, r"leading size \(2 rows in this mini-batch\), got shapes \[\(4, 6\)\]",
         lambda: grad_cache(Returns(lambda x: x.repeat(2, 1)), x, mini_batch_size=2)),
        (ValueError, r"leading size \(2 rows in this mini-batch\), got shapes \[\(\)\]",
         lambda: grad_cache(Returns(lambda x: x.sum()), x, mini_batch_size=2)),
        (ValueError, "same kind, number, dtype and trailing shape for every mini-batch",
         lambda: grad_cache(Returns(lambda x: x if len(x) == 3 else x[:, :2]), x, mini_batch_size=3)),
        (ValueError, r"sizes=\(5,\) was given, but the input has 4 rows",
         lambda: grad_cache(tower, x, mini_batch_size=2, sizes=(5,))),
        (TypeError, "sizes must be a sequence of non-negative Python ints",
         lambda: grad_cache(tower, x, mini_batch_size=2, sizes=(-4,))),
    ]
    for kind, message, call in cases:
        with pytest.raises(kind, match=message):
            call()  # type: ignore[operator]


def test_an_empty_batch_encodes_once_and_gives_empty_outputs_connected_to_the_graph() -> None:
    tower = ImageTower(0.1)
    calls = _counting(tower)
    out = grad_cache(tower, torch.randn(0, 6), mini_batch_size=4)
    assert out.shape == (0, 5) and out.requires_grad and calls == [False]
    out.sum().backward()
    assert calls == [False, True] and all(torch.equal(p.grad, torch.zeros_like(p)) for p in tower.parameters())
