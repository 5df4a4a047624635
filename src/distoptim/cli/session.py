"""Running a plan: the pool, the runs one after another, live progress, and the outputs.

Owns: the order of runs; the process pool they share (started once, before the first run,
sized for the largest run; started again only after a run broke it -- a process died, a run
timed out); what happens when a run fails (recorded, the others still run) or the command is
stopped -- Ctrl-C or SIGTERM (from ``kill``, ``timeout``, a job scheduler): every worker
process is stopped, the records so far are kept, including the interrupted run's history up
to that moment, and written; and the outputs: ``results.json`` after every run (so even a
killed command leaves what had finished), the plots after the last run (or the interruption),
the table printed at the end. ``results.json`` also records where the time went
(``timing``: pool start-up, training, per-run overhead, and the machine's load average).

Exit codes: 0 all runs finished, 1 some run failed, 130 Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import torch

from distoptim._version import __version__
from distoptim.cli import algorithms
from distoptim.cli.arguments import RESULTS_JSON, Plan
from distoptim.cli.pool import ProcessPool
from distoptim.cli.progress import EventQueue, LineSink, ProgressDisplay
from distoptim.cli.record import RunRecord, partial_record
from distoptim.cli.report import (
    assign_targets,
    assign_temporal_efficiency,
    render_table,
    summarize,
    write_results,
)
from distoptim.cli.run import run_on_pool, run_torchrun
from distoptim.cli.training import use_link

__all__ = [
    "PLOT_PNG",
    "RESULTS_JSON",
    "Terminated",
    "exit_code",
    "one_line",
    "run_plan",
    "run_torchrun_plan",
    "sigterm_as_interrupt",
    "write_outputs",
]

PLOT_PNG = "accuracy_vs_time.png"


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: handled like Ctrl-C (everything stops, results are kept), exit 143."""


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, 143 (128 + SIGTERM) for :class:`Terminated`."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated()


@contextlib.contextmanager
def _signal_handlers(handlers: dict[signal.Signals, Any]) -> Iterator[None]:
    """``handlers`` installed while inside, the previous ones restored after (main thread
    only: elsewhere nothing changes)."""
    try:
        previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def sigterm_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread (like Ctrl-C)."""
    return _signal_handlers({signal.SIGTERM: _raise_terminated})


def _signals_held() -> contextlib.AbstractContextManager[None]:
    """Hold off a second Ctrl-C / SIGTERM while results are being written (a second or so)."""
    return _signal_handlers({signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN})


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (a run's failure in the progress and on stderr)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _meta(
    plan: Plan, argv: Sequence[str], status: str, timing: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "distoptim_version": __version__,
        "command": ["distoptim", *argv],
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "status": status,
        "dataset": plan.data.describe(),
        "link": plan.link,
        "notes": plan.notes,
        "target_acc": plan.target_acc,
        "target_loss": plan.target_loss,
        "oversubscription": plan.oversubscription,
        "timing": timing,
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def write_outputs(
    plan: Plan,
    records: Sequence[RunRecord],
    argv: Sequence[str],
    status: str,
    timing: _Timing | None = None,
    plots: bool = True,
) -> tuple[str, list[str]]:
    """Write ``results.json`` (and the plots when ``plots``) under ``plan.out``; the JSON's
    path and every plot written."""
    from distoptim.cli.plot import plot_runs

    os.makedirs(plan.out, exist_ok=True)
    assign_temporal_efficiency(records)
    assign_targets(records, plan.target)
    pngs: list[str] = []
    if plots:  # first, so that the timing written below includes them
        title = plan.data.name
        if plan.link:
            mbps = plan.link["mbps"]
            title += f" (emulated link {plan.link['latency_ms']:g} ms, "
            title += "unlimited" if mbps is None else f"{mbps:g} Mbit/s"
            title += ")"
        pngs = plot_runs(records, plan.out, title, plan.data.baseline)
    json_path = os.path.join(plan.out, RESULTS_JSON)
    meta = _meta(plan, argv, status, None if timing is None else timing.as_dict(records))
    write_results(json_path, records, meta, plan.footer)
    return json_path, pngs


def _summary_line(rec: RunRecord, verbose: bool) -> str:
    if not verbose:  # the bar already shows the accuracy
        return "done"
    acc = "-" if rec.val_acc is None else f"{100 * rec.val_acc:.1f}%"
    return f"done in {rec.wall_time_s or 0:.1f} s, val acc {acc}"


class _Timing:
    """Where a command's time went, for ``results.json`` and the line under the table."""

    def __init__(self, pool_size: int, started: float | None) -> None:
        self.started = time.monotonic() if started is None else started
        self.load_start = _load()
        self.pool_size = pool_size
        self.pool_starts: list[float] = []

    def as_dict(self, records: Sequence[RunRecord]) -> dict[str, Any]:
        total = time.monotonic() - self.started
        training = sum(r.wall_time_s or 0.0 for r in records)
        return {
            "total_s": total,
            "training_s": training,
            "startup_share": None if total <= 0 else max(0.0, 1.0 - training / total),
            "pool_processes": self.pool_size,
            "pool_start_s": self.pool_starts,
            "run_startup_s": sum(r.startup_s or 0.0 for r in records),
            "run_overhead_s": sum(r.overhead_s or 0.0 for r in records),
            "load_average": {"start": self.load_start, "end": _load()},
            "cpus": os.cpu_count(),
        }


