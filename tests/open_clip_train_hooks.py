"""open_clip's training script through ``python -m contrastive_dist.compat.open_clip_train``, with test hooks.

    python tests/open_clip_train_hooks.py DATA_DIR OUTPUT ARGS...                               one process
    torchrun --standalone --nproc-per-node 2 tests/open_clip_train_hooks.py DATA_DIR OUTPUT ARGS...   two

Runs the documented entry point as ``__main__`` (``runpy``), with what only a test needs, set up
from here: float64 (the default dtype, which the model and open_clip's image transforms follow), the
tiny model configs of ``DATA_DIR`` (``tiny-clip``, ``tiny-sigmoid``: no "siglip" in the name, which
would make open_clip fetch its SigLIP tokenizer), the deterministic (validation) image transform, and
one global batch of the CSV's 8 rows split [7, 1] over two processes (all 8 on one). After the
backward of the first step, each rank saves to ``OUTPUT-rank<r>.pt`` the gradients DDP averaged and
the loss value this rank got, and ``OUTPUT-loss-class.txt`` names the loss the script built.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import open_clip
import open_clip_train.data as train_data
import open_clip_train.main as train_main
import open_clip_train.train as train_loop
import torch
from torch.utils.data import DataLoader

SPLIT = (7, 1)


class UnevenBatches:
    """One global batch of every row, rank ``r`` taking its part of :data:`SPLIT` (all rows on one process)."""

    def __init__(self, rows: int, rank: int, world_size: int) -> None:
        sizes = SPLIT if world_size == 2 else (rows,)
        start = sum(sizes[:rank])
        self.batch = list(range(start, start + sizes[rank]))

    def __iter__(self) -> Any:
        return iter([self.batch])

    def __len__(self) -> int:
        return 1


def _replace(module: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``module.name`` becomes ``make(original)``."""
    setattr(module, name, make(getattr(module, name)))


def _hooked(data_dir: Path, output: Path) -> None:
    torch.set_default_dtype(torch.float64)
    open_clip.add_model_config(data_dir)
    models: list[torch.nn.Module] = []

    def create(original: Callable[..., Any]) -> Callable[..., Any]:
        def made(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            models.append(result[0])  # the model, before open_clip's script wraps it in DDP
            return result
        return made

    def get_data(original: Callable[..., Any]) -> Callable[..., Any]:
        return lambda args, transforms, *rest, **kwargs: original(args, (transforms[1],) * 2, *rest, **kwargs)

    def get_csv_dataset(original: Callable[..., Any]) -> Callable[..., Any]:
        def uneven(args: Any, *rest: Any, **kwargs: Any) -> Any:
            info = original(args, *rest, **kwargs)
            dataset = info.dataloader.dataset
            loader = DataLoader(dataset, batch_sampler=UnevenBatches(len(dataset), args.rank, args.world_size))
            loader.num_samples, loader.num_batches = len(dataset), 1  # type: ignore[attr-defined]
            info.dataloader, info.sampler = loader, None
            return info
        return uneven

    def backward(original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(total_loss: torch.Tensor, scaler: Any) -> None:
            original(total_loss, scaler)
            grads = {name: p.grad.detach().clone() for name, p in models[0].named_parameters() if p.grad is not None}
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            torch.save({"grads": grads, "loss": float(total_loss)}, f"{output}-rank{rank}.pt")
        return recorded

    def train_one_epoch(original: Callable[..., Any]) -> Callable[..., Any]:
        def named(model: Any, data: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
            Path(f"{output}-loss-class.txt").write_text(f"{type(loss).__module__}.{type(loss).__qualname__}")
            return original(model, data, loss, *args, **kwargs)
        return named

    _replace(train_main, "create_model_and_transforms", create)
    _replace(train_main, "get_data", get_data)
    _replace(train_main, "train_one_epoch", train_one_epoch)
    _replace(train_data, "get_csv_dataset", get_csv_dataset)
    _replace(train_loop, "backward", backward)


if __name__ == "__main__":
    data_dir, output = Path(sys.argv[1]), Path(sys.argv[2])
    _hooked(data_dir, output)
    sys.argv = ["open_clip_train", *sys.argv[3:]]
    runpy.run_module("contrastive_dist.compat.open_clip_train", run_name="__main__", alter_sys=True)
