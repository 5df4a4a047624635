"""Progress of the runs: events from worker processes, and their display in the parent.

Owns: the progress events (a worker's :class:`Reporter` records them and, in a local run, puts
them on the pool's ``multiprocessing`` queue, which the parent drains: :class:`EventQueue`),
and the parent's display of them -- a live ``rich`` bar per run with samples done, training
loss and validation accuracy when the terminal can show one, plain lines otherwise, or
nothing.

Events are small dicts, all with ``kind``, ``worker`` (task index / rank), ``t`` (``time.time()``
of the worker), ``samples`` (samples that worker has processed), ``step`` (local steps it has
taken), ``bytes`` when the worker counts what it sends (the ``collective`` family: its
optimizer's ``comm_stats.bytes_sent``) and, locally, ``run`` (the run's index in the command):

* ``start``  -- the worker is ready and starts its clock;
* ``tick``   -- periodic, with ``loss``: mean training loss since the previous tick;
* ``eval``   -- one worker scored the current model: ``acc``, ``loss`` on validation;
* ``mark``   -- the other workers of a ``collective`` run, at the steps of the evaluations:
  their ``bytes`` at that step, so the group's bytes at each evaluation are exact;
* ``finish`` -- the worker's last step is done (``loss``: of its last tick).

The same events the parent sees live are returned by each worker with its result, so a run
that completes builds its history from the complete lists, and a run that is interrupted still
has everything that reached the parent.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue as queue_mod
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

__all__ = ["EventQueue", "LineSink", "ProgressDisplay", "Reporter", "RunProgress"]


class Reporter:
    """Worker side: records progress events and forwards them to ``sink`` (a queue) if given.

    ``run``: the index of the run in its command, carried by every event so that the parent
    can tell the runs of one pool apart (None under torchrun, where there is one run).
    ``sent``: the bytes this worker has sent so far, read at every event (None: not counted).
    """

    def __init__(
        self,
        sink: Any,
        worker: int,
        run: int | None = None,
        sent: Callable[[], int] | None = None,
    ) -> None:
        self.sink = sink
        self.worker = worker
        self.run = run
        self.sent = sent
        self.events: list[dict[str, Any]] = []
        self.samples = 0
        self.steps = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self._last_loss: float | None = None

    def _emit(self, kind: str, **fields: Any) -> None:
        event = {
            "kind": kind,
            "worker": self.worker,
            "t": time.time(),
            "samples": self.samples,
            "step": self.steps,
        }
        if self.sent is not None:
            event["bytes"] = int(self.sent())
        if self.run is not None:
            event["run"] = self.run
        event.update(fields)
        self.events.append(event)
        if self.sink is not None:
            with contextlib.suppress(Exception):  # the display is best effort, never fatal
                self.sink.put(event)

    def start(self) -> None:
        self._emit("start")

    def step(self, batch_samples: int, loss: float) -> None:
        self.samples += batch_samples
        self.steps += 1
        self._loss_sum += loss
        self._loss_n += 1

    def tick(self) -> None:
        if self._loss_n:
            self._last_loss = self._loss_sum / self._loss_n
        self._loss_sum, self._loss_n = 0.0, 0
        self._emit("tick", loss=self._last_loss)

    def evaluation(self, acc: float, loss: float) -> None:
        self._emit("eval", acc=acc, loss=loss)

    def mark(self) -> None:
        """Where this worker stands at another worker's evaluation (same ``step``)."""
        self._emit("mark")

    def finish(self) -> None:
        self._emit("finish", loss=self._last_loss)


