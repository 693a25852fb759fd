"""Towers for the recipes: torchvision ResNets adapted to small images, a byte-level text transformer."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchvision.models import resnet18
from torchvision.models.resnet import BasicBlock

BACKBONES = ("resnet-small", "resnet18")


def small_image_resnet(name: str, *, width: int = 32, stem_stride: int = 2) -> tuple[nn.Module, int]:
    """A torchvision ResNet for small (e.g. 32×32) images, returning ``(module, feature_dim)``.

    ``"resnet18"`` is torchvision's resnet18 (random init) with a 3×3 stride-1 stem and no max-pool,
    the usual CIFAR adaptation. ``"resnet-small"`` stacks one torchvision ``BasicBlock`` per stage
    with widths ``width·(1, 2, 4, 8)`` after a stride-``stem_stride`` stem: a few MFLOPs per image
    (4× more with ``stem_stride=1``, which keeps full resolution for shapes a few pixels wide), so the
    default runs train in minutes on a laptop CPU.

    Shape:
        input ``(n, 3, H, W)`` float → output ``(n, feature_dim)``; ``n`` may be 0.
    """
    if name == "resnet18":
        net = resnet18(weights=None)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()  # type: ignore[assignment]
        net.fc = nn.Identity()  # type: ignore[assignment]
        return net, 512
    if name != "resnet-small":
        raise ValueError(f"backbone must be one of {BACKBONES}, got {name!r}")
    if width < 1 or stem_stride not in (1, 2):
        raise ValueError(f"expected width >= 1 and stem_stride 1 or 2, got {width} and {stem_stride}")
    layers: list[nn.Module] = [
        nn.Conv2d(3, width, kernel_size=3, stride=stem_stride, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
    ]
    channels = width
    for stage in range(4):
        out = width * 2**stage
        stride = 1 if stage == 0 else 2
        downsample = None
        if stride != 1 or channels != out:
            downsample = nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))
        layers.append(BasicBlock(channels, out, stride=stride, downsample=downsample))
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers), channels


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 3..258), with begin, end and padding ids: no vocabulary to download.

    Example:
        >>> ByteTokenizer(context_length=8)(["hi"]).tolist()
        [[1, 107, 108, 2, 0, 0, 0, 0]]
    """

    pad, begin, end, vocab_size = 0, 1, 2, 259

    def __init__(self, *, context_length: int = 64) -> None:
        if context_length < 3:
            raise ValueError(f"context_length must be >= 3, got {context_length}")
        self.context_length = context_length

    def __call__(self, texts: list[str]) -> Tensor:
        tokens = torch.full((len(texts), self.context_length), self.pad, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [byte + 3 for byte in text.encode("utf-8")][: self.context_length - 2]
            ids = [self.begin, *ids, self.end]
            tokens[row, : len(ids)] = torch.tensor(ids)
        return tokens


class TextTransformer(nn.Module):
    """A small pre-norm transformer encoder over byte tokens, pooled at the end token (as in CLIP).

    Shape:
        tokens ``(n, L)`` long → ``(n, width)``; ``n`` may be 0.
    """

    def __init__(self, *, width: int = 64, layers: int = 2, heads: int = 4, context_length: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(ByteTokenizer.vocab_size, width)
        self.position = nn.Parameter(torch.randn(context_length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.shape[0] == 0:
            # Attention cannot reshape a 0-row batch; one padding row keeps every parameter in the
            # graph (DDP needs each rank's backward to reach them) and is sliced away.
            return self.forward(tokens.new_full((1, tokens.shape[1]), ByteTokenizer.end))[:0]
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        x = self.encoder(x, src_key_padding_mask=tokens == ByteTokenizer.pad)
        end = (tokens == ByteTokenizer.end).float().argmax(dim=1)
        return self.norm(x[torch.arange(tokens.shape[0]), end])


def projection_head(in_dim: int, hidden: int, out: int) -> nn.Sequential:
    """SimCLR's MLP head with BatchNorm (global under :func:`convert_sync_batchnorm`)."""
    return nn.Sequential(
        nn.Linear(in_dim, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True), nn.Linear(hidden, out)
    )
