"""The parent side of a local run: :class:`ProcessSupervisor` and :func:`run_processes`.

Owns: starting processes (added while a run is under way, restarted when allowed), collecting
their outcomes within the timeout, turning deaths and hangs into errors that name the real
cause, and leaving no process behind.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from distoptim.checks import check_int, check_optional_int, check_seconds
from distoptim.launch.child import _child_main, _Result, _Started, from_bytes
from distoptim.launch.failures import (
    _BOOTSTRAP_EXIT,
    MainGuardError,
    ProcessOutcome,
    ProcessTimeoutError,
    RankFailedError,
    exit_if_bootstrapping,
    root_cause,
)
from distoptim.launch.start import DEFAULT_START_METHOD, StartMethod, resolve_start_method

DEFAULT_TIMEOUT = 300.0
"""Seconds a local run may take before every process is killed (and collective timeout)."""

DEFAULT_GRACE = 2.0
"""Seconds the parent waits, after a first failure, for the other processes' reports."""

RESTART_COUNT_ENV = "DISTOPTIM_RESTART_COUNT"
"""How many times this process was restarted by its :class:`ProcessSupervisor` (unset: never)."""

_KILL_GRACE = 5.0


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def _default_threads(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, nprocs))


def _stop(proc: mp.process.BaseProcess) -> None:
    """End ``proc``: SIGTERM, then SIGKILL after a grace period; always reaped."""
    if proc.is_alive():
        proc.terminate()
    proc.join(_KILL_GRACE)
    if proc.is_alive():
        proc.kill()
        proc.join(_KILL_GRACE)


@dataclass
class _Entry:
    """One supervised process (the parent's view)."""

    index: int
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    env: dict[str, str]
    restarts_left: int
    critical: bool
    proc: mp.process.BaseProcess | None = None
    conn: Connection | None = None
    restarts: int = 0
    started: bool = False  # the current process announced _Started
    outcome: ProcessOutcome | None = None  # final (after restarts)


