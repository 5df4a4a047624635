"""The pictures of a comparison, drawn with matplotlib's non-interactive Agg backend (works on a
headless machine).

Owns: every PNG a command writes (:func:`plot_runs` returns their paths), by the runs' metric:

* **validation accuracy** (the MLP: digits, mnist5k, an .npz): ``accuracy_vs_time.png`` and
  ``accuracy_vs_samples.png``, the same layout, made to stay readable for a 27-run grid:

  - one panel per (worker count n, algorithm), AGN's rules and the DiLoCo family's wire formats
    separate; for each n its panels fill a grid of at most :data:`MAX_COLUMNS` columns (the
    default comparison's 7 algorithms: two rows of 4 and 3), each titled, so the figure keeps
    a size that reads at normal zoom; a grid of sync only has one panel per n;
  - inside a panel, one line per λ, coloured by λ with the same colour for the same λ in every
    panel; sync with the same n is the dashed grey reference line in each of its panels;
  - repeats of a cell share its colour (thinner); a run that did not finish ends with an ``x``;
  - one small legend (the λ colours and the sync line) for the whole figure; a setting that
    follows n (EASGD's moving rate) is written in the corner of its panels;
  - the accuracy axis is zoomed to the informative range: from just below the lowest accuracy
    any run had in the second half of its history (so collapses stay visible, the first
    evaluations at chance level do not flatten everything else) up to 100 %.

* **validation loss** (the language model): ``loss_vs_time.png``, ``loss_vs_bytes.png`` and
  ``loss_vs_tokens.png`` -- the figure of the DiLoCo papers: one panel per worker count with
  every run a line (sync black and dashed, the collective algorithms solid, the
  parameter-server ones dash-dotted; one colour per algorithm and setting, the same in the
  three files), validation loss against wall time, against bytes communicated on a log axis
  (an evaluation before the first byte is left out: log 0), and against tokens processed; the
  workload's baseline (the unigram model) as a dotted line. The loss axis runs from just below
  the lowest loss to a little above the baseline, so the first evaluations of an untrained
  model (ln 75 = 4.3 nats) do not flatten the rest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from distoptim.cli import algorithms
from distoptim.cli.metrics import LOSS
from distoptim.cli.record import RunRecord

__all__ = [
    "ACCURACY_PNGS",
    "LOSS_PNGS",
    "MAX_COLUMNS",
    "SAMPLES_PNG",
    "accuracy_range",
    "loss_range",
    "plot_runs",
]

SAMPLES_PNG = "accuracy_vs_samples.png"
ACCURACY_PNGS = ("accuracy_vs_time.png", SAMPLES_PNG)
LOSS_PNGS = ("loss_vs_time.png", "loss_vs_bytes.png", "loss_vs_tokens.png")
MAX_COLUMNS = 4
"""Panels per row of the accuracy figures' grid (per worker count)."""
_SYNC_STYLE = {"color": "0.35", "linestyle": "--", "linewidth": 1.4}
_AXES = {
    "t": "wall time since all workers were ready (s)",
    "samples": "samples processed, all workers",
    "tokens": "tokens processed, all workers",
    "bytes": "bytes communicated, all workers (log scale)",
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str) -> None:
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    _pyplot().close(fig)
    os.replace(tmp, path)


def _thousands(x: float, _: Any = None) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:g}{unit}"
    return f"{x:g}"


# ---------------------------------------------------------------------------------------------
# validation accuracy: a grid of panels per worker count
# ---------------------------------------------------------------------------------------------
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


