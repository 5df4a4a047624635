"""The pictures of a comparison: validation accuracy against wall time and against samples.

Owns: ``accuracy_vs_time.png`` and ``accuracy_vs_samples.png``, drawn with matplotlib's
non-interactive Agg backend (works on a headless machine). Both have the same layout, made to
stay readable for a 27-run grid:

* one panel per (worker count n, algorithm): rows are n, columns the algorithms (AGN's rules
  are separate columns); a grid of sync only has one column;
* inside a panel, one line per λ, coloured by λ with the same colour for the same λ in every
  panel; sync with the same n is the dashed grey reference line in each of that row's panels;
* repeats of a cell share its colour (thinner); a run that did not finish ends with an ``x``;
* one small legend (the λ colours and the sync line) for the whole figure; a setting that
  follows n (EASGD's moving rate) is written in the corner of its panels;
* the accuracy axis is zoomed to the informative range: from just below the lowest accuracy
  any run had in the second half of its history (so collapses stay visible, the first
  evaluations at chance level do not flatten everything else) up to 100 %.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from distoptim.cli import algorithms
from distoptim.cli.record import RunRecord

__all__ = ["SAMPLES_PNG", "accuracy_range", "plot_accuracy"]

SAMPLES_PNG = "accuracy_vs_samples.png"
_SYNC_STYLE = {"color": "0.35", "linestyle": "--", "linewidth": 1.4}


def accuracy_range(records: Sequence[RunRecord]) -> tuple[float, float]:
    """The accuracy axis in percent: (low, 100) with ``low`` a multiple of 5 (module doc)."""
    lows = []
    for r in records:
        accs = [100 * p["val_acc"] for p in r.history if p["val_acc"] is not None]
        if len(accs) >= 2:
            lows.append(min(accs[len(accs) // 2 :]))
    if not lows:
        return 0.0, 100.0
    low = max(0.0, 5 * math.floor((min(lows) - 3) / 5))
    return min(low, 90.0), 100.0


def _column(r: RunRecord) -> str:
    return algorithms.title(r.config)


def _draw(records: Sequence[RunRecord], x_key: str, x_label: str, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ns = sorted({r.config.workers for r in records})
    columns = list(dict.fromkeys(_column(r) for r in records if r.config.algo != "sync"))
    sync_only = not columns
    if sync_only:
        columns = ["sync"]
    lams = sorted(
        {r.config.communication_period for r in records if algorithms.get(r.config.algo).periodic}
    )
    cmap = plt.get_cmap("viridis")
    color = {lam: cmap(0.8 * i / max(1, len(lams) - 1)) for i, lam in enumerate(lams)}
    fig, axes = plt.subplots(
        len(ns),
        len(columns),
        figsize=(0.6 + 3.4 * len(columns), 0.9 + 2.5 * len(ns)),
        sharey=True,
        sharex="row",
        squeeze=False,
    )
    low, high = accuracy_range(records)

    def line(ax, r: RunRecord, **kw) -> None:
        xs = [p[x_key] for p in r.history]
        ys = [100 * p["val_acc"] for p in r.history]
        width = kw.pop("linewidth", 1.6) * (0.6 if r.config.repeat else 1.0)
        ax.plot(xs, ys, linewidth=width, alpha=0.6 if r.config.repeat else 0.95, **kw)
        if r.status != "ok" and xs:
            ax.plot(xs[-1:], ys[-1:], marker="x", markersize=7, color=kw.get("color", "k"))

    for i, n in enumerate(ns):
        syncs = [r for r in records if r.config.algo == "sync" and r.config.workers == n]
        for j, col in enumerate(columns):
            ax = axes[i][j]
            for r in syncs:
                line(ax, r, **_SYNC_STYLE)
            if not sync_only:
                cell = [
                    r
                    for r in records
                    if r.config.workers == n and r.config.algo != "sync" and _column(r) == col
                ]
                for r in cell:
                    line(ax, r, color=color.get(r.config.communication_period, "C3"))
                details = {algorithms.get(r.config.algo).detail(r.config) for r in cell} - {""}
                if len(details) == 1:  # e.g. EASGD's alpha, which follows n
                    ax.text(
                        0.98,
                        0.04,
                        details.pop(),
                        transform=ax.transAxes,
                        ha="right",
                        fontsize=8,
                        color="0.3",
                    )
            ax.set_ylim(low, high)
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=8)
            if i == 0:
                ax.set_title(col, fontsize=10)
            if j == 0:
                ax.set_ylabel(f"n = {n}\nval acc (%)", fontsize=9)
            if i == len(ns) - 1:
                ax.set_xlabel(x_label, fontsize=9)
        # the row shares its x axis: from 0 to the longest run of that n, whatever its panel
        right = max(
            (p[x_key] for r in records if r.config.workers == n for p in r.history), default=0
        )
        axes[i][0].set_xlim(0, max(right, 1e-9) * 1.02)
        axes[i][0].xaxis.set_major_locator(MaxNLocator(6))
        if x_key == "samples" and right >= 10_000:  # 20k, not 20000: labels must not touch
            axes[i][0].xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k"))
    handles = [Line2D([], [], color=color[lam], linewidth=2, label=f"λ = {lam}") for lam in lams]
    if any(r.config.algo == "sync" for r in records):
        handles.append(Line2D([], [], label="sync, same n", **_SYNC_STYLE))
    height = fig.get_figheight()
    fig.suptitle(title, fontsize=11, y=1 - 0.12 / height, va="top")
    top = 1 - 0.42 / height  # below the title
    if handles:
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, top),
            ncol=len(handles),
            fontsize=8,
            frameon=False,
        )
        top -= 0.28 / height
    fig.tight_layout(rect=(0, 0, 1, top), pad=0.4, h_pad=0.6, w_pad=0.4)
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


def plot_accuracy(
    records: Sequence[RunRecord], path: str | os.PathLike[str], title: str
) -> str | None:
    """Draw the records that have a history into ``path`` (against wall time) and, next to it,
    :data:`SAMPLES_PNG` (against samples processed); returns ``path``, or None if none has."""
    drawn = [r for r in records if len(r.history) >= 1]
    if not drawn:
        return None
    path = os.fspath(path)
    _draw(drawn, "t", "wall time since all workers were ready (s)", path, title)
    samples = os.path.join(os.path.dirname(path), SAMPLES_PNG)
    _draw(drawn, "samples", "samples processed, all workers", samples, title)
    return path
