"""A pool of worker processes started once per command and reused by every run of a grid.

Owns: starting ``size`` processes once, handing each run's task to the first ``k`` of them,
collecting what they return within a deadline, and ending the pool when it can no longer be
trusted. It knows nothing about training: a task is ``fn(context, *args)`` with a module-level
``fn``.

Why: starting a Python process that imports torch costs seconds; a grid of 27 short runs that
starts fresh processes for each run spends most of its time starting them. The pool pays that
once.

Clean state between runs. Each task runs with

* the environment of the parent at pool start plus the task's ``env`` (e.g. the torchrun
  variables of that run's process group); the task's variables are removed again after it;
* ``torch.set_num_threads(threads)`` for that run (the cores divided among its processes);
* every random generator seeded from the task's ``seed`` (``torch``, ``numpy``, ``random``);
* whatever process group or parameter-server cluster the task needs created inside the task
  and destroyed before it returns (a fresh rendezvous store, on a fresh port, per run).

Failure. A task that raises is reported as a failed :class:`~distoptim.launch.ProcessOutcome`
(with the time it failed and whether its exception is a peer's consequence,
:func:`~distoptim.launch.is_peer_failure`); the process stays usable. When the tasks wait for
each other (``fail_fast``), the first failure is often not the cause: a rank that raises tears
its process group down and its peers fail a moment later with gloo's "Connection closed by
peer" -- and their report may arrive first. So after the first failure the pool waits a short
grace period (``grace``, ending early once every task has answered) and raises
:class:`~distoptim.launch.RankFailedError` for the root cause
(:func:`~distoptim.launch.root_cause`: an exception raised in user code before a death, before
a peer's consequence), the other failures listed after it. A process that dies, or a run that
passes its deadline, ends the whole pool: every process is killed (``SIGKILL``, by the ids they
reported) and :class:`PoolBrokenError` / :class:`~distoptim.launch.ProcessTimeoutError` is
raised; the caller starts a new pool for the next run. Pool processes ignore ``SIGINT`` and
``SIGTERM``: the parent decides (it stops them, after keeping what they reported); they still
die with the parent (``distoptim.launch.run_processes``).

The processes are started by :func:`distoptim.launch.run_processes` in a background thread, so
they die with the parent and none outlives the pool.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import random
import signal
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import torch

from distoptim.checks import check_int
from distoptim.launch import (
    DEFAULT_GRACE,
    ProcessOutcome,
    ProcessTimeoutError,
    RankFailedError,
    from_bytes,
    is_peer_failure,
    root_cause,
    run_processes,
    to_bytes,
)

__all__ = ["PoolBrokenError", "ProcessPool", "Task"]

_READY_TIMEOUT = 300.0
"""Seconds the pool's processes may take to start and import torch (a loaded machine)."""


class PoolBrokenError(RuntimeError):
    """A pool process died (or the pool was stopped); the pool cannot run anything more."""


class Task:
    """One process's part of a run: ``fn(context, *args)`` with ``env``, ``threads``, ``seed``."""

    __slots__ = ("args", "env", "fn", "seed", "threads")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        env: Mapping[str, str] | None = None,
        threads: int = 1,
        seed: int = 0,
    ) -> None:
        self.fn = fn
        self.args = tuple(args)
        self.env = dict(env or {})
        self.threads = max(1, int(threads))
        self.seed = int(seed)


@dataclass
class _Reply:
    """Child -> parent, one per task: its value (``ok``), or what it raised and when."""

    ok: bool
    blob: bytes | None  # the value (to_bytes), or the pickled exception when it pickles
    traceback: str | None = None
    failed_at: float | None = None  # time.time() when the exception reached the task's frame
    secondary: bool = False  # is_peer_failure(exception): a consequence of a peer's failure


