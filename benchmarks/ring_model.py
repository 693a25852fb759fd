"""A model of one step of SigLIP's ring over several GPUs, beside siglip-kernel's published figures.

A model, not a measurement. Run it from the repository root; it is pure Python and finishes at once::

    python benchmarks/ring_model.py                                       # placeholder block time
    python benchmarks/ring_model.py --csv gpu_day_out/gpu_check_1gpu.csv   # this GPU's block times
    python benchmarks/ring_model.py --csv gpu_day_out/gpu_check_1gpu.csv --method "siglip: ours ring" \\
        --backward-share 0.6

The step: a global batch B (65,536) of bf16 features with D = 768, over W ranks. Rank r holds n_r rows:
equal shares, or one rank with a quarter more, or one rank empty. At step s = 0 … W−1, rank r computes
the block of its images against the texts of rank (r − s) mod W. It then passes the text block it holds
on to rank r + 1 (except after the last step). In backward the text gradients travel the same W − 1 hops
back to their owners. What goes in:

* A block's time, from one GPU. A one-GPU step at global batch b is one b × b block, forward and
  backward, so a block of n × m rows costs t1(b) · n·m / b², at the measured b nearest to √(n·m).
  With ``--csv``, t1 comes from a gpu_check CSV: the fastest bf16 speed row of ``--method`` at each
  batch, siglip-kernel's default entry unless told otherwise. Without it, a placeholder is used and
  labelled as an assumption: t1(65,536) = 46.9 ms, siglip-kernel's README figure for one GH200.
* A hop. It carries the largest text block, max n_r · D · 2 bytes, over the slowest link of the ring,
  plus a latency. Within a node that link is NVLink (``--nvlink-gbs``, about 450 GB/s a direction
  usable on H200). When the ring spans nodes it is the inter-node link (``--inter-node-gbs``, 25 GB/s: a
  200 Gb/s NIC per GPU). In backward a hop carries the key-gradient block, the same number of bf16 bytes.
* Synchronisation. Each rank waits at every hop for its neighbour's block, so step s costs the
  slowest rank's block, max_r t(n_r, n_{(r−s) mod W}). Uneven or empty ranks cost what their largest
  blocks cost.
* Overlap. Without it, a step is the sum of its blocks plus 2 (W − 1) hops. With it, each hop hides
  behind the block computed meanwhile: Σ_{s<W−1} max(block_s, hop) + block_{W−1}. That holds in
  forward, and in backward for the share of a block's time spent there (``--backward-share``).
  siglip-kernel computes its gradients in the forward, so its share is 0 and its gradient hops
  stay exposed.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gpu_check_summary import rows_from_csv

PUBLISHED_SOURCE = ("siglip-kernel 0.1.2 README, DistributedSigLIPLoss step (forward + backward), global B 65,536, "
                    "D 768, bf16, GH200")
PUBLISHED_MS = {("1 GPU", "even"): 46.9, ("4 GPUs, 1 node", "even"): 13.1, ("8 GPUs, 2 nodes", "even"): 10.1}
PLACEHOLDER = {65536: 46.9}  # assumption: siglip-kernel's one-GH200 step, when no CSV is given
SETTINGS = (("1 GPU", 1, 1), ("4 GPUs, 1 node", 4, 1), ("8 GPUs, 1 node", 8, 1), ("8 GPUs, 2 nodes", 8, 2))
PATTERNS = ("even", "one rank +25%", "one rank empty")


@dataclass(frozen=True)
class BlockTimes:
    """One GPU's step time (ms) at measured global batches; a block costs its share of logits of the nearest."""

    ms_by_batch: dict[int, float]
    source: str

    def block_ms(self, rows: int, columns: int) -> float:
        """The time of one ``rows`` × ``columns`` block, forward and backward."""
        if rows == 0 or columns == 0:
            return 0.0
        side = math.sqrt(rows * columns)
        batch = min(self.ms_by_batch, key=lambda measured: abs(math.log(measured / side)))
        return self.ms_by_batch[batch] * rows * columns / batch**2


