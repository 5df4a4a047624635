"""How a supervised process starts: the ``forkserver`` method (default) or ``spawn``.

Owns: :class:`StartMethod` (the multiprocessing context of each method, the modules a
forkserver preloads, the environment a child is given under each), what a child takes on
before it runs anything (:class:`ChildStart`: its environment and signal mask), and the
lifeline by which a child notices that its launcher died, whichever process is its parent
(:func:`watch_lifeline`).

``spawn`` starts a fresh interpreter per process, which imports torch (and ``torch._dynamo``)
again: 2.3-2.5 s of CPU each here. ``forkserver`` forks each process from a server process that
imported :data:`FORKSERVER_PRELOAD` once. A forked child inherits the *server's* environment,
so the child is given the launcher's whole environment at its start and makes it its own;
only what a process reads before its first Python instruction cannot follow (glibc's
``MALLOC_*``, ``LD_PRELOAD``, ``PYTHONHASHSEED``...: :data:`STARTUP_ONLY`): a child asked to
run with one of those changed fails with a ``ValueError`` that names it and says to use
``start_method="spawn"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from distoptim.checks import check_choice

START_METHODS = ("forkserver", "spawn")
"""The start methods of :class:`StartMethod` (``start_method=`` of the launchers)."""

DEFAULT_START_METHOD = "forkserver"

FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "distoptim.launch")
"""What the forkserver imports once, before it forks any process (never the main module)."""

STARTUP_ONLY = (
    "MALLOC_",
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "PYTHONHASHSEED",
    "PYTHONMALLOC",
)
"""Variables (or prefixes) read only when a process starts: a forked child cannot honour a
change of them."""

_CPP_LOG_LEVELS = {"0": 0, "INFO": 0, "1": 1, "WARNING": 1, "2": 2, "ERROR": 2, "3": 3, "FATAL": 3}
_CPP_LOG_DEFAULT = 1  # libc10's FLAGS_caffe2_log_level without TORCH_CPP_LOG_LEVEL (WARNING)


@dataclass(frozen=True)
class StartMethod:
    """How a :class:`~distoptim.launch.ProcessSupervisor` starts its processes.

    ``"forkserver"``: forked from one server process per launcher that imported
    :data:`FORKSERVER_PRELOAD` (the server is multiprocessing's, shared by the whole launcher
    process and started at its first use). ``"spawn"``: a fresh interpreter each; needed when a
    child's ``env`` changes a variable of :data:`STARTUP_ONLY`.
    """

    name: str = DEFAULT_START_METHOD

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", check_choice("start_method", self.name, START_METHODS))

    @property
    def forks(self) -> bool:
        return self.name == "forkserver"

    def context(self) -> Any:
        """The multiprocessing context (nothing started yet)."""
        return mp.get_context(self.name)

    def ready(self) -> None:
        """Call before each start, outside any child's environment: for ``forkserver``, start
        the server (with the preload) unless it runs; a no-op for ``spawn``.

        The server starts with SIGINT, SIGTERM and SIGHUP blocked: a signal sent to the whole
        process group (Ctrl-C, a closed terminal) does not end it, which would end every child
        with it; it ends when the launcher and its children are gone. Its children start with
        them blocked too, until :meth:`ChildStart.apply` sets the launcher's mask."""
        if self.forks:
            multiprocessing.forkserver.set_forkserver_preload(list(FORKSERVER_PRELOAD))
            old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
            try:
                # the server needs the resource tracker, whose start unblocks SIGINT and SIGTERM
                multiprocessing.resource_tracker.ensure_running()
                signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
                multiprocessing.forkserver.ensure_running()
            finally:  # the caller's mask, whatever the tracker did to it
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def child_start(self, env: Mapping[str, str]) -> ChildStart:
        """What a child started now is sent: ``env`` (spawn: it inherits the rest), or the
        launcher's whole environment updated with ``env`` and the starting thread's signal mask
        (forkserver: it inherits the server's)."""
        if not self.forks:
            return ChildStart(dict(env), False, ())
        mask = tuple(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, ())))
        return ChildStart({**os.environ, **env}, True, mask)

    def environ_at_start(self, env: Mapping[str, str]) -> contextlib.AbstractContextManager[Any]:
        """Hold around ``Process.start()``: spawn's interpreter starts with ``env`` in place
        (C++ log levels, malloc settings); a forked child gets it from :func:`apply_environment`."""
        return contextlib.nullcontext() if self.forks else _environ(env)


