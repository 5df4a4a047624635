"""The results of a set of runs: temporal efficiency, the comparison table, ``results.json``.

Owns: the per-cell summary (one row per algorithm x workers x λ, averaged over repeats), the
table printed at the end (the AGN paper's columns; for the language model its losses), and the
JSON file written next to the plots.

Runs are judged by their metric (:mod:`distoptim.cli.metrics`): validation accuracy for the
MLP's runs, validation loss in nats for the language model's. The definitions below are
written for accuracy; for loss the better direction is lower, the default target is ``1.04 x``
the reference's final validation loss, a run reaches it at its first evaluation ``<=`` it, and
temporal efficiency is the reference's area over the run's.

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
``*`` and its footer names the reference. E is blank for runs that did not finish, when no run
finished with at least two evaluations, and for a run that would only be compared with itself
(``distoptim train``: one run, nothing to compare with).

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
from distoptim.cli.metrics import ACCURACY, LOSS, Metric
from distoptim.cli.record import RunRecord

__all__ = [
    "DEFAULT_TARGET_SHARE",
    "TEMPORAL_EFFICIENCY",
    "TEMPORAL_EFFICIENCY_LOSS",
    "TO_TARGET",
    "TO_TARGET_LOSS",
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
TEMPORAL_EFFICIENCY_LOSS = (
    "E = integral over [0, T] of the validation loss vs wall time of sync with the same workers "
    "(without one: of the grid's best run, the lowest final validation loss), divided by the "
    "same integral for the run; T = the shorter of the two wall times. E > 1: lower loss "
    "sooner than the reference; the reference = 1."
)


DEFAULT_TARGET_SHARE = ACCURACY.default_share
"""Without ``--target-acc`` the target is this share of the reference's final accuracy (the
language model's: :data:`distoptim.cli.metrics.LOSS` ``.default_share``)."""

TO_TARGET = (
    "time/bytes to target: wall time and bytes moved until the first evaluation with a "
    "validation accuracy >= the target: --target-acc, or by default 0.95 x the final validation "
    "accuracy of sync with the same workers (without one: of the grid's best run). Bytes at an "
    "evaluation: measured for the collective algorithms, the total's share of the samples "
    "processed for the parameter-server ones."
)
TO_TARGET_LOSS = (
    "time/bytes to target: wall time and bytes moved until the first evaluation with a "
    "validation loss <= the target: --target-loss, or by default 1.04 x the final validation "
    "loss of sync with the same workers (without one: of the grid's best run). Bytes at an "
    "evaluation: measured for the collective algorithms, the total's share of the tokens "
    "processed for the parameter-server ones."
)


def _metric(records: Sequence[RunRecord]) -> Metric:
    """The metric of a set of runs (one command's runs all train the same model)."""
    return records[0].metric if records else ACCURACY


def _area(history: Sequence[dict[str, Any]], horizon: float, key: str) -> float | None:
    ts = np.array([p["t"] for p in history], dtype=float)
    values = np.array([p[key] for p in history], dtype=float)
    if ts.size < 2 or horizon <= 0 or not np.all(np.isfinite(values)):
        return None
    grid = np.linspace(0.0, horizon, 2001)
    values = np.interp(grid, ts, values)  # flat before the first / after the last evaluation
    return float(np.sum((values[1:] + values[:-1]) * 0.5 * np.diff(grid)))  # trapezoid rule


def temporal_efficiency(
    history: Sequence[dict[str, Any]],
    reference: Sequence[dict[str, Any]],
    metric: Metric = ACCURACY,
) -> float | None:
    """``E`` of ``history`` against ``reference`` (see the module doc); None if undefined."""
    if len(history) < 2 or len(reference) < 2:
        return None
    horizon = min(history[-1]["t"], reference[-1]["t"])
    run, ref = _area(history, horizon, metric.key), _area(reference, horizon, metric.key)
    if run is None or ref is None:
        return None
    return metric.efficiency(run, ref)


def _best_run(records: Sequence[RunRecord]) -> RunRecord | None:
    finished = [r for r in records if r.status == "ok" and len(r.history) >= 2]
    if not finished:
        return None
    metric = _metric(records)
    return max(
        finished,
        key=lambda r: (metric.rank(getattr(r, metric.key)), -(r.wall_time_s or 0.0)),
    )


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
    """Set ``temporal_efficiency`` and its reference on every finished record (module doc);
    a run whose reference is itself and no other run's gets none (nothing was compared)."""
    reference = _references(records)
    metric = _metric(records)
    refs = {id(r): reference(r) if r.status == "ok" else None for r in records}
    used = [id(ref) for r in records if (ref := refs[id(r)]) is not None and ref is not r]
    for r in records:
        r.temporal_efficiency = r.temporal_efficiency_reference = None
        ref = refs[id(r)]
        if ref is None or (ref is r and id(r) not in used):
            continue
        r.temporal_efficiency = temporal_efficiency(r.history, ref.history, metric)
        r.temporal_efficiency_reference = ref.label


