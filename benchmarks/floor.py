"""Every loss against the matrix products it cannot avoid: forward + backward as a ratio to its product floor.

Run (CPU, one thread per process, process CPU time)::

    python benchmarks/floor.py                 # n = 4096, D = 512, 5 repeats, ring at W = 4: minutes
    python benchmarks/floor.py --quick         # small sizes: every row in seconds (a smoke test)
    python benchmarks/floor.py --losses siglip info_nce --dtypes fp32 --no-ring --csv floor.csv

**The floor.** A similarity matrix of R rows against C columns needs three products whatever the
loss: the logits ``Q Kᵀ`` and the gradients ``G K`` and ``Gᵀ Q`` (InfoNCE, SigLIP: ``n × n``).
A symmetric matrix needs two: ``Z Zᵀ`` and ``(G + Gᵀ) Z`` (NT-Xent's two views and SupCon's two
views per sample: ``2n × 2n``). The floor of a row is those products alone, on random float32
operands of the row's sizes. The bf16 rows have the same float32 floor: on CPU the package upcasts
bf16 features to float32 before its products (``CONTRASTIVE_DIST_PRODUCTS=auto``), so float32
products are what a bf16 call cannot avoid there.

**Timing.** Each row runs its loss and its floor alternately in the same process (one untimed call of
each first), measures each call in process CPU time (``time.process_time``: this process's work only,
so other load on the machine moves it little) and reports the medians of ``--repeats`` calls:
``ms`` (the loss), ``floor ms`` and their ratio ``×floor``.

**Calls.** ``default`` is the call with its default arguments (``chunk_size=None``); ``chunk256`` adds
``chunk_size=256`` (``--chunk``); ``default+ids`` adds ``ids=`` (one sample in 50 shares its
neighbour's id, as repeated captions do) to InfoNCE, SigLIP and NT-Xent, float32, one process: its
``target`` is its time ÷ the same call's without ids (≤ 1.10). ``default M=4N`` gives InfoNCE and SigLIP
four texts per image (``--captions``) with ``image_ids=`` / ``text_ids=``: ``n`` image rows against
``4n`` text columns, whose floor is the same three products at that size (SigLIP+'s target ≤ 1.20).
``info_nce(images, texts)`` (symmetric), ``siglip(images, texts, scale, bias)`` with a learnable scale 10 and bias −10,
``nt_xent(z1, z2)``, ``supcon(features, labels)`` with two views per sample and four samples per
label; features L2-normalised.
Peers on the same inputs and floor, one process: open_clip's ``ClipLoss()`` (constant scale 1/0.07,
like ``info_nce``'s default) and ``SigLipLoss()`` (learnable scale and bias); skipped if missing.

**Rows at W ranks** (``--world-size``, default 4): W gloo processes, one thread each, ``n / W`` samples
per rank, in both modes (``gather W=4``, ``ring W=4``). Each rank times its loss against its share of the
floor: the same products for its rows against every column (``n/W × n``; symmetric ``2n/W × 2n``). A
row shows the rank with the largest ratio. The ``target`` of a ring row is its ratio ÷ the one-process
gather ratio of the same loss, call and dtype (≤ 1.10), then ÷ the gather ratio at the same W: the
first includes what the transport costs the processor (gloo copies every message through the kernel),
which the one-process row does not pay; the second compares the two modes on the same footing.
The gather rows without a W run in one process without a process group: the plain loss.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

import contrastive_dist
from contrastive_dist.testing import WorkerPool

LOSSES = ("info_nce", "siglip", "nt_xent", "supcon")
PEERS = ("open_clip ClipLoss", "open_clip SigLipLoss")
SYMMETRIC = ("nt_xent", "supcon")
TARGETS = {"siglip": 1.10, "info_nce": 1.45, "nt_xent": 1.55, "supcon": 1.60}
"""×floor targets of the default call, float32, gather mode."""
RING_TARGET = 1.10
"""Ring mode's ×floor at most this times gather mode's."""
IDS_TARGET = 1.10
"""A call with ``ids=`` at most this times the same call without (gather mode, one process)."""
ID_LOSSES = ("info_nce", "siglip", "nt_xent")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ("loss", "mode", "call", "dtype", "ms", "floor ms", "×floor", "target")


CAPTION_LOSSES = ("info_nce", "siglip")
CAPTION_TARGETS = {"siglip": 1.20}
"""×floor targets of the default call with several texts per image (float32, gather mode, one process)."""


class Case(NamedTuple):
    loss: str
    chunk: int | None
    dtype: str
    ids: bool = False
    captions: int = 1  # texts per image: M = captions · N, positives by image_ids= / text_ids=


def _call_name(case: Case) -> str:
    name = ("default" if case.chunk is None else f"chunk{case.chunk}") + ("+ids" if case.ids else "")
    return name + (f" M={case.captions}N" if case.captions > 1 else "")


def _ids(n: int) -> Tensor:
    """Sample ids of a global batch of ``n``: one sample in 50 shares its neighbour's (repeated captions)."""
    ids = torch.arange(n)
    ids[1::50] = ids[0::50][: ids[1::50].numel()]
    return ids


