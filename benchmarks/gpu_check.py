"""One command for a machine with CUDA: exactness and speed of the package on GPUs, one table at the end.

Run::

    python benchmarks/gpu_check.py                       # everything the machine allows
    python benchmarks/gpu_check.py --csv gpu_check.csv   # where the table also goes (default: that name)

With one GPU: the loss kernels on CUDA against open_clip's ``ClipLoss`` and ``SigLipLoss`` on the
same tensors (value and gradients), then peak memory and time of forward+backward at global batch
16k, 32k, 64k, 128k (``--max-batch`` goes further), D = 768, fp32 and bf16, ``chunk_size``
1024 and 4096, with open_clip beside them until it runs out of memory, and published single-GPU
figures for context. With several GPUs, also on NCCL with one process per GPU: the gather, every
loss and SyncBatchNorm against single-process float64 references with uneven shards and an empty
rank; the gather's time against ``all_gather_into_tensor`` + ``reduce_scatter_tensor`` (even sizes)
and against pad-to-max (uneven); SyncBatchNorm's time against ``torch.nn.SyncBatchNorm``.

Without CUDA it prints one line and exits 0. Everything except the CUDA specifics (device, memory
counters, NCCL, ``nn.SyncBatchNorm``) runs on CPU too, which is how the test suite checks it.
"""

from __future__ import annotations

import argparse
import csv
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from contrastive_dist import SyncBatchNorm, all_gather, info_nce, nt_xent, siglip, supcon
from contrastive_dist.testing import WorkerPool

# all_gather_into_tensor / reduce_scatter_tensor under the names the installed torch uses (2.13 renamed them).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
COLUMNS = ("section", "check", "dtype", "batch", "chunk_size", "time_ms", "peak_mib", "max_error", "note")
Row = dict[str, Any]
PUBLISHED: list[Row] = [
    {"section": "published", "check": "Triton SigLIP kernel (fwd+bwd)", "dtype": "bfloat16", "batch": 65536,
     "time_ms": 48.8, "peak_mib": 1.4e9 / 2**20, "note": "as published (1.4 GB); its GPU and D, not this machine's"},
    {"section": "published", "check": "Inf-CL (arXiv 2410.17243)", "note": "multi-GPU figures only (8 and 32 A800, "
     "its section 4.2, cost analysis): not comparable per GPU, not copied here"},
]


def measure(step: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, float]:
    """Median milliseconds of ``step()`` (one warm-up) and its peak memory in MiB (NaN on CPU).

    The peak is counted above what is allocated after the warm-up: the inputs and their gradients
    are excluded, what the step itself needs is measured.
    """
    cuda = device.type == "cuda"
    step()
    times = []
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start_bytes = torch.cuda.memory_allocated(device) if cuda else 0
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - start_bytes) / 2**20 if cuda else float("nan")
    return statistics.median(times), peak


def features(batch: int, dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images, texts = (F.normalize(torch.randn(batch, dim, generator=generator), dim=-1) for _ in range(2))
    return images.to(device, dtype).requires_grad_(), texts.to(device, dtype).requires_grad_()


def losses(chunk_size: int | None) -> dict[str, Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]]:
    """Ours and open_clip's CLIP and SigLIP losses, one signature: (images, texts, scale, bias)."""
    from open_clip.loss import ClipLoss, SigLipLoss

    return {
        "info_nce": lambda i, t, s, b: info_nce(i, t, s, chunk_size=chunk_size),
        "siglip": lambda i, t, s, b: siglip(i, t, s, b, chunk_size=chunk_size),
        "open_clip ClipLoss": lambda i, t, s, b: ClipLoss()(i, t, s),
        "open_clip SigLipLoss": lambda i, t, s, b: SigLipLoss()(i, t, s, b),
    }


def against_open_clip(device: torch.device, batch: int = 4096, dim: int = 768) -> list[Row]:
    """Value and gradients of our kernels vs open_clip's on the same fp32 tensors (max relative error)."""
    rows = []
    scale, bias = torch.tensor(1 / 0.07, device=device), torch.tensor(-10.0, device=device)
    for chunk_size in (None, 1024):
        fns = losses(chunk_size)
        for ours, theirs in (("info_nce", "open_clip ClipLoss"), ("siglip", "open_clip SigLipLoss")):
            results = []
            for name in (ours, theirs):
                images, texts = features(batch, dim, torch.float32, device)
                value = fns[name](images, texts, scale, bias)
                value.backward()
                results.append((value.detach(), images.grad, texts.grad))
            error = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-30)) for a, b in zip(*results))
            rows.append({"section": "1 GPU exactness", "check": f"{ours} vs {theirs}", "dtype": "float32",
                         "batch": batch, "chunk_size": chunk_size, "max_error": error, "note": "relative"})
    return rows