def assign_targets(records: Sequence[RunRecord], target: float | None = None) -> None:
    """Set the target and the time and bytes to reach it on every finished record.

    ``target``: a fixed target in the runs' metric (validation accuracy, or validation loss
    for the language model), or None for the default share of the reference's final value
    (module doc).
    """
    reference = _references(records)
    metric = _metric(records)
    for r in records:
        r.target_acc = r.target_loss = None
        r.target_reference = r.time_to_target_s = r.bytes_to_target = None
        if r.status != "ok":
            continue
        if target is None:
            ref = reference(r)
            final = None if ref is None else getattr(ref, metric.key)
            if final is None or not math.isfinite(final):
                continue
            r.target, r.target_reference = metric.default_share * final, ref.label
        else:
            r.target = target
        reached = next(
            (
                p
                for p in r.history
                if p.get(metric.key) is not None and metric.reached(p[metric.key], r.target)
            ),
            None,
        )
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
    metric = _metric(records)
    for (algo, variant, workers, lam), runs in cells.items():
        ok = [r for r in runs if r.status == "ok"]
        # a cell with no finished run shows how far its runs got (last evaluation, time so far)
        pool = ok or runs
        val = [r.val_acc for r in pool if r.val_acc is not None]
        losses = [r.val_loss for r in pool if r.val_loss is not None and math.isfinite(r.val_loss)]
        refs = {r.temporal_efficiency_reference for r in ok} - {None}
        row: dict[str, Any] = {
            "metric": metric.name,
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
            "train_loss": _mean([r.train_loss for r in ok if r.train_loss is not None]),
            "val_loss": _mean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
            "communications": _mean([r.communications for r in ok if r.communications is not None]),
            "communication_kind": runs[0].communication_kind,
            "bytes_moved": _mean([r.bytes_moved for r in ok if r.bytes_moved is not None]),
            "temporal_efficiency": _mean(
                [r.temporal_efficiency for r in ok if r.temporal_efficiency is not None]
            ),
            "temporal_efficiency_reference": ", ".join(sorted(refs)) or None,
            "target_acc": _mean([r.target_acc for r in ok if r.target_acc is not None]),
            "target_loss": _mean([r.target_loss for r in ok if r.target_loss is not None]),
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
        if metric is LOSS:  # the language model: the loss's two other spellings
            loss = row["val_loss"]
            row["val_bpc"] = None if loss is None else loss / math.log(2)
            row["val_perplexity"] = None if loss is None else math.exp(min(loss, 700.0))
        rows.append(row)
    return rows


def _target(row: dict[str, Any]) -> float | None:
    return row["target_loss"] if row.get("metric") == LOSS.name else row["target_acc"]


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _scores(row: dict[str, Any]) -> list[str]:
    """The score cells: train and val accuracy, or for the language model train loss, val
    loss, bits/char and perplexity."""
    if row.get("metric") == LOSS.name:
        val = _num(row["val_loss"], ".3f")
        if row["val_loss_std"] is not None:
            val = f"{row['val_loss']:.3f} ± {row['val_loss_std']:.3f}"
        return [
            _num(row["train_loss"], ".3f"),
            val,
            _num(row["val_bpc"], ".3f"),
            _num(row["val_perplexity"], ".2f"),
        ]
    val = _pct(row["val_acc"])
    if row["val_acc_std"] is not None:
        val = f"{100 * row['val_acc']:.1f} ± {100 * row['val_acc_std']:.1f}%"
    return [_pct(row["train_acc"]), val]


def _cells(row: dict[str, Any], efficiency: bool = True) -> list[str]:
    comm = "-" if row["communications"] is None else f"{row['communications']:.0f}"
    wall = "-" if row["wall_time_s"] is None else f"{row['wall_time_s']:.1f} s"
    eff = "-" if row["temporal_efficiency"] is None else f"{row['temporal_efficiency']:.2f}"
    if eff != "-" and not _against_sync(row):
        eff += "*"
    algo = row["title"] + (f" {row['detail']}" if row["detail"] else "")
    if row["status"] != "ok":
        algo += f" ({row['status']})"
    time_to, bytes_to = _to_target(row)
    cells = [
        algo,
        str(row["workers"]),
        "-" if row["communication_period"] is None else str(row["communication_period"]),
        wall,
        *_scores(row),
        comm,
        format_bytes(row["bytes_moved"]),
        time_to,
        bytes_to,
    ]
    return [*cells, eff] if efficiency else cells


def _to_target(row: dict[str, Any]) -> tuple[str, str]:
    """The two "to target" cells: '-' without a target, 'not reached', or the means (with
    'k/m' when only k of the m finished repeats reached it)."""
    if _target(row) is None:
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
_LOSS_SCORES = ["train\nloss", "val loss\n(nats)", "bits per\nchar", "perplexity"]
"""The language model's score columns, in place of train and val accuracy."""


def _headers(metric_name: str, efficiency: bool) -> list[str]:
    headers = list(_HEADERS)
    if metric_name == LOSS.name:
        headers[4:6] = _LOSS_SCORES
    return headers if efficiency else headers[:-1]


_CAPTION = (
    "n: workers, λ: local steps between commits (LocalSGD, DiLoCo: between syncs, H); commits / "
    "syncs: parameter-server commits of all workers, a rank's all-reduces (sync) or outer syncs "
    "(LocalSGD, DiLoCo)"
)
_CAPTION_EFFICIENCY = (
    "; temporal eff.: {what}-over-time area vs sync with the same n (see results.json)"
)


def _shows_efficiency(rows: Sequence[dict[str, Any]]) -> bool:
    """Whether the table has a temporal-efficiency column: not for one run compared with
    nothing (``distoptim train``)."""
    return len(rows) > 1 or any(r["temporal_efficiency"] is not None for r in rows)


def _against_sync(row: dict[str, Any]) -> bool:
    ref = row.get("temporal_efficiency_reference") or ""
    return all(part.startswith("sync ") for part in ref.split(", "))


def footer(rows: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> list[str]:
    """The lines under the table: the columns, what the algorithms' settings mean (each
    algorithm's ``note``), the target, what * means, then ``notes`` (the command's own:
    oversubscription, stragglers)."""
    loss = bool(rows) and rows[0].get("metric") == LOSS.name
    caption = _CAPTION
    if _shows_efficiency(rows):
        caption += _CAPTION_EFFICIENCY.format(what="loss" if loss else "accuracy")
    lines = [caption]
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
    if len(rows) > 1 and all(r["temporal_efficiency"] is None for r in rows):
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
    targets = [r for r in rows if _target(r) is not None]
    if not targets:
        return []
    metric = LOSS if targets[0].get("metric") == LOSS.name else ACCURACY
    at = f"{metric.label} {'>=' if metric.higher_is_better else '<='}"
    refs = sorted({r["target_reference"] for r in targets} - {None})
    if not refs:
        return [
            f"to target: until the first evaluation at {at} "
            f"{metric.format(_target(targets[0]))} ({metric.option})"
        ]
    by_ref: dict[str, float] = {}
    for r in targets:
        if r["target_reference"] is not None:
            by_ref.setdefault(r["target_reference"], _target(r))
    against = ", ".join(f"{metric.format(value)} for {ref}" for ref, value in by_ref.items())
    sync = all(ref.startswith("sync ") for ref in refs)
    whose = "sync with the same n" if sync else "the grid's best run (no sync run with that n)"
    unit = "tokens'" if metric is LOSS else "samples'"
    return [
        f"to target: until the first evaluation at {at} {metric.default_share:g} x the final "
        f"{metric.label} of {whose} ({against}); bytes: measured (collective), the {unit} share "
        "of the total (parameter server)"
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
    efficiency = _shows_efficiency(rows)
    metric_name = rows[0].get("metric", ACCURACY.name) if rows else ACCURACY.name
    for i, h in enumerate(_headers(metric_name, efficiency)):
        table.add_column(
            h if tty else h.replace("\n", " "), justify="left" if i == 0 else "right", no_wrap=True
        )
    for row in rows:
        table.add_row(*_cells(row, efficiency))
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
    loss = _metric(records) is LOSS
    doc["metric"] = _metric(records).name
    doc["temporal_efficiency_definition"] = (
        TEMPORAL_EFFICIENCY_LOSS if loss else TEMPORAL_EFFICIENCY
    )
    doc["to_target_definition"] = TO_TARGET_LOSS if loss else TO_TARGET
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