def _view(seed: int, n: int, dim: int, rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` of a global batch of ``n`` L2-normalised features, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, dim, generator=generator), dim=-1)[rows].to(dtype)


def _step(case: Case, n: int, dim: int, communication: str, rank: int, world_size: int) -> Callable[[], None]:
    """One forward + backward of ``case`` on this rank's rows of a global batch of ``n`` samples."""
    rows = slice(rank * n // world_size, (rank + 1) * n // world_size)
    dtype = DTYPES[case.dtype]
    texts = slice(rows.start * case.captions, rows.stop * case.captions)
    first, second = (_view(seed, n * many, dim, part, dtype).requires_grad_()
                     for seed, many, part in ((1, 1, rows), (2, case.captions, texts)))  # fmt: skip
    leaves = [first, second]
    options: dict[str, Any] = {"chunk_size": case.chunk, "communication": communication}
    if case.ids:
        options["ids"] = _ids(n)[rows]
    if case.captions > 1:  # image i's texts: rows captions·i ... captions·i + captions − 1
        text_ids = torch.arange(n).repeat_interleave(case.captions)[texts]
        options |= {"image_ids": torch.arange(n)[rows], "text_ids": text_ids}
    scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    loss: Callable[[], torch.Tensor]
    if case.loss == "info_nce":
        loss = lambda: contrastive_dist.info_nce(first, second, **options)  # noqa: E731
    elif case.loss == "siglip":
        leaves += [scale, bias]
        loss = lambda: contrastive_dist.siglip(first, second, scale, bias, **options)  # noqa: E731
    elif case.loss == "nt_xent":
        loss = lambda: contrastive_dist.nt_xent(first, second, **options)  # noqa: E731
    elif case.loss == "supcon":
        features = torch.stack((first.detach(), second.detach()), dim=1).requires_grad_()
        labels = torch.arange(n)[rows] // 4
        leaves = [features]
        loss = lambda: contrastive_dist.supcon(features, labels, **options)  # noqa: E731
    elif case.loss == "open_clip ClipLoss":
        from open_clip.loss import ClipLoss

        clip, constant = ClipLoss(), torch.tensor(1 / 0.07)
        loss = lambda: clip(first, second, constant)  # noqa: E731
    elif case.loss == "open_clip SigLipLoss":
        from open_clip.loss import SigLipLoss

        sigmoid = SigLipLoss()
        leaves += [scale, bias]
        loss = lambda: sigmoid(first, second, scale, bias)  # noqa: E731
    else:
        raise ValueError(f"unknown loss {case.loss!r}; expected one of {LOSSES + PEERS}")

    def step() -> None:
        loss().backward()
        for leaf in leaves:
            leaf.grad = None

    return step


def _floor(case: Case, n: int, dim: int, world_size: int) -> Callable[[], None]:
    """The products this rank's rows cannot avoid, on random float32 operands of the same sizes."""
    columns = 2 * n if case.loss in SYMMETRIC else n * case.captions
    rows = (2 * n if case.loss in SYMMETRIC else n) // world_size
    generator = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(rows, dim, generator=generator), torch.randn(columns, dim, generator=generator)
    logit_grad = torch.randn(rows, columns, generator=generator)
    symmetric = case.loss in SYMMETRIC  # then logit_grad stands for this rank's rows of G + Gᵀ

    def products() -> None:
        queries @ keys.T
        logit_grad @ keys
        if not symmetric:
            logit_grad.T @ queries

    return products


def _medians(step: Callable[[], None], floor: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median process CPU seconds of ``step`` and of ``floor``, timed alternately after one call of each."""
    step()
    floor()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for function, spent in zip((step, floor), times):
            start = time.process_time()
            function()
            spent.append(time.process_time() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _rank_times(
    rank: int, world_size: int, case: Case, n: int, dim: int, repeats: int, communication: str
) -> tuple[float, float]:
    torch.set_num_threads(1)
    return _medians(_step(case, n, dim, communication, rank, world_size), _floor(case, n, dim, world_size), repeats)


def _target(
    case: Case, mode: str, ratio: float, gather_ratio: float | None, same_w_ratio: float | None = None
) -> tuple[str, float | None]:
    """The target cell of a row, and ring ÷ gather (one process) for ring rows."""
    if mode.startswith("gather W"):
        return "", None
    if mode != "gather":
        if gather_ratio is None:
            return "", None
        relative = ratio / gather_ratio
        cell = f"÷ gather {relative:.2f} (≤ {RING_TARGET:.2f}) {'✓' if relative <= RING_TARGET else '✗'}"
        if same_w_ratio is not None:
            cell += f"; ÷ gather at W {ratio / same_w_ratio:.2f}"
        return cell, relative
    if case.captions > 1:
        caption_target = CAPTION_TARGETS.get(case.loss)
        if caption_target is None:
            return "", None
        return f"≤ {caption_target:.2f} {'✓' if ratio <= caption_target else '✗'}", None
    if case.ids:  # the cost of ids: against the same call without
        if gather_ratio is None:
            return "", None
        relative = ratio / gather_ratio
        return f"÷ no ids {relative:.2f} (≤ {IDS_TARGET:.2f}) {'✓' if relative <= IDS_TARGET else '✗'}", relative
    target = TARGETS.get(case.loss)
    if target is None or case.chunk is not None or case.dtype != "fp32":
        return "", None
    return f"≤ {target:.2f} {'✓' if ratio <= target else '✗'}", None


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row: the gather (one process) rows first, then the ring rows on one pool of W processes."""
    peers = [] if args.no_peers else [peer for peer in PEERS if _peer_installed()]
    losses = [loss for loss in LOSSES if loss in args.losses] + peers
    cases = [
        Case(loss, chunk, dtype)
        for loss in losses
        for chunk in ((None, args.chunk) if loss in LOSSES else (None,))  # the peers have no chunk option
        for dtype in args.dtypes
    ]
    if not args.no_ids:  # the default call with ids, one process only
        cases += [Case(loss, None, "fp32", ids=True) for loss in ID_LOSSES if loss in losses and "fp32" in args.dtypes]
    if args.captions > 1:  # the default call with several texts per image, float32
        cases += [Case(loss, None, "fp32", captions=args.captions) for loss in CAPTION_LOSSES if loss in losses]
    gather: dict[Case, tuple[float, float]] = {}
    for case in cases:
        gather[case] = _medians(
            _step(case, args.n, args.dim, "gather", 0, 1), _floor(case, args.n, args.dim, 1), args.repeats
        )
        _progress(case, "gather", gather[case])
    at_w: dict[str, dict[Case, tuple[float, float]]] = {"gather": {}, "ring": {}}
    ring_cases = [case for case in cases if case.loss in LOSSES and not case.ids] if args.world_size > 1 else []
    if ring_cases:
        with WorkerPool(args.world_size, timeout=3600, threads_per_process=1) as pool:
            for case in ring_cases:
                for communication, results in at_w.items():
                    per_rank = pool.run(_rank_times, case, args.n, args.dim, args.repeats, communication)
                    results[case] = max(per_rank, key=lambda times: times[0] / times[1])
                    _progress(case, f"{communication} W={args.world_size}", results[case])
    rows = []
    width = f"W={args.world_size}"
    for case in cases:
        modes = (("gather", gather), (f"gather {width}", at_w["gather"]), (f"ring {width}", at_w["ring"]))
        for mode, results in modes:
            if case not in results:
                continue
            seconds, floor_seconds = results[case]
            ratio = seconds / floor_seconds
            base = gather.get(case._replace(ids=False, captions=1), gather[case])  # an ids row: the call without
            gather_ratio = base[0] / base[1]
            same_w = at_w["gather"].get(case)
            same_w_ratio = None if same_w is None else same_w[0] / same_w[1]
            target, relative = _target(case, mode, ratio, gather_ratio, same_w_ratio)
            rows.append(
                {"loss": case.loss, "mode": mode, "call": _call_name(case), "dtype": case.dtype,
                 "ms": 1e3 * seconds, "floor ms": 1e3 * floor_seconds, "×floor": ratio, "target": target,
                 "ring ÷ gather": relative}
            )  # fmt: skip
    return rows


def _progress(case: Case, mode: str, times: tuple[float, float]) -> None:
    """One line per measured row on stderr, so that a long run shows how far it is."""
    seconds, floor_seconds = times
    print(f"{case.loss} {mode} {_call_name(case)} {case.dtype}: {1e3 * seconds:.0f} ms, "
          f"×{seconds / floor_seconds:.2f} floor", file=sys.stderr, flush=True)  # fmt: skip


def _peer_installed() -> bool:
    try:
        import open_clip.loss  # noqa: F401
    except ImportError:
        print("open_clip is not installed: its rows are skipped (pip install open-clip-torch)", file=sys.stderr)
        return False
    return True


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""

    def cell(row: dict[str, Any], column: str) -> str:
        value = row[column]
        return f"{value:.0f}" if column.endswith("ms") else f"{value:.2f}" if column == "×floor" else str(value)

    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" if c in COLUMNS[:4] else "---:" for c in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(cell(row, column) for column in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=4096, help="samples in the global batch")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each loss and floor (median)")
    parser.add_argument("--chunk", type=int, default=256, help="the chunk_size of the chunked rows")
    parser.add_argument("--world-size", type=int, default=4, help="ranks of the ring rows; 1: no ring rows")
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--no-ring", action="store_true", help="gather rows only")
    parser.add_argument("--no-peers", action="store_true", help="no open_clip rows")
    parser.add_argument("--no-ids", action="store_true", help="no rows of the default call with ids=")
    parser.add_argument("--captions", type=int, default=4, help="texts per image of the rows with image_ids= and "
                        "text_ids= (M = captions · N, InfoNCE and SigLIP); 1: no such rows")
    parser.add_argument("--quick", action="store_true", help="n = 64, D = 16, 1 repeat, chunk 16: a smoke test")
    parser.add_argument("--csv", help="also write the rows to this CSV file")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.dim, args.repeats, args.chunk = 64, 16, 1, 16
    if args.no_ring:
        args.world_size = 1
    if args.n % args.world_size:
        parser.error(f"--n must be a multiple of --world-size for the ring rows, got {args.n} and {args.world_size}")
    torch.set_num_threads(1)
    rows = measure(args)
    print(
        f"n = {args.n}, D = {args.dim}, median of {args.repeats}, process CPU time, one thread per process, "
        f"torch {torch.__version__}; floors in float32 (bf16 features are upcast before the products on CPU)\n"
    )
    print(table(rows))
    if args.csv:
        with open(args.csv, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=[*COLUMNS, "ring ÷ gather"])
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