def sweep(device: torch.device, batches: Sequence[int], dim: int, dtypes: Sequence[torch.dtype],
          chunk_sizes: Sequence[int], repeats: int) -> list[Row]:
    """Forward+backward time and peak memory per batch; a method stops growing at its first OOM."""
    rows: list[Row] = []
    methods = [(name, chunk) for chunk in chunk_sizes for name in ("info_nce", "siglip")]
    methods += [("open_clip ClipLoss", None), ("open_clip SigLipLoss", None)]
    for dtype in dtypes:
        for name, chunk in methods:
            for batch in batches:
                rows.append(_measure_loss(name, chunk, batch, dim, dtype, device, repeats))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if rows[-1].get("note"):
                    break  # out of memory: larger batches would be too
    return rows


def _measure_loss(name: str, chunk: int | None, batch: int, dim: int, dtype: torch.dtype, device: torch.device,
                  repeats: int) -> Row:
    row: Row = {"section": "1 GPU speed", "check": name, "dtype": str(dtype).removeprefix("torch."),
                "batch": batch, "chunk_size": chunk}
    images, texts = features(batch, dim, dtype, device)
    scale, bias = torch.tensor(1 / 0.07, device=device), torch.tensor(-10.0, device=device)
    fn = losses(chunk)[name]
    try:
        row["time_ms"], row["peak_mib"] = measure(lambda: fn(images, texts, scale, bias).backward(), device, repeats)
    except torch.OutOfMemoryError:
        row["note"] = "out of memory"
    return row


