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
raised; the caller starts a new pool for the next run.

Signals. Pool processes ignore ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` -- a Ctrl-C or a closed
terminal reaches the whole process group -- and start with them blocked, so that one arriving
while a process is still starting does not kill it mid-import either: the parent decides (it
stops them, after keeping what they reported); they still die with the parent.

Starting. The processes belong to a :class:`~distoptim.launch.ProcessSupervisor` the pool
holds (they die with the parent; none outlives the pool), watched by a background thread. A
process starts with only what cannot travel later (``inherit``: multiprocessing queues and
locks); the rest of the context goes down its pipe once it is ready. So starting a process
never waits for it to read a large context, the processes import torch side by side, and
:meth:`ProcessPool.kill` can stop every one of them at any moment, start-up included.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import torch

from distoptim.checks import check_int
from distoptim.cli.stopping import STOP_SIGNALS, signals_held
from distoptim.launch import (
    DEFAULT_GRACE,
    ProcessOutcome,
    ProcessSupervisor,
    ProcessTimeoutError,
    RankFailedError,
    from_bytes,
    is_peer_failure,
    root_cause,
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


def _serve(conn: Connection, inherited: tuple[Any, ...] | None) -> None:
    """A pool process: announce itself, take the context, then run tasks until told to stop
    (None) or EOF. ``inherited``: the context's ``inherit`` entries (None elsewhere)."""
    for sig in STOP_SIGNALS:  # ignored first: one that arrived while blocked is discarded
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    conn.send(("ready", os.getpid()))
    context = conn.recv()
    if inherited is not None:
        context = tuple(i if i is not None else c for i, c in zip(inherited, context))
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
    is every task's first argument. ``inherit``: the positions of a tuple ``context`` that hold
    multiprocessing queues or locks (they can only be handed over when a process starts; the
    rest follows once it is ready). ``env``: variables the processes have from their first
    instruction (read by libraries as they load, e.g. ``TORCH_CPP_LOG_LEVEL``). ``lifetime``
    bounds how long the pool may exist at all (a backstop; each :meth:`run` has its own
    deadline). :meth:`start` it; end it with :meth:`close` (normal) or :meth:`kill`.
    """

    def __init__(
        self,
        size: int,
        context: Any = None,
        *,
        lifetime: float = 86_400.0,
        inherit: Sequence[int] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.size = check_int("pool size", size, 1)
        inherit = sorted({check_int("inherit", i, 0) for i in inherit})
        if inherit and not (isinstance(context, tuple) and inherit[-1] < len(context)):
            raise ValueError(
                f"inherit {inherit} names positions of a tuple context; got "
                f"{type(context).__name__}"
                + (f" of {len(context)}" if isinstance(context, tuple) else "")
            )
        self._context = context
        self._inherit = inherit
        self._env = dict(env or {})
        self._lifetime = lifetime
        self._sup: ProcessSupervisor | None = None
        self._conns: list[Connection] = []
        self._pids: list[int] = []
        self._thread: threading.Thread | None = None
        self._broken: str | None = None
        self.failure: BaseException | None = None
        """Why the pool's processes ended, when one died or failed (else None)."""
        self.startup_s: float | None = None
        """Seconds :meth:`start` took (processes started and torch imported)."""

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._broken is None

    def start(self) -> float:
        """Start the processes and wait until every one is ready; returns the seconds taken.

        Interruptible at any point (Ctrl-C, SIGTERM): every process started so far is killed
        before the exception leaves. A process that fails while starting raises
        :class:`PoolBrokenError` (``failure``: what its supervisor raised)."""
        t0 = time.monotonic()
        ctx = mp.get_context("spawn")
        pairs = [ctx.Pipe(duplex=True) for _ in range(self.size)]
        self._conns = [parent for parent, _ in pairs]
        children = [child for _, child in pairs]
        sent, inherited = self._context, None
        if self._inherit:
            inherited = tuple(c if i in self._inherit else None for i, c in enumerate(sent))
            sent = tuple(None if i in self._inherit else c for i, c in enumerate(sent))
        self._sup = ProcessSupervisor(timeout=self._lifetime, num_threads=1)
        try:
            # the mask is inherited by the children (see _serve); the handlers wait, so that
            # a stop never falls between starting a process and writing what it must read
            with _blocked(STOP_SIGNALS), signals_held() as held:
                for i, child in enumerate(children):
                    name = f"pool process {i}"
                    self._sup.add(_serve, (child, inherited), name=name, env=self._env)
            held.deliver()
            for child in children:  # the children hold their ends now: EOF means death
                child.close()
            self._thread = threading.Thread(target=self._host, name="distoptim-pool", daemon=True)
            self._thread.start()
            self._pids = self._await_ready(sent)
        except BaseException:
            self.kill()
            raise
        finally:
            for child in children:
                child.close()
        self.startup_s = time.monotonic() - t0
        return self.startup_s

    def _host(self) -> None:
        """The background thread: the supervisor watches the processes until they end."""
        assert self._sup is not None
        try:
            self._sup.run()
        except BaseException as exc:  # a death, or the lifetime passed: the pool is over
            self.failure = exc
            self._broken = self._broken or f"{type(exc).__name__}: {exc}".splitlines()[0]
        else:
            self._broken = self._broken or "the pool was closed"

    def _await_ready(self, context: Any) -> list[int]:
        """Wait for each process's ``ready``, send it the context; their pids in order."""
        pending = dict(enumerate(self._conns))
        pids: dict[int, int] = {}
        deadline = time.monotonic() + _READY_TIMEOUT
        while pending:
            left = deadline - time.monotonic()
            if self._broken is not None:
                raise PoolBrokenError(
                    f"a pool process failed while starting: {self._broken}"
                ) from self.failure
            if left <= 0:
                raise PoolBrokenError(
                    f"the pool's processes did not start within {_READY_TIMEOUT:g}s"
                )
            for conn in wait(list(pending.values()), timeout=min(left, 1.0)):
                i = next(k for k, c in pending.items() if c is conn)
                try:
                    _, pids[i] = conn.recv()
                    conn.send(context)
                except (EOFError, OSError):  # it died: the supervisor says why (next turn)
                    assert self._thread is not None
                    self._thread.join(timeout=_READY_TIMEOUT)
                    raise PoolBrokenError(
                        f"a pool process failed while starting: {self._broken or 'it died'}"
                    ) from self.failure
                del pending[i]
        return [pids[i] for i in range(self.size)]

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
            self.kill()
            return
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        self._thread.join(timeout=30.0)
        if self._thread.is_alive():
            self.kill()
        self._finish()

    def kill(self) -> None:
        """Kill every process at once (SIGKILL), started or still starting, and reap them."""
        self._broken = self._broken or "the pool was stopped"
        if self._sup is not None:
            self._sup.close(grace=0.0)
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        self._finish()

    def _finish(self) -> None:
        self._broken = self._broken or "the pool was closed"
        for conn in self._conns:
            conn.close()
        self._conns, self._pids = [], []


@contextlib.contextmanager
def _blocked(signals: Sequence[signal.Signals]) -> Iterator[None]:
    """``signals`` blocked in this thread while inside (a process started meanwhile starts
    with them blocked); one that arrives meanwhile is delivered when the block ends."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