@dataclass(frozen=True)
class Links:
    """The links a hop may cross, GB/s in one direction (10^9 bytes), and each hop's latency."""

    nvlink_gbs: float = 450.0
    inter_node_gbs: float = 25.0
    latency_us: float = 10.0

    def hop_ms(self, nbytes: int, nodes: int) -> float:
        """One hop of ``nbytes`` on every rank at once: the slowest link of the ring sets it."""
        bandwidth = self.nvlink_gbs if nodes == 1 else min(self.nvlink_gbs, self.inter_node_gbs)
        return nbytes / (bandwidth * 1e9) * 1e3 + self.latency_us / 1e3


@dataclass(frozen=True)
class Prediction:
    """One ring step: its blocks, its hops, and the step without and with overlap (ms)."""

    hop_bytes: int
    blocks_ms: float
    hops_ms: float
    serial_ms: float
    overlapped_ms: float


def shards(batch: int, world_size: int, pattern: str) -> list[int]:
    """Rows per rank: ``even``; ``one rank +25%`` (rank 0 a quarter more, the others the rest);
    ``one rank empty`` (the last rank none)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, got {pattern!r}")
    if world_size == 1:
        return [batch]
    first = round(1.25 * batch / world_size) if pattern == "one rank +25%" else None
    holders = world_size - 1 if pattern == "one rank empty" else world_size
    rest, start = (batch - first, 1) if first is not None else (batch, 0)
    share, extra = divmod(rest, holders - start)
    sizes = [share + (rank < extra) for rank in range(holders - start)]
    sizes = ([first] if first is not None else []) + sizes
    return sizes + [0] * (world_size - len(sizes))


def _hidden(blocks: Sequence[float], hop: float) -> float:
    """Blocks with the hop of each but the last hidden behind it."""
    return sum(max(block, hop) for block in blocks[:-1]) + blocks[-1]


def predict(rows: Sequence[int], *, dim: int, nodes: int, blocks: BlockTimes, links: Links,
            backward_share: float = 0.0, element_bytes: int = 2) -> Prediction:
    """One step of the ring over ranks holding ``rows`` rows each, on ``nodes`` nodes."""
    if not 0.0 <= backward_share <= 1.0:
        raise ValueError(f"backward_share must be in [0, 1], got {backward_share}")
    world_size = len(rows)
    steps = [max(blocks.block_ms(rows[rank], rows[(rank - step) % world_size]) for rank in range(world_size))
             for step in range(world_size)]
    hop_bytes = max(rows) * dim * element_bytes if world_size > 1 else 0
    hop = links.hop_ms(hop_bytes, nodes) if world_size > 1 else 0.0
    forward = [(1 - backward_share) * step for step in steps]
    backward = [backward_share * step for step in steps]
    hops = 2 * (world_size - 1) * hop
    return Prediction(hop_bytes, sum(steps), hops, sum(steps) + hops,
                      _hidden(forward, hop) + _hidden(backward, hop))


def block_times_from_csv(path: str, method: str) -> BlockTimes:
    """The fastest bf16 speed row of ``method`` (a ``check`` of the CSV) at each batch of a gpu_check CSV."""
    found: dict[int, float] = {}
    timed = set()
    for row in rows_from_csv(path):
        if row.get("dtype") != "bfloat16" or "time_ms" not in row or "batch" not in row:
            continue
        if not str(row.get("section", "")).startswith("1 rank: speed"):
            continue
        timed.add(row["check"])
        if row["check"] == method:
            found[row["batch"]] = min(found.get(row["batch"], math.inf), row["time_ms"])
    if not found:
        raise ValueError(f"{path}: no timed bf16 speed rows of {method!r}; timed there: {sorted(timed) or 'none'}")
    return BlockTimes(found, f"{method}, bf16, from {path}")


def table(blocks: BlockTimes, links: Links, *, batch: int, dim: int, backward_share: float) -> list[str]:
    """The markdown table, one row per setting and shard pattern, and the lines that say what it rests on."""
    lines = [f"Ring model (a model, not a measurement): one SigLIP step, global B {batch:,}, D {dim}, bf16.", "",
             "| setting | shards | rows, largest rank | hop MB | blocks ms | hops ms | predicted, no overlap ms "
             "| predicted, overlap ms | published ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, world_size, nodes in SETTINGS:
        for pattern in PATTERNS[:1] if world_size == 1 else PATTERNS:
            rows = shards(batch, world_size, pattern)
            found = predict(rows, dim=dim, nodes=nodes, blocks=blocks, links=links, backward_share=backward_share)
            published = PUBLISHED_MS.get((name, pattern))
            lines.append(f"| {name} | {pattern} | {max(rows):,} | {found.hop_bytes / 1e6:.1f} | {found.blocks_ms:.1f} "
                         f"| {found.hops_ms:.2f} | {found.serial_ms:.1f} | {found.overlapped_ms:.1f} "
                         f"| {'-' if published is None else f'{published:.1f}'} |")
    measured = ", ".join(f"{ms:.1f} ms at B {size:,}" for size, ms in sorted(blocks.ms_by_batch.items()))
    lines += ["", f"Block times: {blocks.source}: {measured}; a block scales with its logits.",
              f"Links: NVLink {links.nvlink_gbs:g} GB/s, inter-node {links.inter_node_gbs:g} GB/s a direction, "
              f"{links.latency_us:g} µs a hop (parameters); backward share of a block {backward_share:g}.",
              "The 1-GPU row is the model's input, not a prediction.",
              f"Published: {PUBLISHED_SOURCE}; the 4-GPU figure over NVLink, the 8-GPU one over 2 nodes."]
    return lines


def main(argv: Sequence[str] | None = None) -> str:
    """Print the table (and return its text)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--csv", help="a gpu_check CSV whose bf16 speed rows give the block times")
    parser.add_argument("--method", default="siglip: siglip-kernel",
                        help="the CSV's check to read (default: %(default)s)")
    parser.add_argument("--one-gpu-ms", type=float, help="without --csv: the one-GPU step time (assumption: 46.9)")
    parser.add_argument("--one-gpu-batch", type=int, default=65536, help="the global batch of --one-gpu-ms")
    parser.add_argument("--batch", type=int, default=65536, help="global batch (default %(default)s)")
    parser.add_argument("--dim", type=int, default=768, help="features per row (default %(default)s)")
    parser.add_argument("--nvlink-gbs", type=float, default=Links.nvlink_gbs, help="GB/s a direction")
    parser.add_argument("--inter-node-gbs", type=float, default=Links.inter_node_gbs, help="GB/s a direction, per GPU")
    parser.add_argument("--latency-us", type=float, default=Links.latency_us, help="microseconds a hop")
    parser.add_argument("--backward-share", type=float, default=0.0,
                        help="share of a block's time in backward (0: gradients computed in the forward)")
    args = parser.parse_args(argv)
    if args.csv:
        try:
            blocks = block_times_from_csv(args.csv, args.method)
        except (OSError, ValueError) as error:
            parser.exit(2, f"ring_model: {error}\n")
    elif args.one_gpu_ms is not None:
        blocks = BlockTimes({args.one_gpu_batch: args.one_gpu_ms}, "given on the command line")
    else:
        blocks = BlockTimes(dict(PLACEHOLDER), "ASSUMPTION (no CSV given): siglip-kernel README's one-GH200 step")
    links = Links(args.nvlink_gbs, args.inter_node_gbs, args.latency_us)
    text = "\n".join(table(blocks, links, batch=args.batch, dim=args.dim, backward_share=args.backward_share))
    print(text)
    return text


if __name__ == "__main__":
    main()
