"""The results of a set of runs: temporal efficiency, the comparison table, ``results.json``.

Owns: the per-cell summary (one row per algorithm x workers x λ, averaged over repeats), the
table printed at the end (the AGN paper's columns), and the JSON file written next to the plot.

Temporal efficiency (as in Hermans et al., *Accumulated Gradient Normalization*, 2017)
----------------------------------------------------------------------------------------
How much validation accuracy a run delivers over time, relative to synchronous training with
the same number of workers::

    E(run) = ∫₀ᵀ acc_run(t) dt  /  ∫₀ᵀ acc_sync(t) dt,      T = min(T_run, T_sync)

``acc(t)`` is the validation-accuracy curve (linear between evaluations, t = 0 when all workers
are ready), ``T`` the shorter of the two wall times, so both are compared over the same window.
``E > 1``: the run was ahead of sync on average over that window (higher accuracy sooner);
``E < 1``: behind. Sync's own E is 1 by definition.

Without a sync run with that worker count (a grid of async algorithms only), the reference is
the best run of the grid instead -- the finished run with the highest final validation
accuracy (ties: the shorter one) -- whose own E is then 1; the table marks such values with
``*`` and its footer names the reference. E is blank only for runs that did not finish, or
when no run finished with at least two evaluations.

Time and bytes to target accuracy
---------------------------------
The target is ``--target-acc`` (a validation accuracy), or by default ``0.95 *`` the final
validation accuracy of the same reference as temporal efficiency (sync with the same workers;
without one, the grid's best run, said in the footer). A run's *time to target* and *bytes to
target* are the ``t`` and ``bytes`` of its first evaluation at or above the target (the bytes
at an evaluation: :mod:`distoptim.cli.record`); a run that never reaches it has none. This is
where the communication-efficient algorithms show: DiLoCo reaches sync's accuracy moving a
fraction of the bytes, and with a straggler the asynchronous ones do not wait for it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

from distoptim.cli import algorithms
from distoptim.cli.record import RunRecord

__all__ = [
    "DEFAULT_TARGET_SHARE",
    "TEMPORAL_EFFICIENCY",
    "TO_TARGET",
    "assign_targets",
    "footer",
    "assign_temporal_efficiency",
    "format_bytes",
    "render_table",
    "summarize",
    "temporal_efficiency",
    "write_results",
]

TEMPORAL_EFFICIENCY = (
    "E = integral over [0, T] of the run's validation accuracy vs wall time, divided by the "
    "same integral for sync with the same workers (without one: for the grid's best run, the "
    "highest final validation accuracy); T = the shorter of the two wall times. E > 1: higher "
    "accuracy sooner than the reference; the reference = 1."
)


DEFAULT_TARGET_SHARE = 0.95
"""Without ``--target-acc`` the target is this share of the reference's final accuracy."""

TO_TARGET = (
    "time/bytes to target: wall time and bytes moved until the first evaluation with a "
    "validation accuracy >= the target: --target-acc, or by default 0.95 x the final validation "
    "accuracy of sync with the same workers (without one: of the grid's best run). Bytes at an "
    "evaluation: measured for the collective algorithms, the total's share of the samples "
    "processed for the parameter-server ones."
)


def _area(history: Sequence[dict[str, Any]], horizon: float) -> float | None:
    ts = np.array([p["t"] for p in history], dtype=float)
    acc = np.array([p["val_acc"] for p in history], dtype=float)
    if ts.size < 2 or horizon <= 0:
        return None
    grid = np.linspace(0.0, horizon, 2001)
    values = np.interp(grid, ts, acc)  # flat before the first / after the last evaluation
    return float(np.sum((values[1:] + values[:-1]) * 0.5 * np.diff(grid)))  # trapezoid rule


def temporal_efficiency(
    history: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]]
) -> float | None:
    """``E`` of ``history`` against ``reference`` (see the module doc); None if undefined."""
    if len(history) < 2 or len(reference) < 2:
        return None
    horizon = min(history[-1]["t"], reference[-1]["t"])
    num, den = _area(history, horizon), _area(reference, horizon)
    if num is None or den is None or den <= 0:
        return None
    return num / den


