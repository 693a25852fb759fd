"""Each fused epilogue kernel's time on one block, over a set of tiles and warps: where the tiles of
``contrastive_dist/losses/_triton_launch.py`` come from.

One float32 product ``P`` of ``--rows × --columns`` (``--transposed``: the kernels read ``P.T``, as
a symmetric loss's columns' direction does), bfloat16 ``G``; per kernel and tile the milliseconds
of one launch (CUDA events, mean of ``--repeats``), ``*`` marking the tile the package takes, and a
copy of ``P`` into ``G`` (6 bytes a logit) as the memory's floor. Each line is printed as it is
measured, the kernels not yet swept on a GPU first (``pairs``, ``pair_grad``: a symmetric loss's two
directions from one read), so a run cut short by its time bound keeps what it measured. Run from the
repository root::

    PYTHONPATH=$PWD python benchmarks/gpu_tiles.py --rows 4096 --columns 65536

Without CUDA it runs each launch once in Triton's interpreter (``TRITON_INTERPRET=1``) on a tiny
block, timing nothing: a check that every configuration launches.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Sequence

import torch

if not torch.cuda.is_available():  # before Triton is imported: its kernels then run in numpy
    os.environ["TRITON_INTERPRET"] = "1"

from contrastive_dist.losses import _triton_kernels as kernels  # noqa: E402
from contrastive_dist.losses import _triton_launch as launch  # noqa: E402
from contrastive_dist.losses import _triton_pairs as pairs  # noqa: E402

TILES = [launch.Tile(*tile) for tile in ((8, 256, 4), (8, 256, 8), (16, 256, 8), (4, 256, 4), (4, 512, 4),
                                         (8, 512, 8), (16, 128, 4), (32, 128, 8), (2, 1024, 4), (1, 2048, 4),
                                         (1, 2048, 8), (64, 64, 4), (32, 64, 4))]  # fmt: skip


def _milliseconds(launch_once: Callable[[], None], repeats: int, cuda: bool) -> float:
    if not cuda:
        launch_once()
        return math.nan
    for _ in range(3):
        launch_once()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        launch_once()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main(argv: Sequence[str] | None = None) -> str:
    """Print (and return) one line per kernel and tile."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--columns", type=int, default=65536)
    parser.add_argument("--transposed", action="store_true", help="the kernels read P.T (rows and columns swap)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        args.rows, args.columns = min(args.rows, 64), min(args.columns, 1024)
    device = torch.device("cuda" if cuda else "cpu")
    shape = (args.columns, args.rows) if args.transposed else (args.rows, args.columns)
    stored = torch.randn(shape, device=device).mul_(0.3)
    product = stored.T if args.transposed else stored
    c, m = product.shape
    grad = torch.empty(c, m, device=device, dtype=torch.bfloat16)
    scale, bias = torch.tensor(14.3, device=device), torch.tensor(-10.0, device=device)
    positive, excluded = torch.arange(c, device=device), (torch.arange(c, device=device) + 7) % m
    state = torch.tensor([5.0, 100.0, 0.0, 0.0, 1.0], device=device).repeat(c, 1)
    row_stats = torch.empty(c, 5, device=device)
    softmax = {"HAS_BIAS": False, "HAS_POS": True, "HAS_EXCL": True, "KEY_RULE": 0}

    def launches(tile: launch.Tile) -> dict[str, Callable[[], None]]:
        splits, span = launch.span(product, 0, tile)
        sums, partial = torch.empty(2, splits, c, device=device), torch.empty(splits, c, 5, device=device)
        shape = {"BR": tile.rows, "BC": tile.columns, "num_warps": tile.warps}
        row_programs = math.ceil(c / tile.rows)
        rows_grid, tiles_grid = (row_programs, splits), (row_programs, math.ceil(m / tile.columns))
        return {
            "sigmoid": lambda: kernels.sigmoid_kernel[rows_grid](
                product, *product.stride(), scale, bias, positive, None, 0, None, None, 0, None, grad, *grad.stride(),
                sums[0], sums[1], c, m, span, HAS_BIAS=True, HAS_POS=True, HAS_EXCL=False, KEY_RULE=0, HAS_W=False,
                WRITE_G=True, **shape),
            "state": lambda: kernels.state_kernel[rows_grid](
                product, *product.stride(), scale, None, positive, excluded, 0, None, None, 0,
                row_stats if splits == 1 else partial, c, m, span, **softmax, SINGLE=splits == 1, **shape),
            "grad": lambda: kernels.grad_kernel[tiles_grid](
                product, *product.stride(), scale, None, state, positive, excluded, 0, None, None, 0, None, grad,
                *grad.stride(), c, m, **softmax, HAS_W=False, **shape),
            "block": lambda: kernels.block_kernel[rows_grid[:1]](
                product, *product.stride(), scale, None, positive, excluded, 0, None, None, 0, None, row_stats, grad,
                *grad.stride(), c, m, **softmax, HAS_W=False, **shape),
            # A symmetric loss's both directions: the columns' positives are the rows' (a square block).
            "pairs": lambda: pairs.pair_state_kernel[rows_grid](
                product, *product.stride(), scale, None, positive, excluded, 0, positive, None, 0, None, None, 0,
                row_stats if splits == 1 else partial, column_partial(tile), c, m, min(c, m), span, **softmax,
                HAS_CPOS=True, HAS_CEXCL=False, ROWS_SINGLE=splits == 1, COLUMNS_SINGLE=row_programs == 1, **shape),
            "pair_grad": lambda: pairs.pair_grad_kernel[rows_grid[:1]](
                product, *product.stride(), scale, None, state, positive, excluded, 0, state, positive, None, 0, None,
                None, 0, None, None, grad, *grad.stride(), c, m, min(c, m), **softmax, HAS_CPOS=True, HAS_CEXCL=False,
                HAS_W=False, HAS_CW=False, **shape),
        }  # fmt: skip

    def column_partial(tile: launch.Tile) -> torch.Tensor:
        """The columns' state, partial per program of rows (the rows' ``state`` serves as the columns' final)."""
        return torch.empty(math.ceil(c / tile.rows), min(c, m), 5, device=device)

    floor = _milliseconds(lambda: grad.copy_(product), args.repeats, cuda)
    lines: list[str] = []

    def say(line: str) -> None:  # each line as it is measured: a run stopped by its time bound keeps them
        lines.append(line)
        print(line, flush=True)

    say(f"P {c} x {m}{' (P.T)' if args.transposed else ''}, {device.type}: copy P into bf16 G "
        f"(6 B a logit) {floor:.3f} ms")
    started = time.perf_counter()
    # The kernels never swept on a GPU first (the others' tiles were chosen on an H200).
    unswept = ("pairs", "pair_grad")
    for kernel in (*unswept, *(name for name in launch.KERNELS if name not in unswept)):
        chosen = launch.tile(product, kernel) if cuda else None
        for tile in TILES:
            try:
                text = f"{_milliseconds(launches(tile)[kernel], args.repeats, cuda):.3f} ms"
            except Exception as error:  # noqa: BLE001 - a tile the kernel cannot take costs its own line
                text = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:80]}"
            mark = " *" if tile == chosen else ""
            say(f"{kernel} rows {tile.rows} columns {tile.columns} warps {tile.warps}: {text}{mark}")
    say(f"({time.perf_counter() - started:.1f} s)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
