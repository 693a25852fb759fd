"""open_clip's own training script (``open_clip_train``), run with the exact losses.

    python -m contrastive_dist.compat.open_clip_train --train-data pairs.csv --model ViT-B-32 ...
    torchrun --nproc-per-node 8 -m contrastive_dist.compat.open_clip_train --train-data ... --siglip

The arguments are open_clip_train's, unchanged; nothing of open_clip is edited. Before the script
builds its loss, :func:`~contrastive_dist.compat.open_clip.install` makes open_clip's factory build
``contrastive_dist.compat.open_clip.ClipLoss`` (or ``SigLipLoss`` with ``--siglip``). On CPU
processes, where ``DistributedDataParallel`` takes no ``device_ids`` and open_clip's script passes
``device_ids=[device]``, a CPU device is dropped from them for the run.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from contrastive_dist.compat.open_clip import install

__all__ = ["main"]


class _WithoutCpuDeviceIds(DistributedDataParallel):
    """DDP, with ``device_ids`` that name only the CPU dropped (DDP refuses them for a CPU module)."""

    def __init__(self, module: nn.Module, device_ids: Sequence[Any] | None = None, *args: Any, **kwargs: Any) -> None:
        if device_ids and all(torch.device(device).type == "cpu" for device in device_ids):
            device_ids = None
        super().__init__(module, device_ids, *args, **kwargs)


@contextlib.contextmanager
def _cpu_ddp() -> Iterator[None]:
    original = torch.nn.parallel.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = _WithoutCpuDeviceIds  # type: ignore[misc]
    try:
        yield
    finally:
        torch.nn.parallel.DistributedDataParallel = original  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> Any:
    """Run ``open_clip_train.main.main(argv)`` (default: this command's arguments) with the exact losses."""
    install()
    from open_clip_train.main import main as train

    with _cpu_ddp():
        return train(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