def _best_run(records: Sequence[RunRecord]) -> RunRecord | None:
    finished = [r for r in records if r.status == "ok" and len(r.history) >= 2]
    if not finished:
        return None
    return max(finished, key=lambda r: (r.val_acc or 0.0, -(r.wall_time_s or 0.0)))


def _references(records: Sequence[RunRecord]) -> Callable[[RunRecord], RunRecord | None]:
    """Each record's reference: the sync run with the same workers and repeat index (else the
    first finished sync run with those workers); without one, the grid's best run."""
    refs: dict[tuple[int, int], RunRecord] = {}
    for r in records:
        if r.config.algo == "sync" and r.status == "ok" and len(r.history) >= 2:
            refs.setdefault((r.config.workers, r.config.repeat), r)
            refs.setdefault((r.config.workers, -1), r)
    best = _best_run(records)

    def reference(r: RunRecord) -> RunRecord | None:
        key = (r.config.workers, r.config.repeat)
        return refs.get(key) or refs.get((r.config.workers, -1)) or best

    return reference


def assign_temporal_efficiency(records: Sequence[RunRecord]) -> None:
    """Set ``temporal_efficiency`` and its reference on every finished record (module doc)."""
    reference = _references(records)
    for r in records:
        r.temporal_efficiency = r.temporal_efficiency_reference = None
        ref = reference(r) if r.status == "ok" else None
        if ref is not None:
            r.temporal_efficiency = temporal_efficiency(r.history, ref.history)
            r.temporal_efficiency_reference = ref.label