class _PadToMax(torch.autograd.Function):
    """The common hand-written gather: pad every rank to the largest, gather equal blocks, drop the padding."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, sizes: tuple[int, ...]) -> Tensor:  # type: ignore[override]
        largest, rank = max(sizes), dist.get_rank()
        padded = x.new_zeros((largest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        out = x.new_empty((len(sizes) * largest, *x.shape[1:]))
        _all_gather_single(out, padded)
        ctx.largest, ctx.rank, ctx.rows = largest, rank, x.shape[0]
        ctx.keep = torch.cat([torch.arange(r * largest, r * largest + n) for r, n in enumerate(sizes)]).to(x.device)
        return out[ctx.keep]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        padded = grad.new_zeros((dist.get_world_size() * ctx.largest, *grad.shape[1:]))
        padded[ctx.keep] = grad
        out = grad.new_empty((ctx.largest, *grad.shape[1:]))
        _reduce_scatter_single(out, padded)
        return out[: ctx.rows], None


def _raw_collectives(x: Tensor, world_size: int) -> None:
    """The floor for equal sizes: the two collectives an autograd gather needs, nothing else."""
    rows = x.detach()  # raw collectives write in place; no autograd here
    out = rows.new_empty((world_size * rows.shape[0], *rows.shape[1:]))
    _all_gather_single(out, rows)
    _reduce_scatter_single(rows.new_empty(rows.shape), out)


def _shard(full: Tensor, sizes: Sequence[int], rank: int) -> Tensor:
    return full[sum(sizes[:rank]) : sum(sizes[: rank + 1])]


def _max_error(pairs: list[tuple[Tensor, Tensor]]) -> float:
    return max((float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0) for a, b in pairs)


def distributed_checks(rank: int, world_size: int, device_type: str, exact_rows: int, timed_rows: int, dim: int,
                       repeats: int) -> list[Row]:
    """On every rank: exactness in float64 with one empty rank (about ``exact_rows`` rows per rank, 6 features),
    then timings with ``timed_rows`` rows of ``dim`` features per rank. Rank 0's rows are reported."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    uneven = tuple(0 if r == 1 else exact_rows * (r + 1) // 2 + 1 for r in range(world_size))
    generator = torch.Generator().manual_seed(1)
    full = torch.randn(sum(uneven), 6, generator=generator, dtype=torch.float64).to(device)
    labels = torch.randint(0, 3, (sum(uneven),), generator=generator).to(device)
    rows: list[Row] = []

    def report(check: str, error: float, note: str = "") -> None:
        rows.append({"section": f"{world_size} GPU exactness", "check": check, "dtype": "float64",
                     "batch": sum(uneven), "max_error": error, "note": note or f"shards {list(uneven)}"})

    for given in (None, uneven):  # sizes= takes the status-carrying path
        local = _shard(full, uneven, rank).clone().requires_grad_()
        gathered = all_gather(local, sizes=given).tensor
        (gathered * full).sum().backward()  # every rank's loss touches every row: grad = W · full
        report(f"all_gather sizes={'given' if given else 'exchanged'}",
               _max_error([(gathered, full), (local.grad, world_size * _shard(full, uneven, rank))]))
    one, two = full[:, :3], full[:, 3:]
    # The reference: the same loss over the whole batch in a group of this rank alone (the plain
    # single-process loss, itself checked against loops in the test suite).
    alone = [dist.new_group([r]) for r in range(world_size)][rank]  # every rank creates every group
    loss_fns: dict[str, Callable[..., Tensor]] = {
        "info_nce": lambda a, b, y, group=None: info_nce(a, b, chunk_size=2, group=group),
        "nt_xent": lambda a, b, y, group=None: nt_xent(a, b, chunk_size=2, group=group),
        "siglip": lambda a, b, y, group=None: siglip(a, b, 2.0, -1.0, chunk_size=2, group=group),
        "supcon": lambda a, b, y, group=None: supcon(torch.stack([a, b], 1), y, chunk_size=2, group=group),
    }
    for name, loss_fn in loss_fns.items():
        whole = (one.clone().requires_grad_(), two.clone().requires_grad_())
        reference = loss_fn(*whole, labels, group=alone)
        reference.backward()
        a, b = (_shard(t, uneven, rank).clone().requires_grad_() for t in (one, two))
        loss = loss_fn(a, b, _shard(labels, uneven, rank))
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        # The mean over ranks is the global loss, and its gradient is each rank's gradient / W.
        pairs = [(total / world_size, reference.detach())]
        pairs += [(x.grad / world_size, _shard(r.grad, uneven, rank)) for x, r in zip((a, b), whole)]
        report(f"{name} value and gradients", _max_error(pairs))
    rows += _syncbn_exactness(rank, world_size, device, uneven, full)
    if device.type != "cuda":
        for row in rows:
            row["section"] = row["section"].replace("GPU", "CPU processes")
    return rows + _timings(rank, world_size, device, timed_rows, dim, repeats)


