"""The end of a run: its logged rows (all invocations of a resumed run), a loss curve, a one-screen summary.

The loss curve is a mean per interval of steps weighted by each step's global batch, so the short
last batch of an epoch (a few rows, a loss near 0 or far above) counts for its rows and does not
read as an event.

Example:
    >>> rows = [{"step": 0.0, "train/loss": 2.0, "train/samples": 8.0},
    ...         {"step": 1.0, "train/loss": 1.0, "train/samples": 8.0},
    ...         {"step": 2.0, "train/loss": 0.0, "train/samples": 1.0}]   # the short last batch
    >>> loss_curve(rows, interval=3)
    [(3.0, 1.411764705882353)]
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["loss_curve", "metrics_files", "plot_curves", "print_summary", "read_metrics", "report_run"]


def metrics_files(run: Path) -> list[Path]:
    """A run's ``logs/version_*/metrics.csv``, one per invocation, oldest first."""
    return sorted(Path(run).glob("logs/version_*/metrics.csv"), key=lambda path: int(path.parent.name[8:]))


def read_metrics(run: Path) -> list[dict[str, float]]:
    """Every logged row of a run: all ``logs/version_*`` (one per invocation), resumed steps replaced."""
    rows: list[dict[str, float]] = []
    for path in metrics_files(run):
        with open(path) as file:
            new = [{key: float(value) for key, value in row.items() if value != ""} for row in csv.DictReader(file)]
        if new:  # a resumed invocation starts at its checkpoint's step: it replaces what came after it
            rows = [row for row in rows if row["step"] < new[0]["step"]] + new
    return rows


def loss_curve(rows: Sequence[dict[str, float]], *, interval: int, key: str = "train/loss",
               weight: str = "train/samples") -> list[tuple[float, float]]:
    """``(steps done, mean)`` per ``interval`` steps: the mean of ``key`` weighted by ``weight`` (rows of the step).

    A row without ``weight`` counts 1. The point sits at the interval's last step (1-based: steps done).
    """
    sums: dict[int, list[float]] = {}
    for row in rows:
        if key in row:
            total = sums.setdefault(int(row["step"]) // interval, [0.0, 0.0, 0.0])
            samples = row.get(weight, 1.0)
            total[0] += row[key] * samples
            total[1] += samples
            total[2] = max(total[2], row["step"] + 1)
    return [(last, value / count) for _, (value, count, last) in sorted(sums.items()) if count > 0]


def plot_curves(rows: list[dict[str, float]], keys: Sequence[str], path: Path, title: str, *,
                interval: int = 10) -> None:
    """Training loss (:func:`loss_curve`) and held-out metrics ``keys`` against the step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(11, 4))
    # Lightning logs the 0-based index of the step; the axes count optimizer steps done.
    loss = loss_curve(rows, interval=interval)
    if loss:
        loss_axis.plot(*zip(*loss), marker="." if len(loss) < 30 else None,
                       label=f"train loss, mean per {interval} steps weighted by rows")
        loss_axis.legend()
    loss_axis.set(xlabel="step", ylabel="loss", title="training loss (global, = single-process loss)")
    for key in keys:
        points = [(row["step"] + 1, row[key]) for row in rows if key in row]
        if points:
            metric_axis.plot(*zip(*points), marker="o", label=key)
            metric_axis.legend()
    metric_axis.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.02), title="held-out")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_summary(title: str, rows: list[dict[str, float]], chance: dict[str, float], *, trainer: Any,
                  seconds: float, files: dict[str, Path]) -> None:
    """One screen: the last held-out value of each metric against chance, the run's length, the files.

    ``trainer`` has a :class:`~contrastive_dist.lightning.training.MidEpochCheckpoint` callback, whose
    layouts say whether a resumed run changed its number of processes, batch size or workers.
    """
    from contrastive_dist.lightning.training import MidEpochCheckpoint

    (end_of_run,) = [callback for callback in trainer.callbacks if isinstance(callback, MidEpochCheckpoint)]
    first, last = end_of_run.start_step, end_of_run.saved_at
    steps = f"{last} steps" if first == 0 else f"steps {first + 1}-{last} (resumed; the run has {last} steps)"
    saved, now = end_of_run.saved_layout, end_of_run.layout(trainer)
    if first and saved is not None and saved != now:
        same = saved["processes"] * saved["batch_size"] == now["processes"] * now["batch_size"]
        steps += (f", resumed on {now['processes']} process(es) × {now['batch_size']} with {now['num_workers']} "
                  f"worker(s) from {saved['processes']} × {saved['batch_size']} with {saved['num_workers']} "
                  f"({'the same' if same else 'another'} global batch)")
    lines = [f"== {title}: done in {seconds:.0f} s on {now['processes']} process(es), {steps} =="]
    for key, reference in chance.items():
        values = [row[key] for row in rows if key in row]
        if not values:
            lines.append(f"  {key:<28} not measured")
            continue
        lines.append(f"  {key:<28} {values[-1]:.3f}   (chance {reference:.3f}, x{values[-1] / reference:.1f})")
    lines += [f"  {name:<28} {path}" for name, path in files.items()]
    print("\n".join(lines), flush=True)


def report_run(run: Path, trainer: Any, chance: dict[str, float], *, title: str, plot_title: str | None,
               seconds: float, files: dict[str, Path] | None = None) -> None:
    """Plot a finished run's curves to ``run/curves.png`` (unless ``plot_title`` is ``None``) and print its summary.

    The summary (:func:`print_summary`) lists the run's folder, its ``metrics.csv``, the curves and
    then ``files`` (other plots the caller wrote). ``trainer`` logs with a ``CSVLogger`` in ``run/logs``
    (:func:`read_metrics` reads every invocation of a resumed run; the newest is this one's).
    """
    listed = {"run": run, "metrics": (metrics_files(run) or [run / "logs"])[-1]}
    rows = read_metrics(run)
    if plot_title is not None:
        listed["curves"] = run / "curves.png"
        plot_curves(rows, list(chance), listed["curves"], plot_title)
    print_summary(title, rows, chance, trainer=trainer, seconds=seconds, files={**listed, **(files or {})})