class ProcessSupervisor:
    """Processes that run ``fn(*args)`` each, supervised until every one has ended.

    ``add(fn, args, ...)`` starts a process (also while :meth:`run` is waiting, from another
    thread); :meth:`run` waits until every process added so far has ended and returns their
    :class:`ProcessOutcome` in the order they were added. Per process:

    * ``restarts=N``: a failure (exception or death) restarts it, up to ``N`` times (see the
      module docstring); ``on_restart(outcome)`` hears of each restart.
    * ``critical=True``: its final failure ends the run: after the grace period (module
      docstring) every process is killed and :class:`RankFailedError` is raised for the root
      cause. ``critical=False``: the failure is recorded and ``on_failure(outcome)`` called;
      the others run on. A callback that raises ends the run with that exception.

    ``timeout`` bounds the whole run from the first :meth:`run` (:class:`ProcessTimeoutError`);
    on any exit (Ctrl-C included) no child is left running. ``num_threads``: torch intra-op
    threads per child (None: torch's default). ``start_method``: ``"forkserver"`` (forked
    from a server that imported torch once) or ``"spawn"`` (a fresh interpreter each; needed
    for variables read when a process starts, e.g. ``MALLOC_*``), see
    :mod:`distoptim.launch.start`. ``fn`` and arguments must be picklable; return values travel
    with ``torch.save``.
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        grace: float = DEFAULT_GRACE,
        num_threads: int | None = None,
        on_failure: Callable[[ProcessOutcome], None] | None = None,
        on_restart: Callable[[ProcessOutcome], None] | None = None,
        start_method: str | StartMethod = DEFAULT_START_METHOD,
    ) -> None:
        self.timeout = check_seconds("timeout", timeout)
        self.grace = check_seconds("grace", grace, allow_zero=True)
        self.num_threads = check_optional_int("num_threads", num_threads, 1)
        self.on_failure = on_failure
        self.on_restart = on_restart
        self.start_method = resolve_start_method(start_method)
        self._ctx = self.start_method.context()
        # the launcher holds the only write end, never writes: EOF in a child = launcher gone
        self._lifeline, self._lifeline_w = self._ctx.Pipe(duplex=False)
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self._wake_r, self._wake_w = os.pipe()
        self._closed = False
        self._released = False
        self._runner: threading.Thread | None = None  # the thread inside run(), if any

    # ---- starting -------------------------------------------------------------------------------
    def add(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        restarts: int = 0,
        critical: bool = True,
    ) -> int:
        """Start one process running ``fn(*args)``; returns its index (order of addition)."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        restarts = check_int("restarts", restarts, 0)
        exit_if_bootstrapping()
        with self._lock:
            if self._closed:
                raise RuntimeError("this supervisor has ended; start a new one")
            index = len(self._entries)
            entry = _Entry(
                index,
                name or f"rank {index}",
                fn,
                tuple(args),
                dict(env or {}),
                restarts,
                critical,
            )
            self._start(entry)
            self._entries.append(entry)
            os.write(self._wake_w, b"+")  # under the lock: close() cannot release it meanwhile
        return index

    def _start(self, entry: _Entry) -> None:
        recv, send = self._ctx.Pipe(duplex=False)
        env = dict(entry.env)
        if entry.restarts:
            env[RESTART_COUNT_ENV] = str(entry.restarts)
        entry.started = False
        method = self.start_method
        method.ready()
        proc = self._ctx.Process(
            target=_child_main,
            args=(
                send,
                entry.fn,
                entry.args,
                method.child_start(env),
                self.num_threads,
                self._lifeline,
            ),
            name=f"distoptim-{entry.name.replace(' ', '-')}",
        )
        with method.environ_at_start(env):  # spawn: in place when the interpreter starts
            proc.start()
        send.close()
        entry.proc, entry.conn = proc, recv

    @property
    def names(self) -> list[str]:
        with self._lock:
            return [e.name for e in self._entries]

    def pid(self, index: int) -> int | None:
        """The current process id of process ``index`` (changes when it is restarted)."""
        with self._lock:
            proc = self._entries[index].proc
        return None if proc is None else proc.pid

    # ---- waiting --------------------------------------------------------------------------------
    def run(self) -> list[ProcessOutcome]:
        """Wait until every process has ended; their outcomes in order of addition.

        Raises :class:`RankFailedError` (a critical process failed: the root cause, see the
        module docstring), :class:`ProcessTimeoutError`, or what a callback raised.
        """
        deadline = time.monotonic() + self.timeout
        grace_until: float | None = None
        with self._lock:
            if self._closed:
                raise RuntimeError("this supervisor has ended; start a new one")
            self._runner = threading.current_thread()
        try:
            while True:
                with self._lock:
                    if self._closed:  # by close() in another thread: its processes are gone
                        raise RuntimeError("the supervisor was closed while it waited")
                    entries = list(self._entries)
                live = [e for e in entries if e.outcome is None]
                failed = [e.outcome for e in entries if e.outcome is not None and not e.outcome.ok]
                critical_failed = [
                    e for e in entries if e.critical and e.outcome is not None and not e.outcome.ok
                ]
                if critical_failed and grace_until is None:
                    grace_until = time.monotonic() + self.grace
                if grace_until is not None and (not live or time.monotonic() >= grace_until):
                    root = root_cause(failed)  # type: ignore[arg-type]
                    others = [o for o in failed if o is not root]  # type: ignore[misc]
                    raise RankFailedError(
                        root.index, root.name, root.headline(), root.error, others
                    ) from root.exception
                if not live:
                    break
                now = time.monotonic()
                if now >= deadline:
                    raise ProcessTimeoutError(self.timeout, [e.name for e in live])
                until = deadline if grace_until is None else min(deadline, grace_until)
                waitables: dict[Any, _Entry] = {}
                for e in live:
                    assert e.conn is not None and e.proc is not None
                    waitables[e.conn] = e
                    waitables[e.proc.sentinel] = e
                ready = wait([*waitables, self._wake_r], timeout=max(0.0, until - now))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                for e in {id(waitables[r]): waitables[r] for r in ready if r in waitables}.values():
                    if e.outcome is None:
                        self._collect(e)
            for e in entries:  # every outcome is in: let them exit on their own first
                assert e.proc is not None
                e.proc.join(_KILL_GRACE)
            return [e.outcome for e in entries]  # type: ignore[misc]
        finally:
            with self._lock:
                self._runner = None
            self.close()

    def _collect(self, e: _Entry) -> None:
        """Read what process ``e`` has to say (result, failure, or death) and act on it."""
        assert e.conn is not None and e.proc is not None
        outcome = _read_outcome(e)
        if outcome is None:
            return
        if _died_bootstrapping(e, outcome):  # every child would: no restart, no callback
            raise MainGuardError(e.index, e.name)
        if not outcome.ok and e.restarts_left > 0:
            _stop(e.proc)  # a process that reported early may still be tearing down
            e.conn.close()
            e.restarts_left -= 1
            e.restarts += 1
            with self._lock:
                self._start(e)
            if self.on_restart is not None:
                self.on_restart(outcome)
            return
        e.outcome = outcome
        if not outcome.ok and not e.critical and self.on_failure is not None:
            self.on_failure(outcome)

    def close(self, grace: float = _KILL_GRACE) -> None:
        """Kill every process still running (idempotent): SIGTERM, then SIGKILL for those
        still running after ``grace`` seconds (0: SIGKILL at once). No process is added after."""
        with self._lock:
            first = not self._closed
            self._closed = True
            entries = list(self._entries)
            runner = self._runner
        if first:
            for e in entries:
                if e.proc is not None and e.proc.is_alive():
                    e.proc.terminate() if grace > 0 else e.proc.kill()
            deadline = time.monotonic() + grace
            for e in entries:
                if e.proc is None:
                    continue
                e.proc.join(max(0.0, deadline - time.monotonic()))
                if e.proc.is_alive():
                    e.proc.kill()
                    e.proc.join(_KILL_GRACE)
        if runner is not None and runner is not threading.current_thread():
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")  # run() wakes, sees the end, releases the pipes
            return
        with self._lock:
            if self._released:
                return
            self._released = True
        for e in entries:
            if e.conn is not None:
                e.conn.close()
        self._lifeline.close()
        self._lifeline_w.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_outcome(e: _Entry) -> ProcessOutcome | None:
    """Process ``e``'s outcome if it has one (a result, a failure, or death); else None."""
    assert e.conn is not None and e.proc is not None
    conn, proc = e.conn, e.proc
    gone = False
    while not gone and conn.poll():  # a message, or EOF because the child is gone
        try:
            msg = conn.recv()
        except EOFError:
            gone = True
        else:
            if isinstance(msg, _Started):
                e.started = True
                continue
            if isinstance(msg, _Result):
                proc.join(_KILL_GRACE)
                return ProcessOutcome(
                    e.index,
                    e.name,
                    True,
                    value=from_bytes(msg.blob),
                    exitcode=proc.exitcode,
                    restarts=e.restarts,
                )
            exc = None
            if msg.exception is not None:
                with contextlib.suppress(Exception):
                    exc = pickle.loads(msg.exception)
            return ProcessOutcome(
                e.index,
                e.name,
                False,
                error=msg.traceback,
                exitcode=proc.exitcode,
                exception=exc,
                raised=True,
                secondary=msg.secondary,
                failed_at=msg.at,
                restarts=e.restarts,
            )
    if not gone and proc.is_alive():
        return None
    seen = time.time()
    proc.join(_KILL_GRACE)
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return ProcessOutcome(
        e.index,
        e.name,
        False,
        error=f"{e.name} exited ({how}) without returning a result",
        exitcode=code,
        failed_at=seen,
        restarts=e.restarts,
    )