def _syncbn_exactness(rank: int, world_size: int, device: torch.device, uneven: tuple[int, ...],
                      full: Tensor) -> list[Row]:
    """Ours (and nn.SyncBatchNorm on CUDA, on shards without an empty rank) vs one BatchNorm on the whole batch."""
    images = full.reshape(-1, 3, 2, 1)  # (N, C=3, H=2, W=1)
    weights = torch.randn(images.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    candidates: list[tuple[str, nn.Module, tuple[int, ...]]] = [("SyncBatchNorm", SyncBatchNorm(3), uneven)]
    if device.type == "cuda":  # torch's own runs on CUDA only
        candidates.append(("torch.nn.SyncBatchNorm", nn.SyncBatchNorm(3), tuple(max(1, n) for n in uneven)))
    rows = []
    for name, layer, sizes in candidates:
        reference_layer = nn.BatchNorm2d(3).to(device, torch.float64)
        whole = images[: sum(sizes)].clone().requires_grad_()
        expected = reference_layer(whole)
        (expected * weights[: sum(sizes)]).sum().backward()  # = the sum over ranks of their (out · weights)
        layer = layer.to(device, torch.float64)
        local = _shard(images, sizes, rank).clone().requires_grad_()
        try:  # the same failure on every rank (e.g. a dtype torch's kernel lacks): report it, go on
            out = layer(local)
            (out * _shard(weights, sizes, rank)).sum().backward()
        except RuntimeError as error:
            rows.append({"section": f"{world_size} GPU exactness", "check": name, "note": f"failed: {error}"})
            continue
        pairs = [(out, _shard(expected, sizes, rank)), (local.grad, _shard(whole.grad, sizes, rank))]
        pairs.append((layer.running_var, reference_layer.running_var))
        rows.append({"section": f"{world_size} GPU exactness", "check": f"{name} output, gradient, running var",
                     "dtype": "float64", "batch": sum(sizes), "max_error": _max_error(pairs),
                     "note": f"shards {list(sizes)}"})
    return rows


def _timings(rank: int, world_size: int, device: torch.device, rows_per_rank: int, dim: int,
             repeats: int) -> list[Row]:
    """Forward+backward of the gather against the raw collectives and pad-to-max; SyncBatchNorm against torch's."""
    even = (rows_per_rank,) * world_size
    uneven = tuple(rows_per_rank * (2 * r + 1) // world_size for r in range(world_size))
    cases: list[tuple[str, tuple[int, ...], Callable[[Tensor], Any]]] = [
        ("all_gather sizes=", even, lambda x: all_gather(x, sizes=even).tensor.sum().backward()),
        ("all_gather_into_tensor + reduce_scatter_tensor", even, lambda x: _raw_collectives(x, world_size)),
        ("all_gather sizes=", uneven, lambda x: all_gather(x, sizes=uneven).tensor.sum().backward()),
        ("pad-to-max", uneven, lambda x: _PadToMax.apply(x, uneven).sum().backward()),
    ]
    layers = [("SyncBatchNorm", SyncBatchNorm(64))]
    if device.type == "cuda":
        layers.append(("torch.nn.SyncBatchNorm", nn.SyncBatchNorm(64)))
    rows = []
    for name, sizes, step in cases:
        x = torch.randn(sizes[rank], dim, device=device, requires_grad=True)
        elapsed, _ = measure(functools.partial(_synchronized, step, x), device, repeats)
        rows.append({"section": "gather speed", "check": name, "dtype": "float32", "batch": sum(sizes),
                     "time_ms": elapsed, "note": f"shards {list(sizes)}, D={dim}"})
    for name, layer in layers:
        layer = layer.to(device)
        batch = torch.randn(max(1, rows_per_rank // 64), 64, 28, 28, device=device, requires_grad=True)
        elapsed, _ = measure(functools.partial(_synchronized, _forward_backward, layer, batch), device, repeats)
        rows.append({"section": "SyncBatchNorm speed", "check": name, "dtype": "float32",
                     "batch": world_size * batch.shape[0], "time_ms": elapsed, "note": "(n, 64, 28, 28) per rank"})
    return rows


def _synchronized(step: Callable[..., Any], *args: Any) -> None:
    """One step, then a barrier: each time is the slowest rank's."""
    step(*args)
    dist.barrier()


def _forward_backward(layer: nn.Module, batch: Tensor) -> None:
    layer(batch).sum().backward()


def table(rows: list[Row]) -> str:
    """One markdown table of every row, in the order measured."""
    def cell(value: Any) -> str:
        if value is None or value == "":
            return ""
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.2f}"
        return str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({column: row.get(column, "") for column in COLUMNS} for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", default="gpu_check.csv", help="where the table is written as CSV")
    # 128k keeps the whole run to a few minutes on one recent GPU; ours grows linearly in memory, so
    # larger batches are a matter of time (--max-batch 1048576), open_clip's stop at its first OOM.
    parser.add_argument("--max-batch", type=int, default=131072, help="largest global batch of the sweep")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine; nothing to measure (run it where a GPU is).")
        return 0
    device = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(device)
    print(f"gpu_check on {torch.cuda.device_count()} x {name}, torch {torch.__version__}", flush=True)
    batches = [16384 * 2**k for k in range(16) if 16384 * 2**k <= args.max_batch]
    rows = against_open_clip(device)
    rows += sweep(device, batches, 768, (torch.float32, torch.bfloat16), (1024, 4096), args.repeats)
    rows += PUBLISHED
    world_size = torch.cuda.device_count()
    if world_size > 1:
        with WorkerPool(world_size, backend="nccl", timeout=600) as pool:
            rows += pool.run(distributed_checks, "cuda", 16, 8192, 768, args.repeats)[0]
    print(table(rows))
    write_csv(rows, args.csv)
    print(f"written to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