def _draw_grid(
    records: Sequence[RunRecord], x_key: str, x_label: str, path: str, title: str
) -> None:
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    ns = sorted({r.config.workers for r in records})
    columns = list(dict.fromkeys(_column(r) for r in records if r.config.algo != "sync"))
    sync_only = not columns
    if sync_only:
        columns = ["sync"]
    ncols = min(MAX_COLUMNS, len(columns))
    block = math.ceil(len(columns) / ncols)  # grid rows per worker count
    lams = sorted(
        {r.config.communication_period for r in records if algorithms.get(r.config.algo).periodic}
    )
    cmap = plt.get_cmap("viridis")
    color = {lam: cmap(0.8 * i / max(1, len(lams) - 1)) for i, lam in enumerate(lams)}
    fig, axes = plt.subplots(
        len(ns) * block,
        ncols,
        figsize=(0.8 + 3.3 * ncols, 0.9 + 2.6 * len(ns) * block),
        sharey=True,
        squeeze=False,
    )
    low, high = accuracy_range(records)

    def line(ax: Any, r: RunRecord, **kw: Any) -> None:
        xs = [p[x_key] for p in r.history]
        ys = [100 * p["val_acc"] for p in r.history]
        width = kw.pop("linewidth", 1.6) * (0.6 if r.config.repeat else 1.0)
        ax.plot(xs, ys, linewidth=width, alpha=0.6 if r.config.repeat else 0.95, **kw)
        if r.status != "ok" and xs:
            ax.plot(xs[-1:], ys[-1:], marker="x", markersize=7, color=kw.get("color", "k"))

    for i, n in enumerate(ns):
        syncs = [r for r in records if r.config.algo == "sync" and r.config.workers == n]
        # the n's panels share an x axis: from 0 to the longest run of that n, whatever its panel
        right = max(
            (p[x_key] for r in records if r.config.workers == n for p in r.history), default=0
        )
        for j in range(block * ncols):
            ax = axes[i * block + j // ncols][j % ncols]
            if j >= len(columns):
                ax.set_visible(False)
                continue
            col = columns[j]
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
            ax.set_xlim(0, max(right, 1e-9) * 1.02)
            ax.xaxis.set_major_locator(MaxNLocator(5))
            if x_key == "samples" and right >= 10_000:  # 20k, not 20000: labels must not touch
                ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=8)
            ax.set_title(col, fontsize=10)
            if j % ncols == 0:
                ax.set_ylabel(f"n = {n}\nval acc (%)", fontsize=9)
            if j + ncols >= len(columns):  # nothing of this n below it
                ax.set_xlabel(x_label, fontsize=9)
    handles = [Line2D([], [], color=color[lam], linewidth=2, label=f"λ = {lam}") for lam in lams]
    if any(r.config.algo == "sync" for r in records):
        handles.append(Line2D([], [], label="sync, same n", **_SYNC_STYLE))
    _title_and_legend(fig, f"{title}: validation accuracy", handles, len(handles))
    _save(fig, path)


def _title_and_legend(fig: Any, title: str, handles: list, ncol: int) -> None:
    """The figure's title, a one-row legend under it, and the panels below both."""
    height = fig.get_figheight()
    fig.suptitle(title, fontsize=11, y=1 - 0.12 / height, va="top")
    top = 1 - 0.42 / height  # below the title
    if handles:
        fig.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, top),
            ncol=ncol,
            fontsize=8,
            frameon=False,
        )
        top -= 0.28 / height
    fig.tight_layout(rect=(0, 0, 1, top), pad=0.4, h_pad=0.8, w_pad=1.6)


# ---------------------------------------------------------------------------------------------
# validation loss: every run in one panel per worker count
# ---------------------------------------------------------------------------------------------
def loss_range(
    records: Sequence[RunRecord], baseline: float | None = None
) -> tuple[float, float] | None:
    """The loss axis (module doc): from just below the lowest loss to a little above the
    baseline (without one: the highest loss); None when no run has a finite loss."""
    values = [
        p["val_loss"]
        for r in records
        for p in r.history
        if p.get("val_loss") is not None and math.isfinite(p["val_loss"])
    ]
    if not values:
        return None
    lowest = min(values)
    top = max(values) if baseline is None else min(max(values), baseline + 0.08 * baseline)
    top = max(top, lowest + 0.1)
    return lowest - 0.04 * (top - lowest), top


def _series(r: RunRecord, periods: int) -> str:
    """A run's line in the legend: its algorithm and setting (and λ when the grid has several)."""
    detail = algorithms.get(r.config.algo).detail(r.config)
    name = algorithms.title(r.config) + (f" {detail}" if detail else "")
    if periods > 1 and algorithms.get(r.config.algo).periodic:
        name += f", λ={r.config.communication_period}"
    return name


def _style(r: RunRecord, colors: dict[str, Any], key: str) -> dict[str, Any]:
    if r.config.algo == "sync":
        return {"color": "k", "linestyle": "--", "linewidth": 1.8}
    family = algorithms.get(r.config.algo).family
    return {
        "color": colors[key],
        "linestyle": "-" if family == "collective" else "-.",
        "linewidth": 1.6,
    }


