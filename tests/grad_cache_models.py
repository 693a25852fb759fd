"""Small float64 encoders with dropout, the memory-hungry reference of ``grad_cache``, and a training loop.

Imported by the gradient-cache tests and, through pickled functions, by their gloo workers.
The reference encodes exactly the mini-batches ``grad_cache`` documents, *with* gradient:
rows ``[k·m, (k+1)·m)`` for ``k < max(1, ceil(largest / m))``, empty ones included, concatenated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist import convert_sync_batchnorm, grad_cache, info_nce, nt_xent, siglip, supcon

KINDS = ("clip", "siglip", "ntxent", "supcon")
"""clip / siglip: an image tower and a 2-tensor text tower with a tuple output; ntxent / supcon: one encoder,
two views."""
VOCABULARY, TOKENS = 11, 4


def reference_encode(module: Callable[..., object], *inputs: Tensor, mini_batch_size: int,
                     largest: int) -> Tensor | tuple[Tensor, ...]:
    """The same mini-batches as ``grad_cache``, encoded with gradient and concatenated (the memory-hungry way)."""
    rows = inputs[0].shape[0]
    count = max(1, math.ceil(largest / mini_batch_size))
    parts = []
    for k in range(count):
        start, stop = min(k * mini_batch_size, rows), min((k + 1) * mini_batch_size, rows)
        parts.append(module(*(x[start:stop] for x in inputs)))
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)  # type: ignore[arg-type]
    return tuple(torch.cat(column) for column in zip(*parts))  # type: ignore[arg-type]


class ImageTower(nn.Module):
    """``(n, 6)`` → ``(n, 5)``, with dropout between the layers."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Dropout(dropout), nn.Linear(16, 5))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TextTower(nn.Module):
    """Tokens ``(n, 4)`` and a mask ``(n, 4)`` → ``(embedding (n, 5), gate (n, 1))``: two inputs, a tuple out."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 8)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(8, 5)
        self.gate = nn.Linear(8, 1)

    def forward(self, tokens: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        weights = mask.to(torch.float64).unsqueeze(-1)
        pooled = self.dropout((self.embed(tokens) * weights).sum(1) / weights.sum(1).clamp_min(1))
        return self.out(pooled), torch.sigmoid(self.gate(pooled))


class SyncTower(nn.Module):
    """``(n, 3, 4)`` → ``(n, 5)``: Conv1d, a synchronized BatchNorm (4 values per channel and row), dropout."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        net = nn.Sequential(nn.Conv1d(3, 8, 3, padding=1), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(dropout))
        self.net = convert_sync_batchnorm(net)
        self.out = nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.net(x).mean(-1))


@dataclass
class Batch:
    """One global batch: image features, a second view of them, tokens with a mask, labels."""

    x: Tensor
    views: Tensor
    tokens: Tensor
    mask: Tensor
    labels: Tensor

    def rows(self, start: int, stop: int) -> Batch:
        return Batch(*(getattr(self, name)[start:stop] for name in ("x", "views", "tokens", "mask", "labels")))


def make_batches(steps: int, total: int, seed: int = 0) -> list[Batch]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        x = torch.randn(total, 6, generator=generator, dtype=torch.float64)
        tokens = torch.randint(1, VOCABULARY, (total, TOKENS), generator=generator)
        mask = torch.rand(total, TOKENS, generator=generator) > 0.3
        labels = torch.randint(0, 2, (total,), generator=generator)
        views = x + 0.3 * torch.randn(total, 6, generator=generator, dtype=torch.float64)
        batches.append(Batch(x, views, tokens, mask, labels))
    return batches


class Contrastive(nn.Module):
    """Towers, a learnable ``logit_scale`` (log-parameterised) and SigLIP's bias; ``forward`` returns the loss.

    ``encode(module, *inputs)`` is where ``grad_cache`` or the reference comes in.
    """

    def __init__(self, kind: str, dropout: float, *, sync_bn: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.kind = kind
        self.image: nn.Module = SyncTower(dropout) if sync_bn else ImageTower(dropout)
        self.log_scale = nn.Parameter(torch.tensor(math.log(4.0)))
        if kind in ("clip", "siglip"):  # every parameter is used: DDP without find_unused_parameters
            self.text = TextTower(dropout)
        if kind == "siglip":
            self.bias = nn.Parameter(torch.tensor(-1.0))
        self.double()
        self.encode: Callable[..., object] = lambda module, *inputs: module(*inputs)
        self.loss_options: dict[str, object] = {}

    def forward(self, batch: Batch) -> Tensor:
        scale, options = self.log_scale.exp(), self.loss_options
        x = batch.x.view(-1, 3, 2).repeat(1, 1, 2) if isinstance(self.image, SyncTower) else batch.x
        views = batch.views.view(-1, 3, 2).repeat(1, 1, 2) if isinstance(self.image, SyncTower) else batch.views
        if self.kind in ("clip", "siglip"):
            image = F.normalize(self.encode(self.image, x), dim=-1)  # type: ignore[arg-type]
            embedding, gate = self.encode(self.text, batch.tokens, batch.mask)  # type: ignore[misc]
            text = F.normalize(embedding * gate, dim=-1)
            if self.kind == "clip":
                return info_nce(image, text, scale, **options)  # type: ignore[arg-type]
            return siglip(image, text, scale, self.bias, **options)  # type: ignore[arg-type]
        first, second = self.encode(self.image, x), self.encode(self.image, views)  # one encoder, two views
        if self.kind == "ntxent":
            return nt_xent(first, second, scale, **options)  # type: ignore[arg-type]
        features = F.normalize(torch.stack([first, second], dim=1), dim=-1)  # type: ignore[list-item]
        return supcon(features, batch.labels, scale, **options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Setting:
    """One training run: a loss, a transport, an encoding strategy and the shards of every step."""

    kind: str
    communication: str = "gather"
    chunk_size: int | None = None
    strategy: str = "cached"  # "cached" | "reference" | "plain"
    mini_batch_size: int = 2
    dropout: float = 0.1
    sync_bn: bool = False
    pass_sizes: bool = False


def train(setting: Setting, shards: Sequence[int], rank: int, *, steps: int = 3, lr: float = 0.5,
          ddp: bool = False) -> tuple[dict[str, Tensor], list[float]]:
    """``steps`` SGD steps on this rank's rows; the final parameters and buffers and the per-step losses."""
    model = Contrastive(setting.kind, setting.dropout, sync_bn=setting.sync_bn)
    m, largest = setting.mini_batch_size, max(shards)
    sizes = tuple(shards) if setting.pass_sizes else None
    if setting.strategy == "cached":
        model.encode = lambda module, *inputs: grad_cache(module, *inputs, mini_batch_size=m, sizes=sizes)
    elif setting.strategy == "reference":
        model.encode = lambda module, *inputs: reference_encode(module, *inputs, mini_batch_size=m, largest=largest)
    model.loss_options = {"communication": setting.communication, "chunk_size": setting.chunk_size}
    network: nn.Module = nn.parallel.DistributedDataParallel(model) if ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.manual_seed(100 + rank)  # the dropout masks: the same per rank for every strategy
    start, stop = sum(shards[:rank]), sum(shards[: rank + 1])
    losses = []
    for batch in make_batches(steps, sum(shards)):
        loss = network(batch.rows(start, stop))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {name: value.detach().clone() for name, value in model.state_dict().items()}, losses
