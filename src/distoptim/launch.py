"""Local multi-process runs with bounded failure, and the torchrun glue.

Owns: starting processes, collecting their return values, and making sure that a rank that
raises, dies or hangs ends the whole run with a clear error within ``timeout`` and leaves no
orphan process behind.

Layers
------
* :func:`run_processes` — start ``len(args_per_process)`` processes running ``fn(*args)``,
  collect results in order. The AGN cluster (``distoptim.agn.spawn``) builds on it directly,
  with ``fail_fast=False`` so that one dead worker does not end the others.
* :func:`spawn` — the same with a ``torch.distributed`` process group per process:
  ``fn(rank, world_size, *args)``.
* :func:`torchrun_main` — run the same ``fn`` under ``torchrun`` (one process per rank,
  multi-node); it reads the environment torchrun sets.

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
import io
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from distoptim.netcheck import check_torchrun_network

__all__ = [
    "DEFAULT_TIMEOUT",
    "ProcessOutcome",
    "ProcessTimeoutError",
    "RankFailedError",
    "run_processes",
    "from_bytes",
    "import_dynamo_before_groups",
    "require_torchrun_env",
    "spawn",
    "to_bytes",
    "torchrun_env",
    "torchrun_main",
]

DEFAULT_TIMEOUT = 300.0
"""Seconds a local run may take before every process is killed (and collective timeout)."""

_KILL_GRACE = 5.0


class RankFailedError(RuntimeError):
    """A process raised or died. ``rank``: which one; ``remote_traceback``: its traceback text.

    When the child's exception could be pickled it is chained as ``__cause__``.
    """

    def __init__(self, rank: int, name: str, message: str, remote_traceback: str | None) -> None:
        self.rank = rank
        self.name = name
        self.remote_traceback = remote_traceback
        text = f"{name} failed: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback of {name} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class ProcessTimeoutError(TimeoutError):
    """The run did not finish within ``timeout``; ``pending`` names the processes still running."""

    def __init__(self, timeout: float, pending: list[str]) -> None:
        self.timeout = timeout
        self.pending = pending
        super().__init__(
            f"processes did not finish within {timeout:g}s and were killed: {', '.join(pending)} "
            "(a hang: a rank waiting in a collective its peers never entered, or a deadlock)"
        )


@dataclass
class ProcessOutcome:
    """What one process did: ``ok`` with ``value``, or not ok with ``error`` (text)."""

    index: int
    name: str
    ok: bool
    value: Any = None
    error: str | None = None
    exitcode: int | None = None
    exception: BaseException | None = None

    def headline(self) -> str:
        """One line saying what went wrong: ``Type: message``, the last error line, or the exit."""
        if self.exception is not None:
            return f"{type(self.exception).__name__}: {self.exception}"
        text = (self.error or "").strip()
        return text.splitlines()[-1] if text else f"exit code {self.exitcode}"


# ---------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------
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


def _child_main(
    conn: Connection,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: Mapping[str, str],
    num_threads: int | None,
    parent_pid: int,
) -> None:
    _die_with_parent()
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)
    os.environ.update(env)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        value = fn(*args)
        payload = ("ok", to_bytes(value), None)
    except BaseException as exc:  # report everything, SystemExit and KeyboardInterrupt too
        tb = traceback.format_exc()
        try:
            blob = pickle.dumps(exc)
        except Exception:
            blob = None
        payload = ("error", blob, f"{tb}")
    try:
        conn.send(payload)
    except Exception as exc:  # e.g. an unpicklable return value
        conn.send(("error", None, f"could not send the result to the parent: {exc!r}"))
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
def _kill_all(procs: Sequence[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(_KILL_GRACE)


def _default_threads(nprocs: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, nprocs))


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
) -> list[ProcessOutcome]:
    """Run ``fn(*args_per_process[i])`` in one fresh process each and collect the outcomes.

    ``fn`` and its arguments must be picklable (a module-level function): processes are
    started with the ``spawn`` method. Return values travel back with ``torch.save``, so tensors
    are fine.

    * ``fail_fast=True``: the first process that raises or exits without a result ends the run:
      the others are killed and :class:`RankFailedError` is raised with that process's
      traceback.
    * ``fail_fast=False``: failures are recorded in the returned outcomes (and reported to
      ``on_failure`` as they happen) while the others run on.

    Either way, if not every process has finished after ``timeout`` seconds, all are killed and
    :class:`ProcessTimeoutError` is raised. On any exit (including Ctrl-C in the parent) no
    child is left running. ``num_threads``: torch intra-op threads per child (default: the
    cores divided among the processes, so ranks do not oversubscribe the machine).
    """
    n = len(args_per_process)
    if n < 1:
        raise ValueError("run_processes needs at least one process")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    names = list(names) if names is not None else [f"rank {i}" for i in range(n)]
    envs = list(envs) if envs is not None else [{} for _ in range(n)]
    if len(names) != n or len(envs) != n:
        raise ValueError("names and envs must have one entry per process")
    threads = num_threads if num_threads is not None else _default_threads(n)

    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    conns: list[Connection] = []
    outcomes: list[ProcessOutcome | None] = [None] * n
    try:
        for i, args in enumerate(args_per_process):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child_main,
                args=(send, fn, tuple(args), dict(envs[i]), threads, os.getpid()),
                name=f"distoptim-{names[i].replace(' ', '-')}",
            )
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)

        deadline = time.monotonic() + timeout
        pending = set(range(n))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProcessTimeoutError(timeout, [names[i] for i in sorted(pending)])
            waitables: dict[Any, int] = {}
            for i in pending:
                waitables[conns[i]] = i
                waitables[procs[i].sentinel] = i
            ready = wait(list(waitables), timeout=remaining)
            for obj in ready:
                i = waitables[obj]
                if i not in pending:
                    continue
                outcome = _collect(i, names[i], conns[i], procs[i])
                if outcome is None:  # sentinel raced ahead of the pipe; read it next round
                    continue
                pending.discard(i)
                outcomes[i] = outcome
                if not outcome.ok:
                    if fail_fast:
                        raise RankFailedError(
                            i, names[i], outcome.headline(), outcome.error
                        ) from outcome.exception
                    if on_failure is not None:
                        on_failure(outcome)
        for p in procs:
            p.join(_KILL_GRACE)
    finally:
        _kill_all(procs)
        for c in conns:
            c.close()
    return [o for o in outcomes if o is not None]


def _collect(
    i: int, name: str, conn: Connection, proc: mp.process.BaseProcess
) -> ProcessOutcome | None:
    """Process ``i``'s outcome if it has one (a result, an error, or death); else None."""
    if conn.poll():  # a message, or EOF because the child is gone
        try:
            status, blob, tb = conn.recv()
        except EOFError:
            pass
        else:
            proc.join(_KILL_GRACE)
            if status == "ok":
                return ProcessOutcome(i, name, True, value=from_bytes(blob), exitcode=proc.exitcode)
            exc = None
            if blob is not None:
                with contextlib.suppress(Exception):
                    exc = pickle.loads(blob)
            return ProcessOutcome(i, name, False, error=tb, exitcode=proc.exitcode, exception=exc)
    elif proc.is_alive():
        return None
    proc.join(_KILL_GRACE)
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return ProcessOutcome(
        i, name, False, error=f"{name} exited ({how}) without returning a result", exitcode=code
    )


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


