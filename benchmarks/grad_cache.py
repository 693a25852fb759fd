"""Peak memory and time of one training step of the CLIP recipe's image tower: plain vs ``grad_cache``.

Run (one process; CPU unless ``--device cuda``)::

    python benchmarks/grad_cache.py                           # batches 256, 1024, 4096; mini-batches of 128
    python benchmarks/grad_cache.py --batches 256 --repeats 1  # quick check
    python benchmarks/grad_cache.py --budget-mib 2048          # largest batch whose step fits in 2 GiB
    python benchmarks/grad_cache.py --threads 1 --plot docs/assets/benchmarks/grad_cache.svg  # + the figure

The tower is the recipes' own code (``contrastive_dist.lightning.towers``: ``resnet-small``, width 16, 32×32
images, a 64-d projection), not a copy. One step: encode the batch (plain: ``tower(images)``;
cached: ``grad_cache(tower, images, mini_batch_size=M)``), InfoNCE against fixed text embeddings
with a learnable ``logit_scale`` and ``chunk_size=512`` (its logits are then O(512·n), not n²), ``backward``,
an SGD step, ``zero_grad``.

Memory is the peak of the tensor memory allocated during the step above what exists before it
(the model and the batch): on CPU the largest running sum of the profiler's allocation records
(``profile_memory=True``: every allocation and free, in order, not sampled); on CUDA
``max_memory_allocated`` above ``memory_allocated``. Time is the median over ``--repeats`` steps
without the profiler, plain and cached interleaved in alternating order, so that load from other
processes hits both alike; the CPU time of this process (all its threads) is shown beside the
wall-clock ratio, as it moves less with that load. ``--budget-mib`` doubles the batch from 256 for
each method while the measured peak of its step plus the batch itself (images and text embeddings)
stays within the budget.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from contrastive_dist import grad_cache, info_nce
from contrastive_dist.lightning.towers import small_image_resnet  # the recipes' image tower itself

METHODS = ("plain", "grad_cache")


def image_tower(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    backbone, features = small_image_resnet("resnet-small", width=16)
    return nn.Sequential(backbone, nn.Linear(features, 64, bias=False)).to(device)


def make_step(method: str, batch: int, mini_batch_size: int, device: torch.device,
              loss_chunk_size: int) -> Callable[[], None]:
    """One training step of ``method`` on a fixed batch of ``batch`` images."""
    tower = image_tower(device)
    logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07), device=device))
    optimizer = torch.optim.SGD([*tower.parameters(), logit_scale], lr=0.01)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, 32, 32, generator=generator).to(device)
    texts = F.normalize(torch.randn(batch, 64, generator=generator), dim=-1).to(device)

    def step() -> None:
        encoded = tower(images) if method == "plain" else grad_cache(tower, images, mini_batch_size=mini_batch_size)
        info_nce(F.normalize(encoded, dim=-1), texts, logit_scale.exp(), chunk_size=loss_chunk_size).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # here, not first: every measured step starts without gradients

    step()  # warm-up
    step.batch_mib = (images.nbytes + texts.nbytes) / 2**20  # type: ignore[attr-defined]
    return step


def peak_mib(step: Callable[[], None], device: torch.device) -> float:
    """Peak tensor memory allocated during ``step()`` above what was allocated before it, in MiB."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step()
    records = [event for event in recorded.profiler.kineto_results.events()  # type: ignore[union-attr]
               if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU]
    running = peak = 0
    for event in sorted(records, key=lambda event: event.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak / 2**20


def seconds(step: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of ``step()``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(batch: int, mini_batch_size: int, repeats: int, device: torch.device,
            loss_chunk_size: int) -> dict[str, dict[str, float]]:
    steps = {method: make_step(method, batch, mini_batch_size, device, loss_chunk_size) for method in METHODS}
    peaks = {method: peak_mib(step, device) for method, step in steps.items()}
    times: dict[str, list[tuple[float, float]]] = {method: [] for method in METHODS}
    for repeat in range(repeats):
        for method in METHODS if repeat % 2 == 0 else METHODS[::-1]:
            times[method].append(seconds(steps[method], device))
    return {method: {"time_s": statistics.median(wall for wall, _ in times[method]),
                     "cpu_s": statistics.median(cpu for _, cpu in times[method]), "peak_mib": peaks[method]}
            for method in METHODS}


def table(results: dict[int, dict[str, dict[str, float]]], mini_batch_size: int) -> str:
    lines = [f"| per-rank batch | plain: peak (MiB) | grad_cache (M={mini_batch_size}): peak (MiB) | × plain peak "
             "| plain: time (s) | grad_cache: time (s) | × plain time | × plain CPU time |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, row in results.items():
        plain, cached = row["plain"], row["grad_cache"]
        lines.append(f"| {batch} | {plain['peak_mib']:.0f} | {cached['peak_mib']:.0f} | "
                     f"{cached['peak_mib'] / plain['peak_mib']:.3f} | {plain['time_s']:.2f} | {cached['time_s']:.2f} | "
                     f"{cached['time_s'] / plain['time_s']:.2f} | {cached['cpu_s'] / plain['cpu_s']:.2f} |")
    return "\n".join(lines)


def largest_in_budget(budget_mib: float, mini_batch_size: int, device: torch.device, limit: int,
                      loss_chunk_size: int) -> dict[str, str]:
    """For each method, the largest power-of-two batch (from 256) whose step and batch fit in the budget."""
    found: dict[str, str] = {}
    for method in METHODS:
        batch, fits = 256, 0
        while batch <= limit:
            step = make_step(method, batch, mini_batch_size, device, loss_chunk_size)
            peak, held = peak_mib(step, device), step.batch_mib  # type: ignore[attr-defined]
            print(f"  {method} batch {batch}: step peak {peak:.0f} MiB + the batch {held:.0f} MiB", flush=True)
            del step
            if peak + held > budget_mib:
                break
            fits, batch = batch, batch * 2
        found[method] = f"≥ {fits} (stopped at --budget-limit)" if batch > limit else str(fits)
    return found


def plot(path: str, results: dict[int, dict[str, dict[str, float]]], mini_batch_size: int, repeats: int,
         device: torch.device) -> None:
    """Peak memory and time of both methods against the per-rank batch, from the rows just measured."""
    from plots import save_panels

    batches = sorted(results)
    names = {"plain": "plain", "grad_cache": f"grad_cache (mini_batch_size={mini_batch_size})"}

    def series(key: str) -> dict[str, list[tuple[float, float]]]:
        return {names[method]: [(batch, results[batch][method][key]) for batch in batches] for method in METHODS}

    save_panels(path, x_label="per-rank batch", x_ticks=batches,
                panels=[("peak memory of the step (MiB)", series("peak_mib")),
                        ("time of the step (s)", series("time_s")),
                        ("CPU time of the step (s)", series("cpu_s"))],  # moves less with other load
                title=f"A training step of the CLIP recipe's image tower, {device.type}, "
                      f"{torch.get_num_threads()} thread(s), median of {repeats}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096], help="per-rank batch sizes")
    parser.add_argument("--mini-batch-size", type=int, default=128, help="grad_cache's mini_batch_size")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per method (median)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--loss-chunk-size", type=int, default=512,
                        help="the loss's chunk_size (rows of logits at a time), as for a large batch")
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="find the largest batch whose step peak plus the batch itself fit in this many MiB")
    parser.add_argument("--budget-limit", type=int, default=65536, help="largest batch tried with --budget-mib")
    parser.add_argument("--plot", metavar="PATH", help="also draw peak memory and time against the batch (.svg, .png)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads", flush=True)
    if args.budget_mib is not None:
        found = largest_in_budget(args.budget_mib, args.mini_batch_size, device, args.budget_limit,
                                  args.loss_chunk_size)
        print(f"largest per-rank batch whose step and batch fit in {args.budget_mib:.0f} MiB: plain {found['plain']}, "
              f"grad_cache (M={args.mini_batch_size}) {found['grad_cache']}")
        return
    results = {}
    for batch in args.batches:
        results[batch] = measure(batch, args.mini_batch_size, args.repeats, device, args.loss_chunk_size)
        print(f"batch {batch}: {results[batch]}", flush=True)
    print(table(results, args.mini_batch_size))
    if args.plot:
        plot(args.plot, results, args.mini_batch_size, args.repeats, device)


if __name__ == "__main__":
    main()
