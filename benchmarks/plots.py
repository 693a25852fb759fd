"""The figures of the benchmark scripts' ``--plot PATH`` option: one panel per measured quantity.

Each panel draws every method's values against one swept quantity (ranks, batch, dataset size) on
log axes, from the rows the script has just measured and printed: nothing is drawn by hand. The
format follows the file's suffix (``.svg``, ``.png``, ``.pdf``); an SVG carries no creation date,
so the same numbers give the same file. Needs matplotlib (``pip install -e ".[recipes]"``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

Series = Mapping[str, Sequence[tuple[float, float]]]  # method -> (x, y) points, missing ones left out


def save_panels(path: str | Path, *, x_label: str, panels: Sequence[tuple[str, Series]], title: str,
                x_ticks: Sequence[float] | None = None, x_tick_labels: Sequence[str] | None = None) -> Path:
    """Draw ``panels`` (each a y label and its series) side by side, log-log, and save the figure to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    matplotlib.rcParams.update({"svg.hashsalt": "contrastive_dist", "font.size": 12})  # stable ids in the SVG
    width = (6.2 if len(panels) <= 2 else 5.0) * len(panels)
    figure, axes = plt.subplots(1, len(panels), figsize=(width, 4.6), squeeze=False)
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # 5, 20, 0.5: read without decoding powers of ten
    for axis, (y_label, series) in zip(axes[0], panels):
        for method, points in series.items():
            finite = [(x, y) for x, y in points if math.isfinite(y) and y > 0]
            if finite:
                axis.plot(*zip(*finite), marker="o", label=method)
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        axis.yaxis.set_major_formatter(plain)
        axis.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: ""))
        axis.set_xlabel(x_label)
        axis.set_ylabel(y_label)
        axis.grid(True, which="both", alpha=0.3)
        if x_ticks is not None:
            axis.set_xticks(list(x_ticks), labels=list(x_tick_labels or [f"{tick:g}" for tick in x_ticks]))
            axis.minorticks_off()
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), frameon=False)
    figure.suptitle(title, fontsize=12)
    figure.tight_layout(rect=(0, 0.06 * math.ceil(len(labels) / 4) + 0.02, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(figure)
    print(f"figure: {path}")
    return path