def _with_process_group(
    fn: Callable[..., Any], backend: str | None, timeout: float, args: tuple[Any, ...]
) -> Any:
    """Init the default process group from the torchrun environment, run ``fn``, tear down."""
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
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT,
    num_threads: int | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` local ranks; return values in rank order.

    Each rank has the default ``torch.distributed`` process group initialized (``backend``,
    loopback, a free port) with ``timeout`` as the collective timeout too. A rank that raises
    re-raises in the parent as :class:`RankFailedError` with that rank's traceback; a rank that
    dies or hangs ends the call within ``timeout`` (:class:`RankFailedError` /
    :class:`ProcessTimeoutError`), with every process killed.

    ``fn`` must be a module-level function (processes start with ``spawn``). The same ``fn``
    runs under torchrun with :func:`torchrun_main`.
    """
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outcomes = run_processes(
        _with_process_group,
        [(fn, backend, timeout, args)] * nprocs,
        timeout=timeout,
        envs=[torchrun_env(r, nprocs, store.port) for r in range(nprocs)],
        num_threads=num_threads,
    )
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
    destroys the group. Example, two nodes with four processes each::

        # on every node
        torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
                 --rdzv-endpoint HOST0:29500 my_script.py

    where ``my_script.py`` ends with ``torchrun_main(train)``.
    """
    require_torchrun_env("torchrun_main", "distoptim.launch.spawn")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    check_torchrun_network("torchrun_main", ("gloo",) if "gloo" in backend else (), timeout)
    return _with_process_group(fn, backend, timeout, tuple(args))
