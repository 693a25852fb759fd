"""Float32 against float64, in both communication modes: how precise each loss and its gradient are.

One process (a ring of one rank runs the same kernel and transport calls as any other), the
public functions only, so the same command measures any version of the package::

    python benchmarks/precision.py                 # 100 seeds for the loss, 50 for the gradient
    python benchmarks/precision.py --seeds 20      # quicker

Inputs: near-perfect pairs (each text is its image plus 5 % noise, L2-normalised), 16 × 32 for the
loss and 64 × 32 for the gradient, τ = 0.1 (SigLIP: scale 10, bias −10; SupCon: both views, 4
classes). Errors are relative to the float64 value of the same inputs; the gradient's is the
relative norm of the difference. Two more rows per mode: ``info_nce(x, x, temperature=0.02)``,
whose true value (about 4e-13) is far below float32's resolution of the logits, as an absolute
error, and the loss of a one-sample batch, which is exactly 0.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from contrastive_dist import info_nce, nt_xent, siglip, supcon

Loss = Callable[[Tensor, Tensor, str], Tensor]
LOSSES: dict[str, Loss] = {
    "info_nce": lambda a, b, mode: info_nce(a, b, temperature=0.1, communication=mode),
    "nt_xent": lambda a, b, mode: nt_xent(a, b, temperature=0.1, communication=mode),
    "supcon": lambda a, b, mode: supcon(
        torch.stack([a, b], 1), torch.arange(a.shape[0]) % 4, temperature=0.1, communication=mode
    ),
    "siglip": lambda a, b, mode: siglip(a, b, 10.0, -10.0, communication=mode),
}
MODES = ("gather", "ring")


def _unit(rows: int, dim: int, seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(rows, dim, generator=generator, dtype=torch.float64), dim=-1)


def near_pairs(rows: int, dim: int, seed: int, noise: float = 0.05) -> tuple[Tensor, Tensor]:
    """Images and texts that almost match: the regime where cancellation shows."""
    images = _unit(rows, dim, seed)
    return images, F.normalize(images + noise * _unit(rows, dim, seed + 1000), dim=-1)


def loss_errors(loss: Loss, mode: str, seeds: int) -> list[float]:
    errors = []
    for seed in range(seeds):
        images, texts = near_pairs(16, 32, seed)
        exact = loss(images, texts, mode).item()
        errors.append(abs(loss(images.float(), texts.float(), mode).item() - exact) / abs(exact))
    return errors


def gradient_errors(loss: Loss, mode: str, seeds: int) -> list[float]:
    errors = []
    for seed in range(seeds):
        images, texts = near_pairs(64, 32, seed)
        grads = []
        for dtype in (torch.float64, torch.float32):
            leaf = images.to(dtype).requires_grad_()
            (grad,) = torch.autograd.grad(loss(leaf, texts.to(dtype), mode), leaf)
            grads.append(grad.double())
        errors.append(((grads[1] - grads[0]).norm() / grads[0].norm()).item())
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=100, help="seeds of the loss rows (half as many for gradients)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}; float32 against float64, one process\n")
    print("| loss | mode | loss: median rel. error | loss: max rel. error | gradient: median rel. error |")
    print("|---|---|---:|---:|---:|")
    for name, loss in LOSSES.items():
        for mode in MODES:
            errors = loss_errors(loss, mode, args.seeds)
            grads = gradient_errors(loss, mode, max(1, args.seeds // 2))
            print(f"| {name} | {mode} | {statistics.median(errors):.1e} | {max(errors):.1e} | "
                  f"{statistics.median(grads):.1e} |")
    print("\n| mode | info_nce(x, x, temperature=0.02): float32 − float64 | one-sample batch, float32 |")
    print("|---|---:|---:|")
    x = _unit(16, 32, seed=7)
    one = _unit(1, 32, seed=8)
    for mode in MODES:
        tiny = abs(info_nce(x.float(), x.float(), temperature=0.02, communication=mode).item()
                   - info_nce(x, x, temperature=0.02, communication=mode).item())
        single = info_nce(one.float(), one.float(), communication=mode).item()
        print(f"| {mode} | {tiny:.1e} | {single:.1e} |")


if __name__ == "__main__":
    main()
