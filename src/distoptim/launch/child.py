"""The child side of a local run: what a started process sends its parent, and when.

Owns: the messages on the pipe (started, result, failure), :func:`report_failure` (a failure
goes to the parent as soon as it is raised), the byte form of values (:func:`to_bytes`,
:func:`from_bytes`) and the child's entry point, which dies with its parent and its launcher.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from distoptim.launch.failures import is_peer_failure
from distoptim.launch.start import ChildStart, watch_lifeline


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
    start: ChildStart,
    num_threads: int | None,
    lifeline: Connection,
) -> None:
    """A started process: dies with its parent (the launcher, or its forkserver) and with its
    launcher (``lifeline``: EOF once the launcher is gone), takes its environment and signal
    mask (``start``), runs ``fn`` and reports."""
    global _PARENT
    _die_with_parent()
    watch_lifeline(lifeline)  # also when the launcher died before prctl took effect
    _PARENT = conn
    try:
        start.apply()
        if num_threads is not None:
            torch.set_num_threads(num_threads)
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
