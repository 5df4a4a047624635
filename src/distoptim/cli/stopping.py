"""How a command stops: SIGINT, SIGTERM and SIGHUP, each an exception at a safe point.

Owns: the three signals that stop a command and what each becomes -- Ctrl-C (``SIGINT``):
``KeyboardInterrupt``, exit 130; ``SIGTERM`` (``kill``, ``timeout``, a job scheduler):
:class:`Terminated`, exit 143; ``SIGHUP`` (the terminal or ssh session closed):
:class:`HungUp`, exit 129 -- all ``KeyboardInterrupt``\\ s, so one ``except`` stops every phase
the same way (the pool start-up, a run, the checks before them); holding them while a result
file is written (:func:`signals_held`: the signal is kept and acted on after, not lost); and
output to a terminal that is gone (after ``SIGHUP`` a write raises ``EIO``): it is dropped, so
that the results are still written and the exit code is still 129.

The worker processes ignore all three (``distoptim.cli.pool``): a signal sent to the whole
process group (Ctrl-C, a closed terminal) reaches them too, and the parent stops them after
keeping what they reported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = [
    "STOP_SIGNALS",
    "HungUp",
    "Terminated",
    "exit_code",
    "flush_or_drop",
    "print_or_drop",
    "signals_as_interrupt",
    "signals_held",
    "stop_reason",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: handled like Ctrl-C (everything stops, results are kept), exit 143."""

    signum = signal.SIGTERM


class HungUp(KeyboardInterrupt):
    """SIGHUP arrived (the terminal or ssh session closed): like Ctrl-C, exit 129."""

    signum = signal.SIGHUP


def _exception(signum: int) -> KeyboardInterrupt:
    return {signal.SIGTERM: Terminated, signal.SIGHUP: HungUp}.get(signum, KeyboardInterrupt)()


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal: 130 for Ctrl-C, 143 for :class:`Terminated`, 129 for :class:`HungUp`."""
    return 128 + int(getattr(interrupt, "signum", signal.SIGINT))


def stop_reason(interrupt: KeyboardInterrupt) -> str:
    """``Ctrl-C``, ``SIGTERM`` or ``SIGHUP``: what stopped the command, for records and lines."""
    return {signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}.get(
        getattr(interrupt, "signum", signal.SIGINT), "Ctrl-C"
    )


def _raise_for(signum: int, frame: Any) -> None:
    raise _exception(signum)


@contextlib.contextmanager
def _handlers(handler: Any) -> Iterator[None]:
    """``handler`` for every stop signal while inside, the previous ones restored after (main
    thread only: elsewhere nothing changes). A signal ignored when the command started (e.g.
    SIGINT of a job started in the background with ``&``) stays ignored."""
    try:
        previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            if previous[s] is not signal.SIG_IGN:
                signal.signal(s, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def signals_as_interrupt() -> contextlib.AbstractContextManager[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP raise their ``KeyboardInterrupt`` (module doc)
    in the main thread, wherever it is."""
    return _handlers(_raise_for)


class _Held:
    """The first stop signal that arrived while held (None: none)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum

    def interrupt(self) -> KeyboardInterrupt | None:
        """The exception the held signal stands for (None if none arrived)."""
        return None if self.signum is None else _exception(self.signum)

    def deliver(self) -> None:
        """Send the held signal again, to the handler in place now (after the block)."""
        if self.signum is not None:
            signal.raise_signal(self.signum)


@contextlib.contextmanager
def signals_held() -> Iterator[_Held]:
    """Hold the stop signals while inside (writing results, starting a process: a second or
    so): the first one is kept -- ``held.interrupt()`` or ``held.deliver()`` after the block --
    never lost, and it never stops the block half-way (a file half written, a process
    started but not yet handed what it must read)."""
    held = _Held()
    with _handlers(held):
        yield held


def print_or_drop(text: str, stream: TextIO) -> None:
    """``print(text, file=stream)``, dropped when the stream is gone (a closed terminal)."""
    with contextlib.suppress(OSError, ValueError):
        print(text, file=stream, flush=True)


def flush_or_drop() -> None:
    """Flush stdout and stderr; one that cannot be written any more (a closed terminal: EIO)
    is pointed at ``/dev/null``, so that Python's last flush at exit cannot fail and turn the
    exit code into 120."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, stream.fileno())
                os.close(null)
                stream.flush()
