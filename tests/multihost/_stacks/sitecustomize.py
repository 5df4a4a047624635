"""Python stacks on demand for every Python process a multi-host command starts.

The harness puts this folder first on ``PYTHONPATH`` and sets ``DISTOPTIM_STACKS_DIR``; every
Python interpreter of the command (torchrun's agent, its workers, anything they spawn) imports
this module at start-up, opens ``$DISTOPTIM_STACKS_DIR/<pid>.txt`` and registers
:mod:`faulthandler` on ``SIGUSR1`` (all threads). Before it kills a command that timed out, the
harness sends ``SIGUSR1`` to each process that has such a file and reads the stacks back:
faulthandler writes them from the signal handler itself, without the GIL, so a process stuck in
C++ (a gloo wait, a thread join) still answers. No dependency; nothing happens without the
variable. A ``sitecustomize`` further down the path (a distribution's) is still run.
"""

from __future__ import annotations

import faulthandler
import importlib.machinery
import importlib.util
import os
import signal
import sys

_FILE = []  # keeps the file open (faulthandler holds only its descriptor)


def _register() -> None:
    folder = os.environ.get("DISTOPTIM_STACKS_DIR")
    if not folder or not hasattr(signal, "SIGUSR1"):
        return
    try:
        f = open(os.path.join(folder, f"{os.getpid()}.txt"), "w")  # noqa: SIM115
    except OSError:
        return
    _FILE.append(f)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path, as if this one were not there."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_register()
_chain()
