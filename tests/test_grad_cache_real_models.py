"""grad_cache with encoders that cannot take 0 rows, under DDP with ``find_unused_parameters=True``.

A Hugging Face ``BertModel`` (its pooler unused: mean pooling of the last hidden states) and open_clip's
``VisionTransformer`` both raise on an empty batch. On shards [5, 0, 3] with mini-batches of 2, rank 0
encodes 3 mini-batches, rank 2 two and rank 1 none: no rank calls a tower on 0 rows, every rank
joins every exchange, rank 1 returns 0-row embeddings of the right shape, DDP marks each parameter
ready once per step, and two SGD steps give the weights of one process training on the whole batch
without the cache (float64). Both ways of calling it: ``grad_cache`` on the DDP model itself, and
inside the wrapped model's forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist import grad_cache, info_nce
from contrastive_dist.testing import WorkerPool

pytest.importorskip("transformers")
pytest.importorskip("open_clip")

SHARDS, STEPS, VOCABULARY = (5, 0, 3), 2, 20


class Towers(nn.Module):
    """A BERT text tower and an open_clip ViT image tower; ``cached``: grad_cache inside the forward."""

    def __init__(self, cached: bool = False) -> None:
        super().__init__()
        from open_clip.transformer import VisionTransformer
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        config = BertConfig(vocab_size=VOCABULARY, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = BertModel(config)
        self.vit = VisionTransformer(image_size=16, patch_size=8, width=16, layers=1, heads=2, mlp_ratio=2.0,
                                     output_dim=16)
        self.cached = cached
        self.double()

    def encode(self, tokens: Tensor, mask: Tensor, images: Tensor) -> tuple[Tensor, Tensor]:
        hidden = self.bert(input_ids=tokens, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1), self.vit(images)

    def forward(self, tokens: Tensor, mask: Tensor, images: Tensor) -> tuple[Tensor, Tensor]:
        if self.cached:
            return grad_cache(self.encode, tokens, mask, images, mini_batch_size=2)  # type: ignore[return-value]
        return self.encode(tokens, mask, images)


def _batch(step: int) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    rows = sum(SHARDS)
    tokens = torch.randint(1, VOCABULARY, (rows, 6), generator=generator)
    mask = (torch.arange(6) < torch.randint(1, 7, (rows, 1), generator=generator)).long()
    return tokens, mask, torch.randn(rows, 3, 16, 16, generator=generator, dtype=torch.float64)


def _train(model: nn.Module, network: Callable[..., tuple[Tensor, Tensor]],
           rows: slice) -> tuple[dict[str, Tensor], list[tuple[int, ...]]]:
    """The weights after the SGD steps, and the embeddings' shapes."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    shapes = []
    for step in range(STEPS):
        text, image = network(*(x[rows] for x in _batch(step)))
        shapes += [tuple(text.shape), tuple(image.shape)]
        info_nce(F.normalize(image, dim=-1), F.normalize(text, dim=-1), 10.0).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}, shapes


def _instrumented(model: Towers) -> tuple[list[int], dict[str, int]]:
    """The rows of every tower call, and how often each parameter's gradient arrived (filled as it runs)."""
    calls: list[int] = []
    for tower in (model.bert, model.vit):
        tower.register_forward_pre_hook(lambda _, args, kwargs: calls.append(
            (args[0] if args else kwargs["input_ids"]).shape[0]), with_kwargs=True)
    ready = {name: 0 for name, _ in model.named_parameters()}
    for name, parameter in model.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda _, at=name: ready.__setitem__(at, ready[at] + 1))
    return calls, ready


def _cached_runs(rank: int, world_size: int) -> dict[str, object]:
    rows = slice(sum(SHARDS[:rank]), sum(SHARDS[: rank + 1]))
    outcome: dict[str, object] = {}
    for way in ("on the DDP model", "inside its forward"):
        model = Towers(cached=way == "inside its forward")
        calls, ready = _instrumented(model)
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        network: Callable[..., tuple[Tensor, Tensor]] = ddp
        if way == "on the DDP model":
            network = functools.partial(grad_cache, ddp, mini_batch_size=2)  # type: ignore[assignment]
        outcome[way] = (*_train(model, network, rows), calls, ready)
    return outcome


def test_real_encoders_never_see_zero_rows_and_ddp_trains_as_one_process(pool: Callable[[int], WorkerPool]) -> None:
    per_rank = pool(3).run(_cached_runs, timeout=240)
    model = Towers()
    expected, _ = _train(model, model, slice(0, sum(SHARDS)))
    for rank, outcome in enumerate(per_rank):
        for way in ("on the DDP model", "inside its forward"):
            weights, shapes, calls, ready = outcome[way]  # type: ignore[misc]
            assert shapes == [(SHARDS[rank], 16)] * 2 * STEPS  # rank 1: 0 rows of the others' shape
            # Per step: forward encodes, then the backward's re-encodes; one call per tower and mini-batch.
            per_step = {0: [2, 2, 1] * 2, 1: [], 2: [2, 1] * 2}[rank]
            assert calls == [rows for rows in per_step * STEPS for _ in (0, 1)], f"rank {rank} {way}: {calls}"
            # Each used parameter's gradient arrives once a step (the unused pooler's: zeros from the rank
            # without rows, so that its DDP hooks fire there; DDP's average is zero, as one process's None).
            assert {count for name, count in ready.items() if "pooler" not in name} == {STEPS}, f"{rank} {way}"
            assert {count for name, count in ready.items() if "pooler" in name} <= {0, STEPS}, f"{rank} {way}"
            for name, value in expected.items():
                torch.testing.assert_close(weights[name], value, rtol=1e-10, atol=1e-12, msg=f"{rank} {way} {name}")
