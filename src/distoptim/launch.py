"""Local multi-process runs with bounded failure, the real cause of a failure, and torchrun glue.

Owns: starting processes, restarting the ones allowed to restart, collecting their return
values, and making sure that a process that raises, dies or hangs ends the run with an error
that names the *real cause* within ``timeout``, leaving no orphan process behind.

Layers
------
* :class:`ProcessSupervisor` -- processes that may be added while the run is under way and
  restarted when they fail (``restarts=``); the parent's bookkeeping: outcomes, restarts, the
  root cause of a failed run. The AGN cluster (``distoptim.agn``) uses it directly: shards are
  restarted from their checkpoints, late workers are added to a running cluster.
* :func:`run_processes` -- a fixed list of processes running ``fn(*args)``, outcomes in order.
* :func:`spawn` -- the same with a ``torch.distributed`` process group per process:
  ``fn(rank, world_size, *args)``.
* :func:`torchrun_main` -- run the same ``fn`` under ``torchrun`` (one process per rank,
  multi-node); it reads the environment torchrun sets.

The real cause of a failed run
------------------------------
When one rank raises, its peers usually fail too, a moment later, with a *consequence*: gloo's
"Connection closed by peer" once the failing rank's process group is gone, a timeout, a parameter
server that stopped answering. Three rules make the caller see the cause, not a consequence:

1. A child reports its exception to the parent **as soon as it is raised**
   (:func:`report_failure`), before anything is torn down: :func:`spawn`'s process-group wrapper
   reports before it destroys the group, so the report of the rank that raised first is on its
   way before any peer can notice. Each report carries the wall-clock time of the failure and
   whether the exception is a consequence of a peer's failure (:func:`is_peer_failure`:
   ``torch.distributed``'s own errors, gloo's connection and timeout errors,
   :class:`PeerFailureError` and its subclasses).
2. On the first failure the parent waits a short bounded grace period (``grace``, default
   2 s; it ends early once every process has ended) for the other processes' reports.
3. It then picks the root cause (:func:`root_cause`): an exception raised in user code before a
   process death, before a peer's consequence; among equals, the earliest. The error raised is
   :class:`RankFailedError` for the root cause, with the other failures listed after it
   (``others``).

A script without a main guard
-----------------------------
Processes start with the ``spawn`` method: each new process imports the parent's main module
(as ``__mp_main__``) before it runs anything. A script that starts processes at its top level,
without ``if __name__ == "__main__":``, therefore starts them again in every child, where
Python refuses ("An attempt has been made to start a new process before the current process
has finished its bootstrapping phase"). Every entry point here calls
:func:`exit_if_bootstrapping` before its first side effect: in such a child it exits at once
with a code of its own, before the child has started the work it was made for, and the
parent's :class:`ProcessSupervisor` turns that death into :class:`MainGuardError`, one line
naming the script and the fix -- raised at once, whatever the process's ``restarts`` or
``critical`` say (every child re-imports the same module, so none would fare better).

Restarts
--------
A process added with ``restarts=N`` that raises or dies is started again with the same
function and arguments, up to ``N`` times, with ``DISTOPTIM_RESTART_COUNT`` (the number of
restarts so far; unset on the first start) added to its environment -- the per-process analogue
of torchrun's ``TORCHELASTIC_RESTART_COUNT``, which torchrun changes for the whole job at once.

How a local run mirrors torchrun
--------------------------------
The parent hosts the rendezvous ``TCPStore`` on a free loopback port (the OS picks it, so there
is no port race) and gives every child the environment torchrun would: ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and
``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank is a store client, as under torchrun's agent).
Children then call ``init_process_group(init_method="env://")`` -- exactly the code path a
torchrun job takes -- so a function tested with :func:`spawn` runs unchanged under torchrun.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import check_int, check_optional_int, check_seconds, check_type
from distoptim.netcheck import check_torchrun_network

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_TIMEOUT",
    "RESTART_COUNT_ENV",
    "MainGuardError",
    "PeerFailureError",
    "ProcessOutcome",
    "ProcessSupervisor",
    "ProcessTimeoutError",
    "RankFailedError",
    "exit_if_bootstrapping",
    "from_bytes",
    "import_dynamo_before_groups",
    "is_peer_failure",
    "report_failure",
    "require_torchrun_env",
    "root_cause",
    "run_processes",
    "spawn",
    "to_bytes",
    "torchrun_env",
    "torchrun_main",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a local run may take before every process is killed (and collective timeout)."""