_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def resolve_start_method(value: str | StartMethod) -> StartMethod:
    """``value`` as a :class:`StartMethod` (a name of :data:`START_METHODS`, or one already)."""
    return value if isinstance(value, StartMethod) else StartMethod(value)


_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def _environ(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` for the duration (a spawned child started meanwhile
    inherits it from its first instruction)."""
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


# ---------------------------------------------------------------------------------------------
# child side
# ---------------------------------------------------------------------------------------------
def _startup_only(key: str) -> bool:
    return any(key.startswith(p) if p.endswith("_") else key == p for p in STARTUP_ONLY)


@dataclass(frozen=True)
class ChildStart:
    """What a child takes on before it runs anything (:meth:`StartMethod.child_start`)."""

    env: dict[str, str]
    forked: bool
    mask: tuple[int, ...]  # forked: the signals blocked in the launcher's starting thread

    def apply(self) -> None:
        """In the started child: make ``env`` its environment, and its signal mask the
        launcher's (forked).

        Forked: ``env`` replaces what the server left; ``TORCH_CPP_LOG_LEVEL`` and
        ``OMP_NUM_THREADS``, which torch read when the server imported it, are applied to torch
        now; a changed :data:`STARTUP_ONLY` variable raises ``ValueError``. torch's and numpy's
        global generators are seeded afresh, as in a new interpreter (forked, every child would
        draw the server's numbers; Python's ``random`` reseeds itself at a fork).
        """
        if not self.forked:
            os.environ.update(self.env)
            return
        signal.pthread_sigmask(signal.SIG_SETMASK, self.mask)
        _reseed()
        env, inherited = self.env, dict(os.environ)
        changed = sorted(
            k
            for k in set(env) | set(inherited)
            if _startup_only(k) and env.get(k) != inherited.get(k)
        )
        if changed:
            raise ValueError(
                f"{', '.join(changed)} must be set before a process starts, and this one was "
                "forked by a forkserver that started without it: start the processes with "
                'start_method="spawn"'
            )
        os.environ.clear()
        os.environ.update(env)
        if env.get("TORCH_CPP_LOG_LEVEL") != inherited.get("TORCH_CPP_LOG_LEVEL"):
            _set_cpp_log_level(env.get("TORCH_CPP_LOG_LEVEL"))
        threads = env.get("OMP_NUM_THREADS")
        if threads != inherited.get("OMP_NUM_THREADS") and threads and threads.isdigit():
            import torch

            torch.set_num_threads(max(1, int(threads)))


def _reseed() -> None:
    """Non-deterministic seeds for torch's CPU generator and numpy's global one, as a fresh
    interpreter has (CUDA's generators are untouched: the server never initialized CUDA)."""
    import torch

    torch.default_generator.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


def _set_cpp_log_level(value: str | None) -> None:
    """Set libc10's log level as torch would have read ``TORCH_CPP_LOG_LEVEL`` at load."""
    import torch

    level = _CPP_LOG_LEVELS.get((value or "").strip().upper(), _CPP_LOG_DEFAULT)
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    with contextlib.suppress(OSError, ValueError):
        ctypes.c_int.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_log_level").value = level


def watch_lifeline(lifeline: Connection) -> None:
    """Kill this process (SIGKILL) once ``lifeline`` reaches EOF: its launcher, the only holder
    of the other end, died. Checked at once (it may have died already), then by a thread."""

    def watch() -> None:
        try:
            lifeline.poll(None)  # the launcher never writes: readable means EOF
        except (OSError, ValueError):  # closed in this process: nothing left to watch
            return
        os.kill(os.getpid(), signal.SIGKILL)

    if lifeline.poll(0):
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="distoptim-lifeline", daemon=True).start()
