"""Small towers that train in minutes on a CPU: a ResNet for small images, a byte-level text transformer.

* :func:`small_image_resnet` is a torchvision ResNet for images of a few dozen pixels.
* :class:`ByteTokenizer` turns captions into UTF-8 byte ids: no vocabulary to download.
* :class:`TextTransformer` encodes those ids, pooled at the end token as in CLIP.
* :func:`projection_head` is SimCLR's MLP head with BatchNorm.

Every tower takes a batch of 0 rows (a rank's share of a global batch may be empty) and keeps
all its parameters in the graph, as DDP needs.

Example:
    >>> import torch
    >>> tokens = ByteTokenizer(context_length=12)(["a red circle", "a cat"])
    >>> text_tower = TextTransformer(width=16, context_length=12)
    >>> image_tower, features = small_image_resnet("resnet-small", width=4)
    >>> tuple(text_tower(tokens).shape), tuple(image_tower(torch.zeros(2, 3, 16, 16)).shape), features
    ((2, 16), (2, 32), 32)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["ByteTokenizer", "TextTransformer", "projection_head", "small_image_resnet"]


def small_image_resnet(name: str, *, width: int = 32, stem_stride: int = 2,
                       norm: str = "batch") -> tuple[nn.Module, int]:
    """A torchvision ResNet for small images → ``(module, feature_dim)``; torchvision needed.

    ``"resnet18"``: torchvision's (random init) with a 3×3 stride-1 stem and no max-pool (the usual
    CIFAR change). ``"resnet-small"``: one ``BasicBlock`` per stage, widths ``width·(1, 2, 4, 8)``, a
    few MFLOPs per image, so the default runs train in minutes on a laptop CPU. ``norm="group"``
    puts GroupNorm (up to 8 groups: per-sample statistics, so ``--grad-cache`` changes nothing)
    where BatchNorm would be.

    Args:
        name: ``"resnet-small"`` or ``"resnet18"``.
        width: the first stage's channels (``resnet-small`` only).
        stem_stride: the first convolution's stride (``resnet-small`` only); 1 keeps full resolution.
        norm: ``"batch"`` or ``"group"``.

    Raises:
        ValueError: an unknown ``name`` or ``norm``.

    Shape:
        - input: ``(n, 3, H, W)``, ``n`` may be 0.
        - output: ``(n, feature_dim)``; ``feature_dim`` is ``8 · width`` or 512 (``resnet18``).

    Example:
        >>> import torch
        >>> net, features = small_image_resnet("resnet-small", width=4, norm="group")
        >>> tuple(net(torch.zeros(0, 3, 16, 16)).shape), features
        ((0, 32), 32)
    """
    from torchvision.models import resnet18
    from torchvision.models.resnet import BasicBlock

    if name not in ("resnet-small", "resnet18") or norm not in ("batch", "group"):
        raise ValueError(f"expected name in ('resnet-small', 'resnet18') and norm in ('batch', 'group'), got "
                         f"{name!r} and {norm!r}")

    def norm_layer(channels: int) -> nn.Module:
        return nn.BatchNorm2d(channels) if norm == "batch" else nn.GroupNorm(math.gcd(8, channels), channels)

    if name == "resnet18":
        net = resnet18(weights=None, norm_layer=norm_layer)
        net.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()  # type: ignore[assignment]
        net.fc = nn.Identity()  # type: ignore[assignment]
        return net, 512
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, stride=stem_stride, padding=1, bias=False),
                               norm_layer(width), nn.ReLU(inplace=True)]
    channels = width
    for stage in range(4):
        out, stride = width * 2**stage, 1 if stage == 0 else 2
        downsample = None
        if stride != 1 or channels != out:
            downsample = nn.Sequential(nn.Conv2d(channels, out, 1, stride=stride, bias=False), norm_layer(out))
        layers.append(BasicBlock(channels, out, stride=stride, downsample=downsample, norm_layer=norm_layer))
        channels = out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten()), channels


def projection_head(features: int, *, hidden: int, out: int) -> nn.Sequential:
    """SimCLR's projection head: linear (no bias), BatchNorm, ReLU, linear.

    Shape:
        - input: ``(n, features)``; output: ``(n, out)``.

    Example:
        >>> import torch
        >>> head = projection_head(32, hidden=16, out=8)
        >>> tuple(head(torch.randn(4, 32)).shape), [name for name, _ in head.named_children()]
        ((4, 8), ['0', '1', '2', '3'])
    """
    return nn.Sequential(nn.Linear(features, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                         nn.Linear(hidden, out))


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 3..258) between begin (1) and end (2), padded with 0: no vocabulary.

    A caption longer than ``context_length - 2`` bytes is cut; its end token is kept.

    Shape:
        - output: ``(len(texts), context_length)``, int64.

    Example:
        >>> ByteTokenizer(context_length=6)(["ab", "abcdef"]).tolist()
        [[1, 100, 101, 2, 0, 0], [1, 100, 101, 102, 103, 2]]
    """

    pad, begin, end, vocab_size = 0, 1, 2, 259

    def __init__(self, context_length: int) -> None:
        self.context_length = context_length

    def __call__(self, texts: list[str]) -> Tensor:
        """The ``(len(texts), context_length)`` token ids of ``texts``."""
        tokens = torch.full((len(texts), self.context_length), self.pad, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [self.begin, *(byte + 3 for byte in text.encode()[: self.context_length - 2]), self.end]
            tokens[row, : len(ids)] = torch.tensor(ids)
        return tokens


class TextTransformer(nn.Module):
    """A small pre-norm transformer over :class:`ByteTokenizer` ids, pooled at the end token as in CLIP.

    Args:
        width: the embedding and output width.
        context_length: tokens per caption.
        layers: transformer layers.
        heads: attention heads (they divide ``width``).

    Shape:
        - input: ``(n, context_length)`` token ids, ``n`` may be 0.
        - output: ``(n, width)``.

    Example:
        >>> tower = TextTransformer(width=8, context_length=5, heads=2)
        >>> tuple(tower(ByteTokenizer(5)(["hi", "a"])).shape), tuple(tower(ByteTokenizer(5)([])).shape)
        ((2, 8), (0, 8))
    """

    def __init__(self, *, width: int, context_length: int, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(ByteTokenizer.vocab_size, width)
        self.position = nn.Parameter(torch.randn(context_length, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens: Tensor) -> Tensor:
        """Encode ``(n, context_length)`` token ids to ``(n, width)`` features."""
        if tokens.shape[0] == 0:
            # Attention cannot take 0 rows; one padding row keeps every parameter in the graph (DDP
            # needs this rank's backward to reach them) and is sliced away.
            return self.forward(tokens.new_full((1, tokens.shape[1]), ByteTokenizer.end))[:0]
        x = self.encoder(self.embed(tokens) + self.position, src_key_padding_mask=tokens == ByteTokenizer.pad)
        end = (tokens == ByteTokenizer.end).float().argmax(dim=1)
        return self.norm(x[torch.arange(tokens.shape[0]), end])