def assign_targets(records: Sequence[RunRecord], target_acc: float | None = None) -> None:
    """Set the target and the time and bytes to reach it on every finished record.

    ``target_acc``: the target validation accuracy, or None for ``0.95 *`` the reference's
    final validation accuracy (module doc).
    """
    reference = _references(records)
    for r in records:
        r.target_acc = r.target_reference = r.time_to_target_s = r.bytes_to_target = None
        if r.status != "ok":
            continue
        if target_acc is None:
            ref = reference(r)
            if ref is None or ref.val_acc is None:
                continue
            r.target_acc, r.target_reference = DEFAULT_TARGET_SHARE * ref.val_acc, ref.label
        else:
            r.target_acc = target_acc
        reached = next((p for p in r.history if p["val_acc"] >= r.target_acc), None)
        if reached is not None:
            r.time_to_target_s = reached["t"]
            r.bytes_to_target = reached.get("bytes")


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """One row per (algorithm, workers, λ): means over the finished repeats, plus spread.

    A cell none of whose runs finished (interrupted, failed) shows its runs' last validation
    accuracy and time so far, and its status next to the algorithm's name.
    """
    cells: dict[tuple[str, str, int, int | None], list[RunRecord]] = {}
    for r in records:
        algo = algorithms.get(r.config.algo)
        lam = r.config.communication_period if algo.periodic else None
        key = (r.config.algo, algo.variant(r.config), r.config.workers, lam)
        cells.setdefault(key, []).append(r)
    rows = []
    for (algo, variant, workers, lam), runs in cells.items():
        ok = [r for r in runs if r.status == "ok"]
        # a cell with no finished run shows how far its runs got (last evaluation, time so far)
        pool = ok or runs
        val = [r.val_acc for r in pool if r.val_acc is not None]
        refs = {r.temporal_efficiency_reference for r in ok} - {None}
        row: dict[str, Any] = {
            "algorithm": algo,
            "variant": variant,
            "title": algorithms.title(runs[0].config),
            "detail": algorithms.get(algo).detail(runs[0].config),
            "settings": algorithms.get(algo).settings(runs[0].config),
            "workers": workers,
            "communication_period": lam,
            "runs": len(runs),
            "finished": len(ok),
            "status": "ok" if len(ok) == len(runs) else ",".join(sorted({r.status for r in runs})),
            "wall_time_s": _mean([r.wall_time_s for r in pool if r.wall_time_s is not None]),
            "train_acc": _mean([r.train_acc for r in ok if r.train_acc is not None]),
            "val_acc": _mean(val),
            "val_acc_std": statistics.stdev(val) if len(val) > 1 else None,
            "val_acc_min": min(val) if val else None,
            "val_acc_max": max(val) if val else None,
            "communications": _mean([r.communications for r in ok if r.communications is not None]),
            "communication_kind": runs[0].communication_kind,
            "bytes_moved": _mean([r.bytes_moved for r in ok if r.bytes_moved is not None]),
            "temporal_efficiency": _mean(
                [r.temporal_efficiency for r in ok if r.temporal_efficiency is not None]
            ),
            "temporal_efficiency_reference": ", ".join(sorted(refs)) or None,
            "target_acc": _mean([r.target_acc for r in ok if r.target_acc is not None]),
            "target_reference": ", ".join(
                sorted({r.target_reference for r in ok} - {None})  # type: ignore[arg-type]
            )
            or None,
            "reached_target": sum(1 for r in ok if r.time_to_target_s is not None),
            "time_to_target_s": _mean(
                [r.time_to_target_s for r in ok if r.time_to_target_s is not None]
            ),
            "bytes_to_target": _mean(
                [r.bytes_to_target for r in ok if r.bytes_to_target is not None]
            ),
            "note": algorithms.get(algo).note(runs[0].config),
        }
        rows.append(row)
    return rows


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _cells(row: dict[str, Any]) -> list[str]:
    val = _pct(row["val_acc"])
    if row["val_acc_std"] is not None:
        val = f"{100 * row['val_acc']:.1f} ± {100 * row['val_acc_std']:.1f}%"
    comm = "-" if row["communications"] is None else f"{row['communications']:.0f}"
    wall = "-" if row["wall_time_s"] is None else f"{row['wall_time_s']:.1f} s"
    eff = "-" if row["temporal_efficiency"] is None else f"{row['temporal_efficiency']:.2f}"
    if eff != "-" and not _against_sync(row):
        eff += "*"
    algo = row["title"] + (f" {row['detail']}" if row["detail"] else "")
    if row["status"] != "ok":
        algo += f" ({row['status']})"
    time_to, bytes_to = _to_target(row)
    return [
        algo,
        str(row["workers"]),
        "-" if row["communication_period"] is None else str(row["communication_period"]),
        wall,
        _pct(row["train_acc"]),
        val,
        comm,
        format_bytes(row["bytes_moved"]),
        time_to,
        bytes_to,
        eff,
    ]


def _to_target(row: dict[str, Any]) -> tuple[str, str]:
    """The two "to target" cells: '-' without a target, 'not reached', or the means (with
    'k/m' when only k of the m finished repeats reached it)."""
    if row["target_acc"] is None:
        return "-", "-"
    if not row["reached_target"]:
        return "not reached", "not reached"
    some = f" ({row['reached_target']}/{row['finished']})"
    some = some if row["reached_target"] < row["finished"] else ""
    return f"{row['time_to_target_s']:.1f} s{some}", format_bytes(row["bytes_to_target"]) + some


_HEADERS = [
    "algorithm",
    "n",
    "λ",
    "wall\ntime",
    "train\nacc",
    "val\nacc",
    "commits /\nsyncs",
    "bytes\nmoved",
    "time to\ntarget",
    "bytes to\ntarget",
    "temporal\neff.",
]


_CAPTION = (
    "n: workers, λ: local steps between commits (LocalSGD, DiLoCo: between syncs, H); commits / "
    "syncs: parameter-server commits of all workers, a rank's all-reduces (sync) or outer syncs "
    "(LocalSGD, DiLoCo); temporal eff.: accuracy-over-time area vs sync with the same n (see "
    "results.json)"
)


def _against_sync(row: dict[str, Any]) -> bool:
    ref = row.get("temporal_efficiency_reference") or ""
    return all(part.startswith("sync ") for part in ref.split(", "))


