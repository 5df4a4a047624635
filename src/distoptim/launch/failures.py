"""How a failed local run names its real cause: the failure types and the rule that ranks them.

Owns: the errors a run raises (:class:`RankFailedError`, :class:`ProcessTimeoutError`,
:class:`MainGuardError`), what counts as a peer's consequence (:class:`PeerFailureError`,
:func:`is_peer_failure`), one process's :class:`ProcessOutcome`, :func:`root_cause` and the
main-guard exit (:func:`exit_if_bootstrapping`). The rules are in ``distoptim.launch``'s
docstring ("The real cause of a failed run", "A script without a main guard").
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

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
        "(each new process imports the main module, under the forkserver and the spawn start "
        "method alike)"
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
        # os._exit, not SystemExit: a forkserver's child turns any exception that leaves its
        # start-up, SystemExit included, into exit code 1
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_BOOTSTRAP_EXIT)


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