class LineSink:
    """A sink for a worker's own events (under torchrun, where there is no parent process):
    prints a line at the first evaluation and at each quarter of the run."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self._world = 1
        self._quarter = -1

    def put(self, event: dict[str, Any]) -> None:
        if event["kind"] != "eval":
            return
        # this rank speaks for all: every worker processes about as many samples as it does
        done = min(1.0, event["samples"] * self._world / self.total)
        if int(4 * done) > self._quarter:
            self._quarter = int(4 * done)
            print(
                f"{self.label}: {100 * done:5.1f}% val acc {100 * event['acc']:.1f}% "
                f"(val loss {event['loss']:.3f})",
                file=self.stream,
                flush=True,
            )

    def set_world(self, world_size: int) -> None:
        self._world = world_size


def _fmt_pct(x: float | None) -> str:
    return "  -  " if x is None else f"{100 * x:5.1f}%"


def _fmt_loss(x: float | None) -> str:
    return "  -  " if x is None else f"{x:.3f}"


class EventQueue:
    """Parent side: the queue every process of a pool writes its events to, drained by a thread
    that hands each event to ``deliver`` (the display routes it to its run by ``run``)."""

    def __init__(self, deliver: Any) -> None:
        self.queue = mp.get_context("spawn").Queue()
        self._deliver = deliver
        self._stop = threading.Event()
        self._empty_seen = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name="progress-events", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            try:
                event = self.queue.get(timeout=0.05)
            except queue_mod.Empty:
                with self._cond:
                    self._empty_seen += 1
                    self._cond.notify_all()
                if self._stop.is_set():
                    return
                continue
            except Exception:  # (EOFError, OSError, ...) the queue is unusable: stop draining
                with self._cond:
                    self._empty_seen += 1
                    self._stop.set()
                    self._cond.notify_all()
                return
            self._deliver(event)

    def flush(self, timeout: float = 5.0) -> None:
        """Deliver everything already in the queue (the writers have stopped), then return."""
        with self._cond:
            seen = self._empty_seen
            self._cond.wait_for(
                lambda: self._empty_seen > seen or not self._thread.is_alive(), timeout=timeout
            )

    def close(self) -> None:
        """Stop the thread and release the queue (never blocks interpreter exit)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        with contextlib.suppress(Exception):
            self.queue.cancel_join_thread()
            self.queue.close()