def footer(rows: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> list[str]:
    """The lines under the table: the columns, what the algorithms' settings mean (each
    algorithm's ``note``), the target, what * means, then ``notes`` (the command's own:
    oversubscription, stragglers)."""
    lines = [_CAPTION]
    for note in dict.fromkeys(r["note"] for r in rows if r.get("note")):
        lines.append(note)
    lines += _target_lines(rows)
    marked = sorted(
        {
            r["temporal_efficiency_reference"]
            for r in rows
            if r["temporal_efficiency"] is not None and not _against_sync(r)
        }
    )
    if rows and all(r["temporal_efficiency"] is None for r in rows):
        lines.append(
            "temporal eff. is '-': no run finished with two or more evaluations to compare with"
        )
    if marked:
        lines.append(
            f"*: no sync run with that n; temporal eff. relative to the grid's best run "
            f"({', '.join(marked)}) instead"
        )
    return lines + list(notes)


def _target_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    targets = [r for r in rows if r["target_acc"] is not None]
    if not targets:
        return []
    refs = sorted({r["target_reference"] for r in targets} - {None})
    if not refs:
        return [
            f"to target: until the first evaluation at val acc >= {_pct(targets[0]['target_acc'])}"
            " (--target-acc)"
        ]
    by_ref: dict[str, float] = {}
    for r in targets:
        if r["target_reference"] is not None:
            by_ref.setdefault(r["target_reference"], r["target_acc"])
    against = ", ".join(f"{_pct(acc)} for {ref}" for ref, acc in by_ref.items())
    sync = all(ref.startswith("sync ") for ref in refs)
    whose = "sync with the same n" if sync else "the grid's best run (no sync run with that n)"
    return [
        f"to target: until the first evaluation at val acc >= 0.95 x the final val acc of {whose}"
        f" ({against}); bytes: measured (collective), the samples' share of the total "
        "(parameter server)"
    ]


def render_table(
    rows: Sequence[dict[str, Any]], stream: TextIO | None = None, notes: Sequence[str] = ()
) -> None:
    """Print the comparison table (rich, plain box characters when not a terminal) and its
    :func:`footer` (with ``notes``)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    stream = stream if stream is not None else sys.stdout
    tty = getattr(stream, "isatty", lambda: False)()
    # a pipe or file gets the whole table, however wide (Markdown: never cut a column)
    console = Console(file=stream, width=None if tty else 400, no_color=not tty)
    # a terminal gets a compact table; a file or pipe a Markdown one (pastes into reports)
    table = Table(
        box=box.SIMPLE_HEAD if tty else box.MARKDOWN,
        pad_edge=not tty,
        collapse_padding=tty,
    )
    for i, h in enumerate(_HEADERS):
        table.add_column(
            h if tty else h.replace("\n", " "), justify="left" if i == 0 else "right", no_wrap=True
        )
    for row in rows:
        table.add_row(*_cells(row))
    with console.capture() as drawn:
        console.print(table)
    # both boxes draw the table's top and bottom edges as blanks: no line of spaces around it
    stream.write("".join(line for line in drawn.get().splitlines(True) if line.strip()))
    for line in footer(rows, notes):
        console.print(line, highlight=False, soft_wrap=True)


def write_results(
    path: str | os.PathLike[str],
    records: Sequence[RunRecord],
    meta: dict[str, Any],
    notes: Sequence[str] = (),
) -> dict[str, Any]:
    """Write ``results.json`` atomically (temp file + rename); return what was written.
    ``notes``: the command's own lines for the footer (see :func:`footer`)."""
    doc = dict(meta)
    doc["temporal_efficiency_definition"] = TEMPORAL_EFFICIENCY
    doc["to_target_definition"] = TO_TARGET
    doc["summary"] = rows = summarize(records)
    doc["footer"] = footer(rows, notes)
    doc["runs"] = [r.to_dict() for r in records]
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(_finite(doc), fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    os.replace(tmp, path)
    return doc


def _finite(value: Any) -> Any:
    """JSON has no NaN/Infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
