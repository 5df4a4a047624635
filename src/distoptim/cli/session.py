"""Running a plan: the pool, the runs one after another, live progress, and the outputs.

Owns: the order of runs; the process pool they share (started once, before the first run,
sized for the largest run; started again only after a run broke it -- a process died, a run
timed out); what happens when a run fails (recorded, the others still run), when the pool's
processes cannot start (one line, exit 1), or when the command is stopped -- Ctrl-C, SIGTERM
(from ``kill``, ``timeout``, a job scheduler) or SIGHUP (a closed terminal), at any phase, the
pool's start-up included (``distoptim.cli.stopping``): every worker process is stopped, the
records so far are kept, including the interrupted run's history up to that moment, and
written; and the outputs: ``results.json`` after every run (so even a killed command leaves
what had finished), the plots after the last run (or the interruption), the table printed at
the end. ``results.json`` also records where the time went (``timing``: pool start-up,
training, per-run overhead, and the machine's load average).

Exit codes: 0 all runs finished, 1 some run failed (or the pool could not start), 130 Ctrl-C,
143 SIGTERM, 129 SIGHUP.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import torch

from distoptim._version import __version__
from distoptim.cli import algorithms
from distoptim.cli.arguments import RESULTS_JSON, Plan
from distoptim.cli.pool import PoolBrokenError, ProcessPool
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
from distoptim.cli.stopping import (
    exit_code,
    print_or_drop,
    signals_held,
    stop_reason,
)
from distoptim.cli.training import use_link

__all__ = [
    "PLOT_PNG",
    "RESULTS_JSON",
    "one_line",
    "run_plan",
    "run_torchrun_plan",
    "write_outputs",
]

PLOT_PNG = "accuracy_vs_time.png"

_QUIET_CPP = {"TORCH_CPP_LOG_LEVEL": "ERROR"}
"""The worker processes' C++ log level (unless the user sets one). torch's C++ warnings there
are the expected side of a run's own retries -- a store wait that times out while a
parameter-server shard is still accepting connections (c10d's ``waitForInput ... likely a
timeout``, at 8 workers on a loaded machine) -- and say nothing a failure would not say as a
Python exception naming its rank; errors still print."""


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (a run's failure in the progress and on stderr)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _meta(
    plan: Plan,
    argv: Sequence[str],
    status: str,
    timing: dict[str, Any] | None,
    error: str | None = None,
) -> dict[str, Any]:
    return {
        "distoptim_version": __version__,
        "command": ["distoptim", *argv],
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "status": status,
        "error": error,
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
    error: str | None = None,
) -> tuple[str, list[str]]:
    """Write ``results.json`` (and the plots when ``plots``) under ``plan.out``; the JSON's
    path and every plot written. ``error``: why the command failed outside any run (the pool
    could not start)."""
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
    meta = _meta(plan, argv, status, None if timing is None else timing.as_dict(records), error)
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
    table. Returns the exit code. Call under
    :func:`~distoptim.cli.stopping.signals_as_interrupt`, so that SIGTERM and SIGHUP stop it
    like Ctrl-C.

    ``started``: ``time.monotonic()`` when the command began (checks and data loading count
    in ``timing.total_s``); default now."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    for note in plan.notes:
        print_or_drop(f"distoptim: {note}", stderr)
    display = ProgressDisplay(plan.progress, stderr)
    labels = [algorithms.label(c) for c in plan.configs]
    totals = [plan.data.total_samples(c) for c in plan.configs]
    timing = _Timing(max(algorithms.processes_of(c) for c in plan.configs), started)
    state = _Progress(plan, argv, timing, stderr)
    with display.session(labels, totals):
        try:
            for i, cfg in enumerate(plan.configs):
                if state.pool is None or not state.pool.alive:
                    state.pool, state.events = _start_pool(
                        plan, timing, display, state.pool, state.events
                    )
                with display.run(i, labels[i], totals[i]) as progress:
                    state.run(cfg, progress, labels[i], display)
                if state.interrupt is not None:
                    break
                if i + 1 < len(plan.configs):
                    state.write("running", plots=False)  # rewritten after the next run
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: at any phase
            state.interrupt = state.interrupt or exc
        except PoolBrokenError as exc:  # the processes could not start: no run can
            cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
            state.error = f"the worker processes could not start: {str(cause).splitlines()[0]}"
            print_or_drop(f"distoptim: {state.error}", stderr)
        finally:
            state.release()
        status = "failed" if state.failed or state.error else "complete"
        state.write("interrupted" if state.interrupt else status, plots=True)
    rows = summarize(state.records)
    with contextlib.suppress(OSError, ValueError):  # a closed terminal: the files are written
        render_table(rows, stdout, plan.footer)
    print_or_drop(_timing_line(timing.as_dict(state.records)), stdout)
    _print_files(state.json_path, state.pngs, stdout)
    if state.interrupt is not None:
        print_or_drop("distoptim: interrupted; the runs so far are in the results above", stderr)
        return exit_code(state.interrupt)
    return 1 if state.failed or state.error else 0


class _Progress:
    """Where :func:`run_plan` stands: the records so far, the pool, how the command ends."""

    def __init__(self, plan: Plan, argv: Sequence[str], timing: _Timing, stderr: TextIO) -> None:
        self.plan = plan
        self.argv = argv
        self.timing = timing
        self.stderr = stderr
        self.records: list[RunRecord] = []
        self.pool: ProcessPool | None = None
        self.events: EventQueue | None = None
        self.interrupt: KeyboardInterrupt | None = None
        self.failed = False
        self.error: str | None = None
        self.json_path: str | None = None
        self.pngs: list[str] = []

    def run(self, cfg: Any, progress: Any, label: str, display: ProgressDisplay) -> None:
        """Run ``cfg`` on the pool; keep its record, or what it got to (failed, stopped)."""
        assert self.pool is not None
        record: RunRecord | None = None
        error: BaseException | None = None
        try:
            record = run_on_pool(cfg, progress.index, self.pool, self.plan.data)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP
            error = self.interrupt = exc
        except Exception as exc:  # a failed run is recorded; the others still run
            error, self.failed = exc, True
        if record is None and self.events is not None:
            self.events.flush()  # the pool is stopped: what its processes sent is here
        if record is None:
            assert error is not None
            stopped = isinstance(error, KeyboardInterrupt)
            text = f"interrupted by {stop_reason(error)}" if stopped else one_line(error)
            status = "interrupted" if stopped else "failed"
            record = partial_record(cfg, progress.events, status, text)
            shown = status if stopped or display.mode != "plain" else f"failed: {text}"
            progress.finished(shown)
            if not stopped:
                print_or_drop(f"distoptim: run '{label}' failed: {text}", self.stderr)
        else:
            progress.acc = record.val_acc
            progress.finished(_summary_line(record, display.mode == "plain"))
        self.records.append(record)

    def release(self) -> None:
        """End the pool: at once after a stop or a broken start, normally otherwise."""
        _release(self.pool, self.events, self.interrupt is not None)
        self.pool = self.events = None

    def write(self, status: str, plots: bool) -> None:
        """Write the outputs, holding the stop signals meanwhile; one that came is acted on:
        mid-grid it stops the command (raised), at the end it sets the exit code."""
        with signals_held() as held:
            self.json_path, pngs = write_outputs(
                self.plan, self.records, self.argv, status, self.timing, plots, self.error
            )
            self.pngs = pngs or self.pngs
        came = held.interrupt()
        if came is None:
            return
        if status == "running":
            raise came
        self.interrupt = self.interrupt or came


def _print_files(json_path: str | None, pngs: Sequence[str], stream: TextIO) -> None:
    """Every file the command wrote, one line each (dropped on a closed terminal)."""
    print_or_drop(f"results: {json_path}", stream)
    for png in pngs:
        print_or_drop(f"plot:    {png}", stream)


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
        inherit=(1,),  # the queue; the data follows once each process is ready
        env=_QUIET_CPP if "TORCH_CPP_LOG_LEVEL" not in os.environ else None,
    )
    try:
        timing.pool_starts.append(pool.start())
        display.note(f"distoptim: worker processes ready in {timing.pool_starts[-1]:.1f} s")
    except BaseException:  # a stop (Ctrl-C...) or a failed start: nothing is left running
        pool.kill()
        events.close()
        raise
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