def _died_bootstrapping(e: _Entry, outcome: ProcessOutcome) -> bool:
    """Whether ``outcome`` is :func:`exit_if_bootstrapping`'s exit: a silent death with its code
    before the child announced its start (the one place this case is recognised)."""
    return not outcome.raised and not e.started and outcome.exitcode == _BOOTSTRAP_EXIT


def run_processes(
    fn: Callable[..., Any],
    args_per_process: Sequence[tuple[Any, ...]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    names: Sequence[str] | None = None,
    envs: Sequence[Mapping[str, str]] | None = None,
    fail_fast: bool = True,
    num_threads: int | None = None,
    on_failure: Callable[[ProcessOutcome], None] | None = None,
    restarts: int | Sequence[int] = 0,
    grace: float = DEFAULT_GRACE,
    start_method: str | StartMethod = DEFAULT_START_METHOD,
) -> list[ProcessOutcome]:
    """Run ``fn(*args_per_process[i])`` in one fresh process each and collect the outcomes.

    ``fn`` and its arguments must be picklable (a module-level function): processes are
    started with ``start_method`` (:class:`ProcessSupervisor`). Return values travel back with
    ``torch.save``, so tensors are fine.

    * ``fail_fast=True``: the first process that raises or exits without a result ends the run:
      after a grace period of ``grace`` seconds for the others' reports, all are killed and
      :class:`RankFailedError` is raised for the root cause (see the module docstring), with
      the other failures listed.
    * ``fail_fast=False``: failures are recorded in the returned outcomes (and reported to
      ``on_failure`` as they happen) while the others run on.
    * ``restarts``: per process (or one number for all), how many times a process that raises
      or dies is restarted with the same arguments before its failure counts.

    Either way, if not every process has finished after ``timeout`` seconds, all are killed and
    :class:`ProcessTimeoutError` is raised. On any exit (including Ctrl-C in the parent) no
    child is left running. ``num_threads``: torch intra-op threads per child (default: the
    cores divided among the processes, so ranks do not oversubscribe the machine).
    """
    n = len(args_per_process)
    if n < 1:
        raise ValueError("run_processes needs at least one process")
    names = list(names) if names is not None else [f"rank {i}" for i in range(n)]
    envs = list(envs) if envs is not None else [{} for _ in range(n)]
    if isinstance(restarts, Sequence):  # checked before the first process starts
        per_restarts = [check_int(f"restarts[{i}]", r, 0) for i, r in enumerate(restarts)]
    else:
        per_restarts = [check_int("restarts", restarts, 0)] * n
    if len(names) != n or len(envs) != n or len(per_restarts) != n:
        raise ValueError("names, envs and restarts must have one entry per process")
    sup = ProcessSupervisor(
        timeout=timeout,
        grace=grace,
        num_threads=num_threads if num_threads is not None else _default_threads(n),
        on_failure=on_failure,
        start_method=start_method,
    )
    try:
        for i, args in enumerate(args_per_process):
            sup.add(
                fn,
                tuple(args),
                name=names[i],
                env=envs[i],
                restarts=per_restarts[i],
                critical=fail_fast,
            )
    except BaseException:
        sup.close()
        raise
    return sup.run()


# ---------------------------------------------------------------------------------------------
# process groups: spawn (local) and torchrun_main (torchrun)
# ---------------------------------------------------------------------------------------------
