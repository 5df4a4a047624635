"""How a local run mirrors torchrun: a process group per process, and the torchrun entry.

Owns: the environment torchrun would set (:func:`torchrun_env`), :func:`spawn` (a
``torch.distributed`` process group around ``fn`` in every process), :func:`torchrun_main`
(the same ``fn`` under ``torchrun``) and the process-group hygiene both need
(:func:`import_dynamo_before_groups`, releasing device meshes).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import check_int, check_seconds, check_type
from distoptim.launch.child import report_failure
from distoptim.launch.failures import exit_if_bootstrapping
from distoptim.launch.start import DEFAULT_START_METHOD, StartMethod
from distoptim.launch.supervisor import DEFAULT_GRACE, DEFAULT_TIMEOUT, run_processes
from distoptim.netcheck import check_torchrun_network


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
    start_method: str | StartMethod = DEFAULT_START_METHOD,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nprocs`` local ranks; return values in rank order.

    Each rank has the default ``torch.distributed`` process group initialized (``backend``,
    loopback, a free port) with ``timeout`` as the collective timeout too. A rank that raises
    re-raises in the parent as :class:`RankFailedError` for the *root cause* (the first
    exception raised in user code on any rank, with its traceback; the other ranks' consequent
    errors, e.g. gloo's "Connection closed by peer", listed after it); a rank that dies or
    hangs ends the call within ``timeout`` (:class:`RankFailedError` /
    :class:`ProcessTimeoutError`), with every process killed.

    ``fn`` must be a module-level function (it is pickled; ``start_method``: ``"forkserver"``
    or ``"spawn"``, see :class:`ProcessSupervisor`). The same ``fn`` runs under torchrun with
    :func:`torchrun_main`.
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
            start_method=start_method,
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