def _draw_loss(
    records: Sequence[RunRecord],
    x_key: str,
    path: str,
    title: str,
    baseline: tuple[str, float] | None,
) -> None:
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    ns = sorted({r.config.workers for r in records})
    periods = len({r.config.communication_period for r in records if r.config.algo != "sync"})
    keys = list(dict.fromkeys(_series(r, periods) for r in records))
    palette = plt.get_cmap("tab10")
    sync = {_series(r, periods) for r in records if r.config.algo == "sync"}
    colors = {k: palette(i % 10) for i, k in enumerate(k for k in keys if k not in sync)}
    fig, axes = plt.subplots(
        len(ns), 1, figsize=(10.0, 0.9 + 4.4 * len(ns)), squeeze=False, sharey=True
    )
    span = loss_range(records, None if baseline is None else baseline[1])
    drawn: dict[str, Any] = {}
    for i, n in enumerate(ns):
        ax = axes[i][0]
        anything = False
        for r in (r for r in records if r.config.workers == n):
            points = [
                (p[x_key], p["val_loss"])
                for p in r.history
                if p.get(x_key) is not None and p.get("val_loss") is not None
            ]
            if x_key == "bytes":
                points = [(x, y) for x, y in points if x > 0]
            if not points:
                continue
            anything = True
            key = _series(r, periods)
            style = _style(r, colors, key)
            style["linewidth"] *= 0.6 if r.config.repeat else 1.0
            xs, ys = zip(*points)
            (handle,) = ax.plot(xs, ys, alpha=0.6 if r.config.repeat else 0.95, **style)
            drawn.setdefault(key, handle)
            if r.status != "ok":
                ax.plot(xs[-1:], ys[-1:], marker="x", markersize=7, color=style["color"])
        if baseline is not None:
            name, value = baseline
            handle = ax.axhline(value, color="0.5", linestyle=":", linewidth=1.2)
            drawn.setdefault(f"{name} baseline ({value:.3f})", handle)
        if not anything and x_key == "bytes":
            ax.text(0.5, 0.5, "no bytes moved", transform=ax.transAxes, ha="center", color="0.4")
        if x_key == "bytes" and anything:
            ax.set_xscale("log")
        elif x_key != "bytes":
            ax.set_xlim(left=0)
            ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
        if span is not None:
            ax.set_ylim(*span)
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=9)
        ax.set_ylabel(f"n = {n}\nvalidation loss (nats/char)", fontsize=9)
        if i == len(ns) - 1:
            ax.set_xlabel(_AXES[x_key], fontsize=9)
    fig.suptitle(f"{title}: validation loss", fontsize=11)
    fig.legend(
        list(drawn.values()),
        list(drawn),
        loc="center left",
        bbox_to_anchor=(0.72, 0.5),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 0.72, 0.97), pad=0.5)
    _save(fig, path)


def plot_runs(
    records: Sequence[RunRecord],
    out_dir: str | os.PathLike[str],
    title: str,
    baseline: tuple[str, float] | None = None,
) -> list[str]:
    """Draw the records that have a history into ``out_dir`` (module doc): the accuracy
    figures, or the loss figures for the language model; ``title`` names the data (and the
    link). Returns the paths written, none when no record has a history."""
    drawn = [r for r in records if len(r.history) >= 1]
    if not drawn:
        return []
    out_dir = os.fspath(out_dir)
    paths = []
    if drawn[0].metric is LOSS:
        for name, x_key in zip(LOSS_PNGS, ("t", "bytes", "tokens")):
            path = os.path.join(out_dir, name)
            rows = drawn
            if x_key == "tokens":  # the LM's history counts tokens under "samples"
                rows = [_with_tokens(r) for r in drawn]
            _draw_loss(rows, x_key, path, title, baseline)
            paths.append(path)
        return paths
    for name, x_key in zip(ACCURACY_PNGS, ("t", "samples")):
        path = os.path.join(out_dir, name)
        _draw_grid(drawn, x_key, _AXES[x_key], path, title)
        paths.append(path)
    return paths


def _with_tokens(r: RunRecord) -> RunRecord:
    """A view of ``r`` whose history points also carry ``tokens`` (= its ``samples``)."""
    from dataclasses import replace

    return replace(r, history=[{**p, "tokens": p.get("samples")} for p in r.history])
