"""Time and peak memory of the CLIP / NT-Xent losses against the implementations people use today.

Run (gloo, CPU, one process per rank)::

    python benchmarks/losses.py --quick                 # small sizes, about a minute
    python benchmarks/losses.py                         # W=2 and W=4, 4096 rows per rank, D=512
    python benchmarks/losses.py --world-sizes 2 --n 4096 --repeats 5
    # memory against the number of ranks at fixed rows per rank: gather vs ring vs open_clip
    python benchmarks/losses.py --world-sizes 2 4 8 --n 1024 --dim 256 --no-uneven \
        --methods clip clip_chunk256 clip_ring clip_ring_chunk256 clip_ring_chunk256_wait open_clip_local \
        --by-ranks clip_chunk256 --plot docs/assets/benchmarks/losses_by_ranks.svg

Every method runs forward + backward on the same L2-normalised features (scale 1/0.07);
methods are interleaved inside each repeat so that load from other processes hits them alike,
and the median over repeats is reported (time: the slowest rank of each repeat; memory: the
largest rank). Memory is the peak resident set size above the level just before the call,
sampled every 0.5 ms by a thread reading ``/proc/self/statm`` (PyTorch ops release the GIL,
so the sampler runs while they compute). glibc is told to serve every allocation above 64 KiB
with ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the RSS at once and each
measurement starts from the same floor.

``clip_ring*`` rows are ``DistributedInfoNCE(communication="ring")``; ``clip_ring_chunk256_wait`` is
the same with every transfer waited for before computing on the block (no overlap), a variant that
lives only here: the difference to ``clip_ring_chunk256`` is the transfer time the overlap hides.
``clip_negatives_chunk256`` and ``clip_ring_negatives_chunk256`` add ``n`` own hard negatives per
rank (``negatives=``, with gradient; the texts rolled by one row), gathered or sent round the ring.
``clip_*ids_mask_chunk256`` / ``clip_*ids_positive_chunk256`` pass sample ids (one id per 4 rows,
overlapping between neighbouring ranks) with ``same_id="mask"`` / ``"positive"``.
``ntxent*`` rows are ``NTXentLoss`` (temperature 0.5) on the same pairs as two views, gathered or
``*_ring``, ``*_none`` with ``reduction="none"`` (summed and scaled like the mean); ``lightly_ntxent`` is
lightly's on the same inputs.
``--by-ranks METHOD`` ends with one table of peak memory and time against W, with ratios to METHOD;
``--plot PATH`` draws the same rows (every equal-size run) as a figure of memory and time against W.

Baselines (optional; a row says "missing" when the package is not installed):
``open_clip`` ``ClipLoss(local_loss=True, gather_with_grad=True)`` and ``ClipLoss()``
(``pip install open-clip-torch``), ``lightly`` ``NTXentLoss(gather_distributed=True)``
(``pip install --no-deps lightly``), and the GEMM floor: only the six matrix products a
symmetric local-rows CLIP loss needs (2 forward, 4 backward), no softmax, no gather.
Both open_clip and lightly gather with ``torch.distributed.nn.all_gather``, which needs equal
sizes, so they are skipped for uneven shards.

From other code (e.g. a notebook)::

    from benchmarks.losses import measure
    measure("clip_chunk256", world_size=2, n_per_rank=1024)  # {'time_s': ..., 'peak_mib': ...}
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from contrastive_dist.engine import _ring
from contrastive_dist.testing import run_distributed

METHODS = (
    "clip",
    "clip_chunk256",
    "clip_chunk1024",
    "clip_chunk256_recompute",
    "clip_ring",
    "clip_ring_chunk256",
    "clip_ring_chunk256_wait",
    "clip_negatives_chunk256",
    "clip_ring_negatives_chunk256",
    "clip_ids_mask_chunk256",
    "clip_ids_positive_chunk256",
    "clip_ring_ids_mask_chunk256",
    "clip_ring_ids_positive_chunk256",
    "open_clip_local",
    "open_clip_default",
    "gemm_floor",
    "ntxent",
    "ntxent_chunk256",
    "ntxent_ring",
    "ntxent_ring_chunk256",
    "ntxent_ring_none",
    "lightly_ntxent",
)
EQUAL_SIZES_ONLY = {"open_clip_local", "open_clip_default", "lightly_ntxent"}
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE


class _PeakSampler:
    """Peak RSS above the level at ``start``, from a background sampling thread."""

    def __init__(self, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s

    def __enter__(self) -> _PeakSampler:
        self.base = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval_s)

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _build(method: str, rank: int, world_size: int, dim: int) -> Callable[..., torch.Tensor] | None:
    """A ``loss(images, texts, scale)`` callable, or None when its package is missing."""
    from contrastive_dist import DistributedInfoNCE, NTXentLoss

    if method.startswith("clip_ring"):
        chunk = int(method.split("chunk")[1].split("_")[0]) if "chunk" in method else None
        same_id = "positive" if "_positive" in method else "mask"
        ring = DistributedInfoNCE(chunk_size=chunk, communication="ring", same_id=same_id)
        shift = _shift_then_wait if method.endswith("_wait") else _OVERLAPPING_SHIFT

        def ring_loss(images: torch.Tensor, texts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            # Only in this worker process: ``_wait`` waits for every transfer before computing (no overlap).
            _ring.Ring.shift = shift  # type: ignore[method-assign]
            return ring(images, texts, scale, negatives=_hard_negatives(method, texts), **_ids(method, rank, texts))

        return ring_loss
    if method.startswith("clip"):
        chunk = int(method.split("chunk")[1].split("_")[0]) if "chunk" in method else None
        if method.endswith("_recompute"):
            # Per-row losses (reduction="none") recompute each block in backward: 4 products per
            # block instead of 3. Summed and scaled like the mean, it is the same loss and gradient.
            rows_criterion = DistributedInfoNCE(chunk_size=chunk, reduction="none")

            def recompute(images: torch.Tensor, texts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
                total = images.new_tensor(float(images.shape[0]))
                dist.all_reduce(total)
                return rows_criterion(images, texts, scale).sum() * (world_size / total)

            return recompute
        criterion = DistributedInfoNCE(chunk_size=chunk, same_id="positive" if "_positive" in method else "mask")
        return lambda images, texts, scale: criterion(
            images, texts, scale, negatives=_hard_negatives(method, texts), **_ids(method, rank, texts)
        )
    if method.startswith("ntxent"):
        chunk = int(method.split("chunk")[1]) if "chunk" in method else None
        communication = "ring" if "_ring" in method else "gather"
        if method.endswith("_none"):  # per-sample losses, summed and scaled like the mean: the same loss
            rows = NTXentLoss(communication=communication, reduction="none")

            def ntxent_rows(images: torch.Tensor, texts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
                total = images.new_tensor(float(images.shape[0]))
                dist.all_reduce(total)
                return rows(images, texts).sum() * (world_size / total)

            return ntxent_rows
        ntxent = NTXentLoss(chunk_size=chunk, communication=communication)
        return lambda images, texts, scale: ntxent(images, texts)
    if method.startswith("open_clip"):
        try:
            from open_clip.loss import ClipLoss
        except ImportError:
            return None
        local = method == "open_clip_local"
        clip_loss = ClipLoss(local_loss=local, gather_with_grad=local, rank=rank, world_size=world_size)
        return lambda images, texts, scale: clip_loss(images, texts, scale)
    if method == "lightly_ntxent":
        try:
            from lightly.loss import NTXentLoss as LightlyNTXent
        except ImportError:
            return None
        lightly_loss = LightlyNTXent(temperature=0.5, gather_distributed=True)
        return lambda images, texts, scale: lightly_loss(images, texts)
    if method == "gemm_floor":
        return _gemm_floor
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


_OVERLAPPING_SHIFT = _ring.Ring.shift


def _ids(method: str, rank: int, texts: torch.Tensor) -> dict[str, torch.Tensor]:
    """For the ``_ids`` methods: sample ids with duplicates, one id per 4 rows, shared across ranks too."""
    if "_ids" not in method:
        return {}
    return {"ids": (torch.arange(texts.shape[0]) + rank * 2) // 4}


def _hard_negatives(method: str, texts: torch.Tensor) -> torch.Tensor | None:
    """One own negative per row, with gradient, for the ``_negatives`` methods (None for the others)."""
    return torch.roll(texts, 1, 0) if "_negatives" in method else None


def _shift_then_wait(
    ring: _ring.Ring, outgoing: Sequence[torch.Tensor], incoming: Sequence[torch.Tensor], *, step: str = "ring step"
) -> Any:
    """The ring transport without overlap: the transfer is over before the current block is used."""
    pending = _OVERLAPPING_SHIFT(ring, outgoing, incoming, step=step)
    pending.wait()
    return pending


def _gemm_floor(images: torch.Tensor, texts: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The products of a symmetric local-rows loss: logits both ways, then dq and dk both ways."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    with torch.no_grad():
        all_images, all_texts = images.repeat(world_size, 1), texts.repeat(world_size, 1)
        total = images.new_zeros(())
        for queries, keys in ((images, all_texts), (texts, all_images)):
            logits = queries @ keys.T
            total += (logits @ keys).sum() + (logits.T @ queries).sum()
            del logits
    return total.requires_grad_()


def _worker(rank: int, world_size: int, methods: Sequence[str], sizes: Sequence[int], dim: int, repeats: int) -> dict:
    # The baselines gather with torch.distributed.nn, deprecated in this torch: not our message to print.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.nn\.functional.*deprecated")
    torch.manual_seed(rank)
    count = sizes[rank]
    base_images = F.normalize(torch.randn(count, dim), dim=-1)
    base_texts = F.normalize(torch.randn(count, dim), dim=-1)
    built = {method: _build(method, rank, world_size, dim) for method in methods}
    times: dict[str, list[float]] = {m: [] for m, fn in built.items() if fn is not None}
    peaks: dict[str, list[float]] = {m: [] for m in times}
    for repeat in range(repeats + 1):  # the first round warms up and is dropped
        for method in times:
            images, texts = base_images.clone().requires_grad_(), base_texts.clone().requires_grad_()
            scale = torch.tensor(1 / 0.07, requires_grad=True)
            dist.barrier()
            with _PeakSampler() as sampler:
                start = time.perf_counter()
                built[method](images, texts, scale).backward()  # type: ignore[misc]
                elapsed = time.perf_counter() - start
            del images, texts, scale
            if repeat:
                times[method].append(elapsed)
                peaks[method].append(sampler.extra_mib)
    return {"times": times, "peaks": peaks, "missing": [m for m, fn in built.items() if fn is None]}


def measure_many(
    methods: Sequence[str], world_size: int, sizes: Sequence[int], *, dim: int = 512, repeats: int = 3
) -> dict[str, dict[str, Any]]:
    """Interleaved measurement of several methods in one set of processes.

    Returns ``{method: {"time_s", "peak_mib", "times_s", "missing"}}``: median over repeats of the
    slowest rank's time and of the largest rank's peak extra RSS.
    """
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    runnable = [m for m in methods if not (m in EQUAL_SIZES_ONLY and len(set(sizes)) > 1)]
    per_rank = run_distributed(_worker, world_size, runnable, list(sizes), dim, repeats, timeout=3600)
    results: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method not in runnable or method in per_rank[0]["missing"]:
            reason = "needs equal sizes" if method not in runnable else "package missing"
            results[method] = {"time_s": float("nan"), "peak_mib": float("nan"), "missing": reason}
            continue
        slowest = [max(rank["times"][method][i] for rank in per_rank) for i in range(repeats)]
        largest = [max(rank["peaks"][method][i] for rank in per_rank) for i in range(repeats)]
        results[method] = {
            "time_s": statistics.median(slowest),
            "peak_mib": statistics.median(largest),
            "times_s": slowest,
            "missing": None,
        }
    return results


def measure(method: str, world_size: int, n_per_rank: int, *, dim: int = 512, repeats: int = 3) -> dict[str, Any]:
    """One method at equal per-rank sizes: ``{"time_s", "peak_mib", ...}`` (see :func:`measure_many`)."""
    return measure_many([method], world_size, [n_per_rank] * world_size, dim=dim, repeats=repeats)[method]


def table(results: dict[str, dict[str, Any]], reference: str) -> str:
    ref = results.get(reference, {})
    lines = [
        f"| method | time (s) | × {reference} time | peak extra RSS (MiB) | × {reference} memory |",
        "|---|---:|---:|---:|---:|",
    ]
    for method, row in results.items():
        if row["missing"]:
            lines.append(f"| {method} | {row['missing']} | | | |")
            continue
        time_ratio = row["time_s"] / ref["time_s"] if ref.get("time_s") == ref.get("time_s") and ref else float("nan")
        mem_ratio = row["peak_mib"] / ref["peak_mib"] if ref and ref.get("peak_mib") else float("nan")
        lines.append(f"| {method} | {row['time_s']:.3f} | {time_ratio:.2f} | {row['peak_mib']:.0f} | {mem_ratio:.3f} |")
    return "\n".join(lines)


def ranks_table(by_world: dict[int, dict[str, dict[str, Any]]], reference: str) -> str:
    """Peak memory and time of each method against the number of ranks (fixed rows per rank)."""
    worlds = sorted(by_world)
    first, last = worlds[0], worlds[-1]
    header = " | ".join(f"W={w} MiB" for w in worlds)
    times = " | ".join(f"W={w} time (s)" for w in worlds)
    lines = [
        f"| method | {header} | W={last} / W={first} memory | × {reference} memory at W={last} | {times} "
        f"| × {reference} time at W={last} |",
        "|---|" + "---:|" * (2 * len(worlds) + 3),
    ]
    for method in by_world[first]:
        rows = [by_world[w][method] for w in worlds]
        if any(row["missing"] for row in rows):
            lines.append(f"| {method} | {rows[0]['missing'] or rows[-1]['missing']} |" + " |" * (2 * len(worlds) + 2))
            continue
        ref = by_world[last][reference]
        memory = " | ".join(f"{row['peak_mib']:.1f}" for row in rows)
        time_s = " | ".join(f"{row['time_s']:.3f}" for row in rows)
        growth = rows[-1]["peak_mib"] / rows[0]["peak_mib"]
        lines.append(
            f"| {method} | {memory} | {growth:.2f} | {rows[-1]['peak_mib'] / ref['peak_mib']:.2f} | {time_s} "
            f"| {rows[-1]['time_s'] / ref['time_s']:.2f} |"
        )
    return "\n".join(lines)


def plot_by_ranks(path: str, by_world: dict[int, dict[str, dict[str, Any]]], n: int, dim: int, repeats: int) -> None:
    """Per-rank peak memory and time of every method against W, from the equal-size runs just measured."""
    from plots import save_panels

    worlds = sorted(by_world)
    methods = [method for method in by_world[worlds[0]] if not by_world[worlds[0]][method]["missing"]]

    def series(key: str) -> dict[str, list[tuple[float, float]]]:
        return {method: [(w, by_world[w][method][key]) for w in worlds] for method in methods}

    save_panels(path, x_label="ranks W (gloo processes)", x_ticks=worlds,
                panels=[("peak extra RSS per rank (MiB)", series("peak_mib")),
                        ("time, slowest rank (s)", series("time_s"))],
                title=f"CLIP loss forward + backward, n = {n} rows per rank, D = {dim}, fp32, median of {repeats}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n=512 per rank, 3 repeats")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--n", type=int, default=4096, help="rows per rank")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-uneven", action="store_true", help="skip the uneven-sizes run")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--by-ranks",
        metavar="REFERENCE",
        help="after the per-W tables, one table of memory and time against W, ratios to REFERENCE (a method)",
    )
    parser.add_argument("--plot", metavar="PATH", help="also draw peak memory and time against W (.svg, .png)")
    args = parser.parse_args(argv)
    if args.plot and len(args.world_sizes) < 2:
        parser.error("--plot draws against the number of ranks: give at least two --world-sizes")
    n = 512 if args.quick else args.n
    for package, hint in (("open_clip", "pip install open-clip-torch"), ("lightly", "pip install --no-deps lightly")):
        try:
            __import__(package)
        except ImportError:
            print(f"NOTE: {package} is not installed ({hint}); its rows say 'package missing'.", file=sys.stderr)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads here, D={args.dim}")
    runs = [(world_size, [n] * world_size) for world_size in args.world_sizes]
    if not args.no_uneven:
        uneven = [2048, 1792, 1536, 1280] if not args.quick else [256, 224, 192, 160]
        runs.append((4, uneven))
    by_world: dict[int, dict[str, dict[str, Any]]] = {}
    for world_size, sizes in runs:
        results = measure_many(args.methods, world_size, sizes, dim=args.dim, repeats=args.repeats)
        if len(set(sizes)) == 1:
            by_world[world_size] = results
        local = results.get("open_clip_local")
        reference = "open_clip_local" if local and not local["missing"] else args.methods[0]
        print(f"\n### W={world_size}, sizes={sizes}, D={args.dim}, fp32, median of {args.repeats}\n")
        print(table(results, reference))
        sys.stdout.flush()
    if args.by_ranks:
        print(f"\n### Memory and time against the number of ranks: n={n} per rank, D={args.dim}, fp32\n")
        print(ranks_table(by_world, args.by_ranks))
    if args.plot:
        plot_by_ranks(args.plot, by_world, n, args.dim, args.repeats)


if __name__ == "__main__":
    main()