# ---------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------
def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _run_task(task: Task, context: Any) -> _Reply:
    added = {k for k in task.env if k not in os.environ}
    before = {k: os.environ[k] for k in task.env if k in os.environ}
    os.environ.update(task.env)
    torch.set_num_threads(task.threads)
    _seed_everything(task.seed)
    try:
        return _Reply(True, to_bytes(task.fn(context, *task.args)))
    except BaseException as exc:  # report everything; the process stays in the pool
        at = time.time()
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = None
        return _Reply(False, blob, tb, at, is_peer_failure(exc))
    finally:
        for k in added:
            os.environ.pop(k, None)
        os.environ.update(before)


def _serve(conn: Connection, context: Any) -> None:
    """A pool process: announce itself, then run tasks until told to stop (None) or EOF."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent closed the pool
            return
        if task is None:
            return
        conn.send(_run_task(task, context))


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
class ProcessPool:
    """``size`` long-lived processes; :meth:`run` gives one task to each of the first ``k``.

    ``context`` (picklable, e.g. the dataset and a progress queue) is sent once, at start, and
    is every task's first argument. ``lifetime`` bounds how long the pool may exist at all (a
    backstop; each :meth:`run` has its own deadline). :meth:`start` it; end it with
    :meth:`close` (normal) or :meth:`kill`.
    """

    def __init__(self, size: int, context: Any = None, *, lifetime: float = 86_400.0) -> None:
        self.size = check_int("pool size", size, 1)
        self._context = context
        self._lifetime = lifetime
        self._conns: list[Connection] = []
        self._pids: list[int] = []
        self._pidfds: list[int] = []
        self._thread: threading.Thread | None = None
        self._broken: str | None = None
        self.startup_s: float | None = None
        """Seconds :meth:`start` took (processes started and torch imported)."""

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._broken is None

    def start(self) -> float:
        """Start the processes and wait until every one is ready; returns the seconds taken."""
        t0 = time.monotonic()
        ctx = mp.get_context("spawn")
        pairs = [ctx.Pipe(duplex=True) for _ in range(self.size)]
        self._conns = [parent for parent, _ in pairs]
        children = [child for _, child in pairs]

        def _host() -> None:
            try:
                run_processes(
                    _serve,
                    [(child, self._context) for child in children],
                    timeout=self._lifetime,
                    names=[f"pool process {i}" for i in range(self.size)],
                    num_threads=1,
                )
            except BaseException as exc:  # a death, or the lifetime passed: the pool is over
                self._broken = self._broken or f"{type(exc).__name__}: {exc}".splitlines()[0]
            else:
                self._broken = self._broken or "the pool was closed"

        self._thread = threading.Thread(target=_host, name="distoptim-pool", daemon=True)
        self._thread.start()
        try:
            pending = dict(enumerate(self._conns))
            pids: dict[int, int] = {}
            deadline = time.monotonic() + _READY_TIMEOUT
            while pending:
                left = deadline - time.monotonic()
                if left <= 0 or self._broken is not None:
                    raise PoolBrokenError(
                        f"the pool's processes did not start within {_READY_TIMEOUT:g}s"
                        if self._broken is None
                        else f"a pool process failed while starting: {self._broken}"
                    )
                for conn in wait(list(pending.values()), timeout=min(left, 1.0)):
                    i = next(k for k, c in pending.items() if c is conn)
                    _, pid = conn.recv()
                    pids[i] = pid
                    del pending[i]
            self._pids = [pids[i] for i in range(self.size)]
            # a pidfd names the process itself, not its number: signalling it can never hit
            # another process that got the same pid after ours was reaped
            self._pidfds = [os.pidfd_open(pid) for pid in self._pids]
        except BaseException:
            self.kill()
            raise
        finally:
            for child in children:  # the children hold their ends now: EOF means death
                child.close()
        self.startup_s = time.monotonic() - t0
        return self.startup_s

    def run(
        self,
        tasks: Sequence[Task],
        *,
        timeout: float,
        names: Sequence[str] | None = None,
        fail_fast: bool = True,
        grace: float = DEFAULT_GRACE,
    ) -> list[ProcessOutcome]:
        """Run ``tasks[i]`` on pool process ``i``; return their outcomes in order.

        ``fail_fast=True`` (processes that wait for each other, e.g. one process group): a task
        that raises ends the run -- after ``grace`` seconds for the others' answers (less once
        all have answered), the pool is killed and :class:`~distoptim.launch.RankFailedError`
        raised for the root cause, the other failures listed after it (module doc).
        ``fail_fast=False``: failed tasks are returned as outcomes and the others run on. A
        process that dies raises :class:`PoolBrokenError` (during the grace period it counts as
        one more failure); passing ``timeout`` seconds raises
        :class:`~distoptim.launch.ProcessTimeoutError`; both kill the pool, as does any
        exception (Ctrl-C included) while waiting.
        """
        if not self.alive:
            raise PoolBrokenError(f"the pool cannot run tasks: {self._broken or 'not started'}")
        if not 1 <= len(tasks) <= self.size:
            raise ValueError(f"a run needs 1..{self.size} processes, got {len(tasks)}")
        names = list(names) if names is not None else [f"rank {i}" for i in range(len(tasks))]
        outcomes: list[ProcessOutcome | None] = [None] * len(tasks)
        try:
            for conn, task in zip(self._conns, tasks):
                conn.send(task)
            deadline = time.monotonic() + timeout
            grace_until: float | None = None
            pending = dict(enumerate(self._conns[: len(tasks)]))
            while pending:
                now = time.monotonic()
                if grace_until is not None and now >= grace_until:
                    break
                if now >= deadline:
                    raise ProcessTimeoutError(timeout, [names[i] for i in sorted(pending)])
                until = deadline if grace_until is None else min(deadline, grace_until)
                for conn in wait(list(pending.values()), timeout=until - now):
                    i = next(k for k, c in pending.items() if c is conn)
                    del pending[i]
                    outcome = self._receive(i, names[i], conn, dying=grace_until is not None)
                    outcomes[i] = outcome
                    if not outcome.ok and fail_fast and grace_until is None:
                        grace_until = time.monotonic() + grace
            failures = [o for o in outcomes if o is not None and not o.ok]
            if fail_fast and failures:
                root = root_cause(failures)
                others = [o for o in failures if o is not root]
                raise RankFailedError(
                    root.index, root.name, root.headline(), root.error, others
                ) from root.exception
        except BaseException:
            self.kill()
            raise
        return [o for o in outcomes if o is not None]

    def _receive(self, i: int, name: str, conn: Connection, dying: bool) -> ProcessOutcome:
        """Process ``i``'s answer. Its death raises :class:`PoolBrokenError`, except while the
        run is already failing (``dying``): then it is one more failure, ranked by
        :func:`~distoptim.launch.root_cause` after any exception."""
        try:
            reply: _Reply = conn.recv()
        except (EOFError, OSError):
            text = f"{name} (pool process {i}, pid {self._pids[i]}) died during the run"
            if not dying:
                raise PoolBrokenError(text) from None
            return ProcessOutcome(i, name, False, error=text, failed_at=time.time())
        if reply.ok:
            return ProcessOutcome(i, name, True, value=from_bytes(reply.blob))
        exc = None
        if reply.blob is not None:
            with contextlib.suppress(Exception):
                exc = pickle.loads(reply.blob)
        return ProcessOutcome(
            i,
            name,
            False,
            error=reply.traceback,
            exception=exc,
            raised=True,
            secondary=reply.secondary,
            failed_at=reply.failed_at,
        )

    def close(self) -> None:
        """Stop the processes normally (each finishes its loop) and wait for them."""
        if self._thread is None:
            return
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        self._thread.join(timeout=30.0)
        if self._thread.is_alive():
            self.kill()
        self._finish()

    def kill(self) -> None:
        """Kill every process at once (SIGKILL, through a pidfd of each) and wait for them."""
        self._broken = self._broken or "the pool was stopped"
        for fd in self._pidfds:
            with contextlib.suppress(ProcessLookupError, OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        self._finish()

    def _finish(self) -> None:
        self._broken = self._broken or "the pool was closed"
        for conn in self._conns:
            conn.close()
        for fd in self._pidfds:
            os.close(fd)
        self._conns, self._pids, self._pidfds = [], [], []
