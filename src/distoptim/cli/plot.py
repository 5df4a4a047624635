"""The picture of a comparison: validation accuracy against wall time and against samples.

Owns: ``accuracy_vs_time.png`` -- two panels side by side, one line per run (colour = algorithm,
line style = worker count / λ cell), drawn with matplotlib's non-interactive Agg backend so it
works on a headless machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from distoptim.cli.train import RunRecord

__all__ = ["plot_accuracy"]

_COLORS = {"sync": "#1f77b4", "agn": "#d62728", "downpour": "#2ca02c", "easgd": "#9467bd"}
_STYLES = ["-", "--", ":", "-."]
_NAMES = {"sync": "sync (CrossShard)", "agn": "AGN", "downpour": "DOWNPOUR", "easgd": "EASGD"}


def _label(r: RunRecord) -> str:
    c = r.config
    lam = "" if c.algo == "sync" else f" λ={c.communication_period}"
    rep = f" run {c.repeat + 1}" if c.repeat else ""
    status = "" if r.status == "ok" else f" ({r.status})"
    return f"{_NAMES.get(c.algo, c.algo)}{lam}, n={c.workers}{rep}{status}"


def _cell(r: RunRecord) -> tuple[int, int]:
    """Worker count and λ (0 for sync, which has none): runs of one cell share a line style."""
    return (r.config.workers, 0 if r.config.algo == "sync" else r.config.communication_period)


def plot_accuracy(
    records: Sequence[RunRecord], path: str | os.PathLike[str], title: str
) -> str | None:
    """Draw every record with a history into ``path`` (PNG); returns the path, or None if empty."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    drawn = [r for r in records if len(r.history) >= 1]
    if not drawn:
        return None
    cells = sorted({_cell(r) for r in drawn})
    style_of = {cell: _STYLES[i % len(_STYLES)] for i, cell in enumerate(cells)}
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 5.2), sharey=True)
    for r in drawn:
        ts = [p["t"] for p in r.history]
        ss = [p["samples"] for p in r.history]
        acc = [100 * p["val_acc"] for p in r.history]
        kw = {
            "color": _COLORS.get(r.config.algo, "black"),
            "linestyle": style_of[_cell(r)],
            "linewidth": 1.8,
            "marker": "o",
            "markersize": 2.5,
            "alpha": 0.9 if r.config.repeat == 0 else 0.55,
        }
        ax_t.plot(ts, acc, label=_label(r), **kw)
        ax_s.plot(ss, acc, **kw)
    ax_t.set_title("Validation accuracy vs wall time")
    ax_t.set_xlabel("wall time since all workers were ready (s)")
    ax_t.set_ylabel("validation accuracy (%)")
    ax_s.set_title("Validation accuracy vs samples processed")
    ax_s.set_xlabel("training samples processed, all workers together")
    for ax in (ax_t, ax_s):
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0)
        ax.set_ylim(0, 100)
    fig.suptitle(title)
    handles, labels = ax_t.get_legend_handles_labels()
    ncol = min(4, len(labels))
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    rows = (len(labels) + ncol - 1) // ncol
    fig.tight_layout(rect=(0, 0.04 + 0.045 * rows, 1, 1))
    tmp = f"{os.fspath(path)}.tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return os.fspath(path)
