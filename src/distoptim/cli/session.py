"""Running a plan: the runs one after another, live progress, and the outputs after each.

Owns: the order of runs, what happens when one fails (recorded, the others still run) or the
user presses Ctrl-C (the launcher stops every worker process; the records so far, including the
interrupted run's history up to that moment, are written), and the outputs: ``results.json``
and ``accuracy_vs_time.png`` in the plan's folder, rewritten after every run so that even a
killed session leaves what had finished, and the table printed at the end.

Exit codes: 0 all runs finished, 1 some run failed, 130 interrupted.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import torch

from distoptim._version import __version__
from distoptim.cli.options import Plan
from distoptim.cli.plot import plot_accuracy
from distoptim.cli.progress import LineSink, ProgressDisplay
from distoptim.cli.report import assign_temporal_efficiency, render_table, summarize, write_results
from distoptim.cli.train import (
    AlgorithmUnavailableError,
    RunRecord,
    partial_record,
    run_local,
)
from distoptim.cli.train import run_torchrun as _train_torchrun

__all__ = ["RESULTS_JSON", "PLOT_PNG", "run_plan", "run_torchrun", "write_outputs"]

RESULTS_JSON = "results.json"
PLOT_PNG = "accuracy_vs_time.png"


def _headline(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _meta(plan: Plan, argv: Sequence[str], status: str) -> dict[str, Any]:
    return {
        "distoptim_version": __version__,
        "command": ["distoptim", *argv],
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "status": status,
        "dataset": plan.data.describe(),
        "link": plan.link,
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def write_outputs(
    plan: Plan, records: Sequence[RunRecord], argv: Sequence[str], status: str
) -> tuple[str, str | None]:
    """Write ``results.json`` and the plot under ``plan.out``; return their paths."""
    assign_temporal_efficiency(records)
    json_path = os.path.join(plan.out, RESULTS_JSON)
    write_results(json_path, records, _meta(plan, argv, status))
    title = f"{plan.data.name}: validation accuracy of each algorithm"
    if plan.link:
        mbps = plan.link["mbps"]
        title += f" (emulated link {plan.link['latency_ms']:g} ms, "
        title += "unlimited" if mbps is None else f"{mbps:g} Mbit/s"
        title += ")"
    png = plot_accuracy(records, os.path.join(plan.out, PLOT_PNG), title)
    return json_path, png


@contextlib.contextmanager
def _no_sigint() -> Iterator[None]:
    """Hold off a second Ctrl-C while the partial results are being written (a second or so)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _summary_line(rec: RunRecord, verbose: bool) -> str:
    if not verbose:  # the bar already shows the accuracy
        return "done"
    acc = "-" if rec.val_acc is None else f"{100 * rec.val_acc:.1f}%"
    return f"done in {rec.wall_time_s or 0:.1f} s, val acc {acc}"


def run_plan(
    plan: Plan,
    argv: Sequence[str],
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run every config of ``plan`` in order; write outputs; print the table. Exit code."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    display = ProgressDisplay(plan.progress, stderr)
    n_train = int(plan.data.x_train.shape[0])
    labels = [c.label for c in plan.configs]
    totals = [c.total_samples(n_train) for c in plan.configs]
    records: list[RunRecord] = []
    interrupted = failed = False
    with display.session(labels, totals):
        for i, cfg in enumerate(plan.configs):
            record: RunRecord | None = None
            error: BaseException | None = None
            with display.run(i, cfg.label, totals[i]) as channel:
                try:
                    record = run_local(cfg, plan.data, channel.queue, plan.link_env)
                except KeyboardInterrupt as exc:
                    error, interrupted = exc, True
                except Exception as exc:  # a failed run is recorded; the others still run
                    error, failed = exc, True
            if record is None:  # the drain thread has stopped: channel.events is complete
                status = "interrupted" if interrupted else "failed"
                text = "interrupted by Ctrl-C" if interrupted else str(error)
                record = partial_record(cfg, channel.events, status, text)
                channel.finished(
                    status
                    if interrupted or display.mode != "plain"
                    else f"failed: {_headline(error)}"
                )
                if not interrupted:
                    print(f"distoptim: run '{cfg.label}' failed: {_headline(error)}", file=stderr)
            else:
                channel.acc = record.val_acc
                channel.finished(_summary_line(record, display.mode == "plain"))
            records.append(record)
            with _no_sigint():
                if interrupted:
                    state = "interrupted"
                elif i + 1 < len(labels):
                    state = "running"  # rewritten after the next run
                else:
                    state = "failed" if failed else "complete"
                json_path, png = write_outputs(plan, records, argv, state)
            if interrupted:
                break
    render_table(summarize(records), stdout)
    print(f"results: {json_path}", file=stdout)
    if png:
        print(f"plot:    {png}", file=stdout)
    if interrupted:
        print("distoptim: interrupted; the runs so far are in the results above", file=stderr)
        return 130
    return 1 if failed else 0


def run_torchrun(plan: Plan, argv: Sequence[str]) -> int:
    """This process is one rank of a torchrun job; the reporting rank (sync: rank 0; async: the
    chief, the first worker) writes the outputs and prints the table."""
    cfg = plan.configs[0]
    sink = None
    if plan.progress != "none":  # only the reporting rank (sync rank 0 / the chief) uses it
        sink = LineSink(f"{cfg.label} (torchrun)", cfg.total_samples(len(plan.data.y_train)))
        sink.set_world(cfg.workers)
    try:
        record = _train_torchrun(cfg, plan.data, sink, plan.link_env)
    except AlgorithmUnavailableError as exc:
        print(f"distoptim train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if record is None:  # not rank 0
        return 0
    json_path, png = write_outputs(plan, [record], argv, "complete")
    render_table(summarize([record]), sys.stdout)
    print(f"results: {json_path}")
    if png:
        print(f"plot:    {png}")
    return 0