class RunProgress:
    """Parent side of one run: the events that reached the parent and the figures shown."""

    def __init__(self, display: ProgressDisplay, index: int, label: str, total: int) -> None:
        self.display = display
        self.index = index
        self.label = label
        self.total = max(1, total)
        self.events: list[dict[str, Any]] = []
        self._per_worker: dict[int, int] = {}
        self.loss: float | None = None
        self.acc: float | None = None
        self._started = False

    @property
    def samples(self) -> int:
        return sum(self._per_worker.values())

    def _handle(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        w = event["worker"]
        self._per_worker[w] = max(self._per_worker.get(w, 0), int(event.get("samples", 0)))
        if event["kind"] in ("tick", "finish") and event.get("loss") is not None:
            self.loss = event["loss"]
        if event["kind"] == "eval":
            self.acc = event["acc"]
        # the first evaluation (made at step 0, as soon as the evaluating worker is ready)
        # marks the start: from then on the run has a history worth keeping
        if event["kind"] == "eval" and not self._started:
            self._started = True
            self.display._started(self)
        self.display._update(self)

    def __enter__(self) -> RunProgress:
        self.display._starting(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.display._detach(self)

    def finished(self, summary: str) -> None:
        """Mark the run done in the display with a one-line ``summary``."""
        self.display._finished(self, summary)


class ProgressDisplay:
    """The parent's display of all runs: ``mode`` is ``rich``, ``plain`` or ``none``.

    ``auto`` picks ``rich`` when ``stream`` is a terminal, ``plain`` otherwise.
    """

    def __init__(self, mode: str = "auto", stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "rich" if getattr(self.stream, "isatty", lambda: False)() else "plain"
        if mode not in ("rich", "plain", "none"):
            raise ValueError(f"progress mode must be auto, rich, plain or none, got {mode!r}")
        self.mode = mode
        self._progress: Any = None
        self._tasks: dict[int, Any] = {}
        self._plain_marks: dict[int, int] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._active: dict[int, RunProgress] = {}

    @contextlib.contextmanager
    def session(self, labels: list[str], totals: list[int]) -> Iterator[ProgressDisplay]:
        """Show one bar per run (``labels``) for the duration of the ``with`` block."""
        self._count = len(labels)
        if self.mode == "rich":
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=16),
                TaskProgressColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("val acc {task.fields[acc]}"),
                TimeElapsedColumn(),
                TextColumn("{task.fields[note]}"),
                console=Console(file=self.stream),
                refresh_per_second=8,
            )
            for i, (label, total) in enumerate(zip(labels, totals)):
                self._tasks[i] = self._progress.add_task(
                    label, total=max(1, total), loss="  -  ", acc="  -  ", note="", start=False
                )
            self._progress.start()
        try:
            yield self
        finally:
            if self._progress is not None:
                with contextlib.suppress(OSError, ValueError):  # a closed terminal (SIGHUP)
                    self._progress.stop()
                self._progress = None

    def run(self, index: int, label: str, total: int) -> RunProgress:
        """The progress of run ``index`` (use as a context manager around the run): events
        with ``run == index`` delivered meanwhile (:meth:`deliver`) go to it."""
        progress = RunProgress(self, index, label, total)
        with self._lock:
            self._active[index] = progress
        return progress

    def deliver(self, event: dict[str, Any]) -> None:
        """Hand a worker's event to the run it belongs to (late events of a closed run: none)."""
        with self._lock:
            progress = self._active.get(event.get("run", -1))
        if progress is not None:
            progress._handle(event)

    def note(self, text: str) -> None:
        """A line about what the command is doing (start-up, warnings), unless mode is none."""
        if self.mode == "rich" and self._progress is not None:
            self._progress.console.print(text)
        elif self.mode != "none":
            self._print(text)

    # -- called from RunProgress (drain thread or main thread) ---------------------------
    def _print(self, text: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):  # a closed terminal
            print(text, file=self.stream, flush=True)

    def _detach(self, run: RunProgress) -> None:
        with self._lock:
            self._active.pop(run.index, None)

    def _starting(self, run: RunProgress) -> None:
        if self.mode == "rich" and self._progress is not None:
            self._progress.update(self._tasks[run.index], note="starting…")
        elif self.mode == "plain":
            self._print(f"[{run.index + 1}/{self._count}] {run.label}: starting")

    def _started(self, run: RunProgress) -> None:
        if self.mode == "rich" and self._progress is not None:
            self._progress.update(self._tasks[run.index], note="")
            self._progress.start_task(self._tasks[run.index])
        elif self.mode == "plain":
            self._print(
                f"[{run.index + 1}/{self._count}] {run.label}: training started "
                f"(val acc {_fmt_pct(run.acc).strip()} at step 0)"
            )

    def _update(self, run: RunProgress) -> None:
        if self.mode == "rich" and self._progress is not None:
            self._progress.update(
                self._tasks[run.index],
                completed=min(run.samples, run.total),
                loss=_fmt_loss(run.loss),
                acc=_fmt_pct(run.acc),
            )
        elif self.mode == "plain":
            quarter = min(4, 4 * run.samples // run.total)
            if quarter > self._plain_marks.get(run.index, 0):
                self._plain_marks[run.index] = quarter
                if quarter < 4:
                    self._print(
                        f"[{run.index + 1}/{self._count}] {run.label}: {25 * quarter}% "
                        f"loss {_fmt_loss(run.loss).strip()} val acc {_fmt_pct(run.acc).strip()}"
                    )

    def _finished(self, run: RunProgress, summary: str) -> None:
        if self.mode == "rich" and self._progress is not None:
            self._progress.update(
                self._tasks[run.index],
                completed=run.total if summary.startswith("done") else run.samples,
                acc=_fmt_pct(run.acc),
                note=summary,
            )
            self._progress.stop_task(self._tasks[run.index])
        elif self.mode == "plain":
            self._print(f"[{run.index + 1}/{self._count}] {run.label}: {summary}")
