"""grad_cache with keyword and mapping inputs, dict outputs and padding trimmed per mini-batch; and its edge cases.

A Hugging Face style module (``forward(input_ids=…, attention_mask=…)`` returning a dict) equals
the plain full batch in float64; a parameter used but not registered warns; reentrant
checkpointing raises a clear error (non-reentrant works); a lazy module works on its first call;
a rank that skips the call gets an error naming the operation every rank called.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from contrastive_dist import grad_cache, info_nce
from contrastive_dist.testing import WorkerPool

VOCABULARY, WIDTH = 13, 6


class HFStyle(nn.Module):
    """Token embeddings, position embeddings, a mask-weighted mean: ``{"last_hidden_state", "pooled"}``."""

    def __init__(self, pooled_only: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.position = nn.Embedding(16, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.pooled_only = pooled_only

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        hidden = torch.tanh(self.out(self.embed(input_ids) + self.position.weight[: input_ids.shape[1]]))
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return {"pooled": pooled} if self.pooled_only else {"last_hidden_state": hidden, "pooled": pooled}


def _tokens(rows: int, length: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length) < lengths[:, None]).long()
    return torch.randint(1, VOCABULARY, (rows, length), generator=generator) * mask, mask


def _grads(module: nn.Module, value: Tensor) -> list[Tensor]:
    return [torch.zeros_like(p) if g is None else g
            for p, g in zip(module.parameters(), torch.autograd.grad(value, list(module.parameters()),
                                                                     allow_unused=True))]


@pytest.mark.parametrize("style", ["keywords", "mapping", "trimmed"])
def test_keyword_and_mapping_inputs_and_dict_outputs_equal_the_full_batch(style: str) -> None:
    torch.manual_seed(0)
    module = HFStyle(pooled_only=style == "trimmed").double()
    input_ids, attention_mask = _tokens(7, 9)
    upstream = torch.randn(7, WIDTH, dtype=torch.float64)
    features = {"input_ids": input_ids, "attention_mask": attention_mask}
    if style == "mapping":
        cached = grad_cache(MappingCaller(module), {**features, "modality": "text"}, mini_batch_size=3)
    else:
        cached = grad_cache(module, mini_batch_size=3, trim_padding=style == "trimmed", **features)
    plain = module(**features)
    assert isinstance(cached, dict) and cached.keys() == plain.keys()
    for key in plain:
        torch.testing.assert_close(cached[key], plain[key], rtol=1e-12, atol=1e-12)
    for got, expected in zip(_grads(module, (cached["pooled"] * upstream).sum()),
                             _grads(module, (plain["pooled"] * upstream).sum())):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


class MappingCaller(nn.Module):
    """sentence-transformers' calling convention: one mapping, here with a plain (non-tensor) entry too."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, features: dict[str, object]) -> dict[str, Tensor]:
        assert features["modality"] == "text"  # a plain value in the mapping reaches every call as it is
        return self.inner(input_ids=features["input_ids"], attention_mask=features["attention_mask"])


def test_trimming_cuts_each_mini_batch_to_its_own_width() -> None:
    widths: list[int] = []

    class Records(HFStyle):
        def forward(self, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
            widths.append(input_ids.shape[1])
            return super().forward(input_ids, attention_mask)

    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    grad_cache(Records(pooled_only=True), mini_batch_size=2, trim_padding=True, input_ids=mask, attention_mask=mask)
    assert widths == [2, 4]


def test_a_tensor_used_but_not_registered_warns_that_it_gets_no_gradient() -> None:
    outside = torch.randn(4, 4, requires_grad=True)

    class UsesOutside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.linear(x) @ outside

    out = grad_cache(UsesOutside(), torch.randn(5, 4), mini_batch_size=2)
    with pytest.warns(UserWarning, match=r"1 tensor\(s\) that require gradient but are neither its parameters nor "
                                         r"inputs \(shapes \[\(4, 4\)\]\); they receive no gradient"):
        out.sum().backward()
    assert outside.grad is None


@pytest.mark.parametrize("reentrant", [True, False])
def test_reentrant_checkpointing_raises_clearly_and_non_reentrant_works(reentrant: bool) -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: Tensor) -> Tensor:
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=reentrant)

    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    out = grad_cache(Checkpointed(), x, mini_batch_size=2)
    if reentrant:
        with pytest.raises(RuntimeError, match=r"reentrant checkpointing .*Use use_reentrant=False"):
            out.sum().backward()
        return
    got = _grads(inner, out.sum())  # the same as without the cache
    torch.testing.assert_close(got, _grads(inner, inner(x).sum()), rtol=1e-12, atol=1e-12)


def test_a_lazy_module_first_called_through_grad_cache_works() -> None:
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.LazyLinear(5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(7, 4, dtype=torch.float64)
    out = grad_cache(lazy, x, mini_batch_size=3)
    got = _grads(lazy, out.square().sum())
    torch.testing.assert_close(out, lazy(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, _grads(lazy, lazy(x).square().sum()), rtol=1e-12, atol=1e-12)


def _rank_one_skips_the_call(rank: int, world_size: int) -> None:
    tower = nn.Linear(4, 4)
    x = torch.randn(3 if rank == 0 else 0, 4)
    if rank == 0:
        embeddings = grad_cache(tower, x, mini_batch_size=2)
    else:
        embeddings = tower(x)  # an empty rank that skipped the encode
    info_nce(embeddings, embeddings.detach())


def test_an_empty_rank_that_skips_the_call_is_told_which_operation_each_rank_called(
    pool: Callable[[int], WorkerPool],
) -> None:
    per_rank = pool(2).run(_rank_one_skips_the_call, timeout=30, return_exceptions=True)
    messages = [str(error) for error in per_rank]
    assert all(isinstance(error, ValueError) for error in per_rank), per_rank
    assert messages[0] == messages[1]
    assert "reached one exchange from different operations" in messages[0]
    assert "rank 0: grad_cache" in messages[0] and "rank 1: info_nce" in messages[0]