DEFAULT_GRACE = 2.0
"""Seconds the parent waits, after a first failure, for the other processes' reports."""

RESTART_COUNT_ENV = "DISTOPTIM_RESTART_COUNT"
"""How many times this process was restarted by its :class:`ProcessSupervisor` (unset: never)."""

_KILL_GRACE = 5.0

_BOOTSTRAP_EXIT = 86
"""Exit code of a child that was still importing its parent's main module when that module
started processes (:func:`exit_if_bootstrapping`). It means that only from a child that never
announced its start (``_Started``), so a task that calls ``os._exit(86)`` is not mistaken."""

# Substrings of the messages gloo/c10d raise on a rank whose *peer* failed or went away.
_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "caused pair closure",
    "Timed out waiting",
    "Broken pipe",
    "Socket Timeout",
    "NCCL communicator was aborted",
)


class PeerFailureError(RuntimeError):
    """This process failed *because another one did* (a peer died, hung or stopped answering).

    Raise a subclass of it for such errors so that :func:`root_cause` ranks them after the
    failure that caused them (e.g. ``distoptim.agn.ParameterServerError``).
    """


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the consequence of a peer's failure, not a cause.

    True for :class:`PeerFailureError`, ``torch.distributed.DistError`` (backend, network and
    store errors) and for ``RuntimeError``\\ s carrying gloo's connection/timeout messages.
    """
    if isinstance(exc, (PeerFailureError, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _PEER_FAILURE_MARKERS)


class RankFailedError(RuntimeError):
    """A process raised or died. ``rank``: which one; ``remote_traceback``: its traceback text.

    When the child's exception could be pickled it is chained as ``__cause__``. ``others``: the
    other processes that failed in the same run (usually consequences of this one), each as a
    :class:`ProcessOutcome`; they are listed at the end of the message.
    """

    def __init__(
        self,
        rank: int,
        name: str,
        message: str,
        remote_traceback: str | None,
        others: Sequence[ProcessOutcome] = (),
    ) -> None:
        self.rank = rank
        self.name = name
        self.remote_traceback = remote_traceback
        self.others = list(others)
        text = f"{name} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback of {name} ---\n{remote_traceback.rstrip()}"
        if self.others:
            text += "\n\nalso failed (after it, most likely as a consequence):"
            for o in self.others:
                text += f"\n  - {o.name}: {o.headline()}"
        super().__init__(text)


class ProcessTimeoutError(TimeoutError):
    """The run did not finish within ``timeout``; ``pending`` names the processes still running.

    ``limit``: what set the limit, as the caller knows it (``timeout``, a command line's
    ``--timeout``): the message names it first -- the run may simply need longer -- and a
    hang second.
    """

    def __init__(self, timeout: float, pending: list[str], limit: str = "timeout") -> None:
        self.timeout = timeout
        self.pending = pending
        self.limit = limit
        super().__init__(
            f"processes did not finish within {timeout:g}s, the limit set by {limit}, and were "
            f"killed: {', '.join(pending)}; if the run needs longer, raise {limit} (otherwise "
            "it hung: a rank waiting in a collective its peers never entered, or a deadlock)"
        )


class MainGuardError(RankFailedError):
    """A child re-imported an unguarded main module that starts processes (module docstring).

    The message is one line: the script, and the fix -- its process-starting code under
    ``if __name__ == "__main__":``.
    """

    def __init__(self, rank: int, name: str) -> None:
        super().__init__(rank, name, _main_guard_hint(), None)


def _main_guard_hint() -> str:
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    script = f"the main module {path!r}" if path else "the main module"
    return (
        f"it died while starting, re-importing {script}, which starts processes again when "
        'imported: put the code that starts processes under `if __name__ == "__main__":` '
        "(processes start with the spawn method, which imports the main module in each new "
        "process)"
    )


def exit_if_bootstrapping() -> None:
    """In a child that is still importing its parent's main module, exit now (code 86).

    Such a child runs the script's top level again; if that starts processes, Python refuses
    ("... before the current process has finished its bootstrapping phase") -- after whatever
    the top level did before. Every entry point that starts processes calls this first, so the
    child leaves before any side effect and its parent's :class:`ProcessSupervisor` raises
    :class:`MainGuardError` naming the fix. Anywhere else it does nothing.
    """
    # multiprocessing's own test for this case (multiprocessing.spawn._check_not_importing_main)
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(_BOOTSTRAP_EXIT)


@dataclass
class ProcessOutcome:
    """What one process did: ``ok`` with ``value``, or not ok with ``error`` (text).

    ``raised``: it reported an exception (``exception`` when it could be unpickled), as opposed
    to dying without a word (then ``exitcode`` says how). ``secondary``: that exception looks
    like the consequence of a peer's failure (:func:`is_peer_failure`). ``failed_at``: wall-clock
    time of the failure (reported by the child, or when the parent saw the death).
    ``restarts``: how many times the process was restarted.
    """

    index: int
    name: str
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    exception: BaseException | None = None
    raised: bool = False
    secondary: bool = False
    failed_at: float | None = None
    restarts: int = 0

    def headline(self) -> str:
        """One line saying what went wrong: ``Type: message``, the last error line, or the exit."""
        if self.exception is not None:
            first = str(self.exception).strip().splitlines()
            return f"{type(self.exception).__name__}: {first[0] if first else ''}".rstrip(": ")
        text = (self.error or "").strip()
        return text.splitlines()[-1] if text else f"exit code {self.exitcode}"


def root_cause(failures: Sequence[ProcessOutcome]) -> ProcessOutcome:
    """The failure that most likely caused the others.

    Order: an exception raised in user code (``raised and not secondary``), then a death
    without a report, then a peer's consequence; within each kind the earliest ``failed_at``
    (then the lowest index).
    """
    if not failures:
        raise ValueError("root_cause needs at least one failed outcome")

    def key(o: ProcessOutcome) -> tuple[int, float, int]:
        kind = 0 if o.raised and not o.secondary else 1 if not o.raised else 2
        return (kind, math.inf if o.failed_at is None else o.failed_at, o.index)

    return min(failures, key=key)


# ---------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------
@dataclass
class _Started:
    """Child -> parent: the child is past start-up (its parent's main module is imported)."""


@dataclass
class _Result:
    """Child -> parent: ``fn`` returned; its value as :func:`to_bytes`."""

    blob: bytes


@dataclass
class _Failure:
    """Child -> parent: ``fn`` raised (sent as soon as it is caught)."""

    exception: bytes | None  # pickled exception, when it pickles
    traceback: str
    secondary: bool
    at: float


_PARENT: Connection | None = None  # this child's pipe to the parent (None outside launch)
_REPORTED = False  # a failure went to the parent already: this process's outcome is decided


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so nothing is orphaned."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def to_bytes(value: Any) -> bytes:
    """``value`` (tensors included) as bytes, for a pipe or a store between our processes."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> Any:
    """The inverse of :func:`to_bytes` (trusted data only: it unpickles)."""
    return torch.load(io.BytesIO(data), weights_only=False)


def report_failure(exc: BaseException) -> None:
    """Send ``exc`` to the parent launcher now, before this process tears anything down.

    Call it where an exception is caught and before cleanup that peers can observe (destroying a
    process group, leaving a cluster). The first report of a process decides its outcome; later
    calls do nothing, and so does a call outside a process started by this module.
    """
    global _REPORTED
    conn = _PARENT
    if conn is None or _REPORTED:
        return
    _REPORTED = True
    try:
        blob: bytes | None = pickle.dumps(exc)
    except Exception:
        blob = None
    text = "".join(traceback.format_exception(exc))
    with contextlib.suppress(Exception):
        conn.send(_Failure(blob, text, is_peer_failure(exc), time.time()))


def _child_main(
    conn: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    num_threads: int | None,
    parent_pid: int,
) -> None:
    global _PARENT
    _die_with_parent()
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)
    os.environ.update(env)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    _PARENT = conn
    try:
        conn.send(_Started())
        value = fn(*args)
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt too
        report_failure(exc)
    else:
        try:
            conn.send(_Result(to_bytes(value)))
        except Exception as exc:  # e.g. an unpicklable return value
            report_failure(RuntimeError(f"could not send the result to the parent: {exc!r}"))
    finally:
        _PARENT = None
        conn.close()


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


_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Any:
    """``os.environ`` updated with ``env`` for the duration (a child started meanwhile inherits
    it from its first instruction; ``_child_main`` sets it again, for the record)."""
    with _ENVIRON_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


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
    threads per child (None: torch's default). ``fn`` and arguments must be picklable
    (processes start with the ``spawn`` method); return values travel with ``torch.save``.
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        grace: float = DEFAULT_GRACE,
        num_threads: int | None = None,
        on_failure: Callable[[ProcessOutcome], None] | None = None,
        on_restart: Callable[[ProcessOutcome], None] | None = None,
    ) -> None:
        self.timeout = check_seconds("timeout", timeout)
        self.grace = check_seconds("grace", grace, allow_zero=True)
        self.num_threads = check_optional_int("num_threads", num_threads, 1)
        self.on_failure = on_failure
        self.on_restart = on_restart
        self._ctx = mp.get_context("spawn")
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
        proc = self._ctx.Process(
            target=_child_main,
            args=(send, entry.fn, entry.args, env, self.num_threads, os.getpid()),
            name=f"distoptim-{entry.name.replace(' ', '-')}",
        )
        with _environ(env):  # in place when the child's interpreter starts (C++ log levels...)
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
) -> list[ProcessOutcome]:
    """Run ``fn(*args_per_process[i])`` in one fresh process each and collect the outcomes.

    ``fn`` and its arguments must be picklable (a module-level function): processes are
    started with the ``spawn`` method. Return values travel back with ``torch.save``, so tensors
    are fine.

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
def torchrun_env(rank: int, world_size: int, port: int, host: str = "127.0.0.1") -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of a single-node job with an agent store."""
    return {
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def import_dynamo_before_groups() -> None:
    """Import ``torch._dynamo`` before any process group exists.

    The first ``torch.optim.Optimizer`` imports ``torch._dynamo``; when that happens while a
    gloo group exists, the group outlives ``destroy_process_group`` (torch 2.13, seen here), so
    gloo's worker threads run on into interpreter shutdown, and one that still holds the last
    reference to a Python tensor aborts the process there ("terminate called without an active
    exception", SIGABRT). Importing it first lets ``destroy_process_group`` join those threads.
    Every entry point that creates groups calls this first (``rpc.init_rpc`` makes a gloo group
    too).
    """
    import torch._dynamo  # noqa: F401


def _release_device_meshes() -> int:
    """Drop the process groups that live ``DeviceMesh`` objects hold; returns how many meshes.

    Call it right before ``destroy_process_group``. A ``DeviceMesh`` keeps its groups in
    ``_pg_registry`` (torch 2.13), and DTensor's caches (sharding propagation, mesh topology)
    keep every mesh a DTensor was placed on alive until the interpreter exits, so the groups
    outlive ``destroy_process_group``: their gloo worker threads run on into interpreter
    shutdown. The thread that ran a rank's last collective frees that work a moment after the
    rank's wait returned; under load that moment can fall into shutdown, where freeing the
    work's tensors takes the GIL (their Python objects were kept alive by C++), Python ends the
    thread, and the unwinding through C++ aborts the process: "terminate called without an
    active exception", SIGABRT, after training succeeded (gdb: ``pt_gloo_runloop`` in
    ``~AsyncWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``).
    With the registries empty, ``destroy_process_group`` frees the groups and joins their
    threads. The meshes stay usable only for their shape (their groups are gone).
    """
    from torch.distributed.device_mesh import DeviceMesh

    meshes = [o for o in gc.get_objects() if type(o) is DeviceMesh]  # isinstance is slow here
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    return len(meshes)


def _with_process_group(
    fn: Callable[..., Any], backend: str | None, timeout: float, args: tuple[Any, ...]
) -> Any:
    """Init the default process group from the torchrun environment, run ``fn``, tear down.

    An exception of ``fn`` is reported to the parent launcher (:func:`report_failure`) before
    the group is destroyed, so that it reaches the parent before the peers' consequences.
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    owns_group = not dist.is_initialized()
    if owns_group:
        import_dynamo_before_groups()
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
    try:
        return fn(rank, world_size, *args)
    except BaseException as exc:
        report_failure(exc)
        raise
    finally:
        if owns_group and dist.is_initialized():
            _release_device_meshes()  # else DTensor's caches keep the groups alive
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
    num_threads: int | None = None,
    *,
    grace: float = DEFAULT_GRACE,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` local ranks; return values in rank order.

    Each rank has the default ``torch.distributed`` process group initialized (``backend``,
    loopback, a free port) with ``timeout`` as the collective timeout too. A rank that raises
    re-raises in the parent as :class:`RankFailedError` for the *root cause* (the first
    exception raised in user code on any rank, with its traceback; the other ranks' consequent
    errors, e.g. gloo's "Connection closed by peer", listed after it); a rank that dies or
    hangs ends the call within ``timeout`` (:class:`RankFailedError` /
    :class:`ProcessTimeoutError`), with every process killed.

    ``fn`` must be a module-level function (processes start with ``spawn``). The same ``fn``
    runs under torchrun with :func:`torchrun_main`.
    """
    nprocs = check_int("nprocs", nprocs, 1)
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    check_type("args", args, tuple, "a tuple")
    check_seconds("timeout", timeout)  # (also the collective timeout of every rank)
    exit_if_bootstrapping()  # before the store: a re-imported script leaves at once
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        outcomes = run_processes(
            _with_process_group,
            [(fn, backend, timeout, args)] * nprocs,
            timeout=timeout,
            envs=[torchrun_env(r, nprocs, store.port) for r in range(nprocs)],
            num_threads=num_threads,
            grace=grace,
        )
    finally:
        del store
    return [o.value for o in outcomes]


def require_torchrun_env(caller: str, local_alternative: str) -> None:
    """Raise a clear ``RuntimeError`` unless torchrun's rendezvous variables are set."""
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in needed if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"{caller} needs the torchrun environment; {', '.join(missing)} not set. "
            f"Start the script with torchrun, or use {local_alternative} for a local run."
        )


def torchrun_main(
    fn: Callable[..., Any],
    *args: Any,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Any:
    """Run ``fn(rank, world_size, *args)`` in this process, as one rank of a torchrun job.

    Initializes the default process group from torchrun's environment (``env://``; backend
    NCCL when CUDA is available, else gloo, unless ``backend`` says otherwise), runs ``fn``,
    destroys the group. Example, two nodes with four processes each, on node n with address
    HOSTn (``is_host=true`` on node 0 only; ``docs/multinode.md`` says why each flag is needed)::

        GLOO_SOCKET_IFNAME=eth0 TP_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc-per-node 4 \\
            --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-conf is_host=true \\
            --local-addr HOSTn my_script.py

    where ``my_script.py`` ends with ``torchrun_main(train)``.
    """
    require_torchrun_env("torchrun_main", "distoptim.launch.spawn")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    check_torchrun_network("torchrun_main", ("gloo",) if "gloo" in backend else (), timeout)
    return _with_process_group(fn, backend, timeout, tuple(args))