def _load() -> list[float] | None:
    with contextlib.suppress(OSError, AttributeError):
        return [round(x, 2) for x in os.getloadavg()]
    return None


def _timing_line(t: dict[str, Any]) -> str:
    share = t["startup_share"]
    return (
        f"time: {t['total_s']:.1f} s in all, {t['training_s']:.1f} s training "
        f"({'-' if share is None else f'{100 * (1 - share):.0f}'} %); pool of "
        f"{t['pool_processes']} process{'es' if t['pool_processes'] != 1 else ''} started "
        f"in {sum(t['pool_start_s']):.1f} s; "
        f"load average {t['load_average']['start']} -> {t['load_average']['end']}"
    )


def run_plan(
    plan: Plan,
    argv: Sequence[str],
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    started: float | None = None,
) -> int:
    """Run every config of ``plan`` in order on one process pool; write outputs; print the
    table. Returns the exit code. Call under :func:`sigterm_as_interrupt` for SIGTERM.

    ``started``: ``time.monotonic()`` when the command began (checks and data loading count
    in ``timing.total_s``); default now."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    for note in plan.notes:
        print(f"distoptim: {note}", file=stderr)
    display = ProgressDisplay(plan.progress, stderr)
    labels = [algorithms.label(c) for c in plan.configs]
    totals = [plan.data.total_samples(c) for c in plan.configs]
    timing = _Timing(max(algorithms.processes_of(c) for c in plan.configs), started)
    records: list[RunRecord] = []
    interrupt: KeyboardInterrupt | None = None
    failed = False
    pool: ProcessPool | None = None
    events: EventQueue | None = None
    json_path, pngs = None, []
    with display.session(labels, totals):
        try:
            for i, cfg in enumerate(plan.configs):
                record: RunRecord | None = None
                error: BaseException | None = None
                if pool is None or not pool.alive:
                    pool, events = _start_pool(plan, timing, display, pool, events)
                with display.run(i, labels[i], totals[i]) as progress:
                    try:
                        record = run_on_pool(cfg, i, pool, plan.data)
                    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM
                        error = interrupt = exc
                    except Exception as exc:  # a failed run is recorded; the others still run
                        error, failed = exc, True
                    if record is None and events is not None:
                        events.flush()  # the pool is stopped: what its processes sent is here
                if record is None:
                    assert error is not None
                    status = "interrupted" if interrupt else "failed"
                    text = (
                        f"interrupted by {'SIGTERM' if isinstance(error, Terminated) else 'Ctrl-C'}"
                        if interrupt
                        else one_line(error)
                    )
                    record = partial_record(cfg, progress.events, status, text)
                    shown = status if interrupt or display.mode != "plain" else f"failed: {text}"
                    progress.finished(shown)
                    if not interrupt:
                        print(f"distoptim: run '{labels[i]}' failed: {text}", file=stderr)
                else:
                    progress.acc = record.val_acc
                    progress.finished(_summary_line(record, display.mode == "plain"))
                records.append(record)
                last = interrupt is not None or i + 1 == len(plan.configs)
                if last:  # before the last write, so that its timing includes the shut-down
                    _release(pool, events, interrupt is not None)
                    pool = events = None
                with _signals_held():
                    if interrupt:
                        state = "interrupted"
                    elif not last:
                        state = "running"  # rewritten after the next run
                    else:
                        state = "failed" if failed else "complete"
                    json_path, pngs = write_outputs(plan, records, argv, state, timing, last)
                if interrupt:
                    break
        finally:
            _release(pool, events, interrupt is not None)
    rows = summarize(records)
    render_table(rows, stdout, plan.footer)
    print(_timing_line(timing.as_dict(records)), file=stdout)
    _print_files(json_path, pngs, stdout)
    if interrupt is not None:
        print("distoptim: interrupted; the runs so far are in the results above", file=stderr)
        return exit_code(interrupt)
    return 1 if failed else 0


def _print_files(json_path: str | None, pngs: Sequence[str], stream: TextIO) -> None:
    """Every file the command wrote, one line each."""
    print(f"results: {json_path}", file=stream)
    for png in pngs:
        print(f"plot:    {png}", file=stream)


def _release(pool: ProcessPool | None, events: EventQueue | None, interrupted: bool) -> None:
    """End the pool (normally, or at once after an interruption) and its event queue."""
    if pool is not None:
        pool.kill() if interrupted else pool.close()
    if events is not None:
        events.close()


def _start_pool(
    plan: Plan,
    timing: _Timing,
    display: ProgressDisplay,
    old: ProcessPool | None,
    old_events: EventQueue | None,
) -> tuple[ProcessPool, EventQueue]:
    """A new pool (and progress queue) for the runs to come; the broken ones are released."""
    if old_events is not None:
        old_events.close()
    again = " again (the last run stopped the old one)" if old is not None else ""
    display.note(
        f"distoptim: starting {timing.pool_size} worker process"
        f"{'es' if timing.pool_size != 1 else ''}{again}; they serve all {len(plan.configs)} "
        "run(s)…"
    )
    events = EventQueue(display.deliver)
    pool = ProcessPool(
        timing.pool_size,
        (plan.data, events.queue, plan.link_env),
        lifetime=sum(c.timeout for c in plan.configs) + 600.0,
    )
    try:
        timing.pool_starts.append(pool.start())
    except BaseException:
        events.close()
        raise
    display.note(f"distoptim: worker processes ready in {timing.pool_starts[-1]:.1f} s")
    return pool, events


def run_torchrun_plan(plan: Plan, argv: Sequence[str]) -> int:
    """This process is one rank of a torchrun job; the reporting rank (collective: rank 0;
    server: the chief, the first worker) writes the outputs and prints the table."""
    cfg = plan.configs[0]
    sink = None
    if plan.progress != "none":  # only the reporting rank uses it
        sink = LineSink(f"{algorithms.label(cfg)} (torchrun)", plan.data.total_samples(cfg))
        sink.set_world(cfg.workers)
    use_link(plan.link_env)
    try:
        record = run_torchrun(cfg, plan.data, sink)
    except KeyboardInterrupt as exc:
        return exit_code(exc)
    if record is None:  # not the reporting rank
        return 0
    json_path, pngs = write_outputs(plan, [record], argv, "complete")
    render_table(summarize([record]), sys.stdout, plan.footer)
    _print_files(json_path, pngs, sys.stdout)
    return 0
