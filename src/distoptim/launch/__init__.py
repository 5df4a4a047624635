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
Each new process imports the parent's main module (as ``__mp_main__``) before it runs anything,
under either start method. A script that starts processes at its top level,
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

Start methods
-------------
``start_method=`` (:class:`ProcessSupervisor`, :func:`run_processes`, :func:`spawn`,
``distoptim.agn.spawn``): ``"forkserver"`` (the default) forks each process from one server
that imported torch once (:data:`~distoptim.launch.start.FORKSERVER_PRELOAD`), instead of
2.3-2.5 s of CPU for a fresh interpreter's imports here; ``"spawn"`` starts a fresh
interpreter, which a child needs when its ``env`` changes what is read before the first Python
instruction (``MALLOC_*``...; a forked child refuses that by name). Either way a child has the
launcher's environment at the start plus its ``env``, and dies with the launcher (a lifeline
pipe: a forked child's parent is the server). See :mod:`distoptim.launch.start`.

Modules
-------
``failures`` (the errors and the real-cause rule), ``start`` (the start methods), ``child``
(what a started process sends its parent), ``supervisor`` (:class:`ProcessSupervisor`,
:func:`run_processes`), ``torchrun`` (:func:`spawn`, :func:`torchrun_main` and the torchrun
environment). Everything public is imported from here.
"""

from __future__ import annotations

from distoptim.launch.child import from_bytes, report_failure, to_bytes
from distoptim.launch.failures import (
    MainGuardError,
    PeerFailureError,
    ProcessOutcome,
    ProcessTimeoutError,
    RankFailedError,
    exit_if_bootstrapping,
    is_peer_failure,
    root_cause,
)
from distoptim.launch.start import DEFAULT_START_METHOD, START_METHODS, StartMethod
from distoptim.launch.supervisor import (
    DEFAULT_GRACE,
    DEFAULT_TIMEOUT,
    RESTART_COUNT_ENV,
    ProcessSupervisor,
    run_processes,
)
from distoptim.launch.torchrun import (
    _with_process_group,  # noqa: F401  (imported from here by tests and benchmarks)
    import_dynamo_before_groups,
    require_torchrun_env,
    spawn,
    torchrun_env,
    torchrun_main,
)

__all__ = [
    "DEFAULT_GRACE",
    "DEFAULT_START_METHOD",
    "DEFAULT_TIMEOUT",
    "RESTART_COUNT_ENV",
    "START_METHODS",
    "MainGuardError",
    "PeerFailureError",
    "ProcessOutcome",
    "ProcessSupervisor",
    "ProcessTimeoutError",
    "RankFailedError",
    "StartMethod",
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

# The public classes live in submodules; they are named (in tracebacks, reprs and pickles) as
# what users import: distoptim.launch.RankFailedError, not distoptim.launch.failures.
for _cls in (
    MainGuardError,
    PeerFailureError,
    ProcessOutcome,
    ProcessSupervisor,
    ProcessTimeoutError,
    RankFailedError,
    StartMethod,
):
    _cls.__module__ = __name__
del _cls
