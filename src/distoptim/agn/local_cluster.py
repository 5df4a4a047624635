"""Local clusters: every shard and worker of an AGN cluster as a process of this machine.

Owns: :class:`LocalCluster` (shards restarted from their checkpoints, late workers added while
it runs) and :func:`spawn` (``LocalCluster(...).start().wait()``). Each process joins the
cluster through :meth:`Cluster.from_env <distoptim.agn.cluster.Cluster.from_env>` (roles, store
keys and the end of a run: :mod:`distoptim.agn.cluster`); the parent supervises them
(:class:`~distoptim.launch.ProcessSupervisor`), restarts a shard that died, and merges the
shards' reports into a :class:`ClusterResult`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from distoptim.agn.cluster import (
    DEFAULT_RPC_TIMEOUT,
    JOB_ENV,
    JOIN_ENV,
    TASK_ENV,
    Cluster,
    ClusterOptions,
    ClusterStats,
    merge_reports,
    store_namespace,
)
from distoptim.checks import (
    check_choice,
    check_int,
    check_optional_int,
    check_seconds,
    type_name,
)
from distoptim.launch import (
    DEFAULT_GRACE,
    DEFAULT_START_METHOD,
    ProcessOutcome,
    ProcessSupervisor,
    RankFailedError,
    report_failure,
    root_cause,
    torchrun_env,
)
from distoptim.launch.start import resolve_start_method

__all__ = ["STARTUP_POLICIES", "ClusterResult", "LocalCluster", "WorkerStartupError", "spawn"]

STARTUP_POLICIES = ("fail", "drop")
"""What a local cluster does when a worker dies before it joined: fail the run, or drop it."""


@dataclass
class ClusterResult:
    """What :func:`spawn` returns.

    ``worker_results``: each worker's return value in task order, late workers after the
    expected ones (``None`` for a dead worker). ``center``: the final center tensors in
    parameter order (of the only optimizer; with several optimizers, of the first one seeded --
    see ``centers``). ``centers``/``placement``: per optimizer name, the center tensors and the
    shard that held each parameter.
    """

    worker_results: list[Any]
    center: list[torch.Tensor] | None
    stats: ClusterStats
    centers: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    placement: dict[str, list[int]] = field(default_factory=dict)


def _spawn_main(
    num_ps: int, options: ClusterOptions, worker_fn: Callable[..., Any], args: tuple[Any, ...]
) -> Any:
    """A local cluster process: serve (shard) or run ``worker_fn(ctx, *args)`` (worker)."""
    cluster = Cluster.from_env(num_ps=num_ps, options=options)
    if cluster.is_ps:
        try:
            return cluster.serve()
        except BaseException as exc:
            report_failure(exc)
            raise
        finally:
            cluster.shutdown()
    ok = False
    try:
        value = worker_fn(cluster, *args)
        ok = True
        return value
    except BaseException as exc:
        report_failure(exc)  # before leaving the cluster: the cause reaches the launcher first
        raise
    finally:
        cluster.shutdown(failed=not ok)


class WorkerStartupError(RankFailedError):
    """A worker process died before it had joined the cluster (``on_startup_failure="fail"``)."""


class LocalCluster:
    """A cluster of local processes: ``num_ps`` shards and ``num_worker`` workers running
    ``worker_fn(ctx, *args)``; more workers may join while it runs.

    ``start()`` starts every process and returns; :meth:`add_worker` adds a late worker
    (``"p2p"``); :meth:`wait` blocks until the run is over and returns its
    :class:`ClusterResult`. :func:`spawn` is ``LocalCluster(...).start().wait()``. The
    arguments are those of :func:`spawn`; a ``with`` block kills whatever still runs at its end.
    """

    def __init__(
        self,
        worker_fn: Callable[..., Any],
        num_worker: int,
        num_ps: int = 1,
        args: tuple[Any, ...] = (),
        timeout: float = 300.0,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        *,
        rpc_timeout: float | None = None,
        strategy: str = "round_robin",
        num_threads: int | None = None,
        transport: str = "p2p",
        max_restarts: int = 0,
        reconnect_timeout: float | None = None,
        on_startup_failure: str = "fail",
        idle_timeout: float | None = None,
        grace: float = DEFAULT_GRACE,
        start_method: str = DEFAULT_START_METHOD,
    ) -> None:
        if not callable(worker_fn):
            raise TypeError(f"worker_fn must be callable, got {type_name(worker_fn)}")
        num_worker = check_int("num_worker", num_worker, 1)
        num_ps = check_int("num_ps", num_ps, 1)
        if not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type_name(args)}")
        timeout = check_seconds("timeout", timeout)
        if rpc_timeout is None:
            rpc_timeout = min(DEFAULT_RPC_TIMEOUT, timeout)
        num_threads = check_optional_int("num_threads", num_threads, 1)
        max_restarts = check_int("max_restarts", max_restarts, 0)
        on_startup_failure = check_choice(
            "on_startup_failure", on_startup_failure, STARTUP_POLICIES, fold_case=False
        )
        options = ClusterOptions(
            rpc_timeout=rpc_timeout,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            strategy=strategy,
            transport=transport,
            reconnect_timeout=0.0 if reconnect_timeout is None else reconnect_timeout,
            idle_timeout=timeout if idle_timeout is None else idle_timeout,
        )
        if max_restarts and options.transport != "p2p":
            raise ValueError("restarting a shard needs transport='p2p' (rpc's world is fixed)")
        if max_restarts and options.checkpoint_dir is None:
            raise ValueError(
                "max_restarts needs checkpoint_dir: a restarted shard resumes its center from "
                "its last checkpoint"
            )
        if reconnect_timeout is None and max_restarts:  # workers wait for a restarted shard
            options = replace(options, reconnect_timeout=options.rpc_timeout)
        if on_startup_failure == "drop" and options.transport != "p2p":
            raise ValueError("on_startup_failure='drop' needs transport='p2p' (rpc starts as one)")
        self.worker_fn = worker_fn
        self.num_worker = num_worker
        self.num_ps = num_ps
        self.args = args
        self.timeout = timeout
        self.options = options
        """What every process of this cluster runs with (:class:`Cluster` takes it)."""
        self.transport = options.transport
        self.max_restarts = max_restarts
        self.on_startup_failure = on_startup_failure
        self.grace = grace
        self.start_method = resolve_start_method(start_method)
        self.num_threads = (
            num_threads
            if num_threads is not None
            else max(1, (os.cpu_count() or 1) // (num_ps + num_worker))
        )
        self._store: dist.TCPStore | None = None
        self._sup: ProcessSupervisor | None = None
        self._thread: threading.Thread | None = None
        self._tasks: dict[int, int] = {}  # supervisor index -> worker task
        self._outcomes: list[ProcessOutcome] | None = None
        self._error: BaseException | None = None
        self._started = 0.0
        self._lock = threading.Lock()
        self.job = f"local-{os.getpid()}-{os.urandom(4).hex()}"
        """This cluster's job id (its processes' keys in its store: :mod:`distoptim.agn.store`)."""

    # ---- running --------------------------------------------------------------------------------
    def _env(self, rank: int) -> dict[str, str]:
        assert self._store is not None
        env = torchrun_env(rank, self.num_ps + self.num_worker, self._store.port)
        env[JOB_ENV] = self.job
        if self.transport == "rpc" and "TORCH_CPP_LOG_LEVEL" not in os.environ:
            # a local rpc shut-down without a global barrier makes TensorPipe log a "pipe
            # closed" warning per connection: expected here and says nothing useful
            env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        return env

    def start(self) -> LocalCluster:
        """Start the shards and the expected workers; returns at once."""
        if self._sup is not None:
            raise RuntimeError("this cluster was started already")
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._sup = ProcessSupervisor(
            timeout=self.timeout,
            grace=self.grace,
            num_threads=self.num_threads,
            on_failure=self._on_worker_failure,
            start_method=self.start_method,
        )
        self._started = time.monotonic()
        main = (self.num_ps, self.options, self.worker_fn, self.args)
        try:
            for s in range(self.num_ps):
                self._sup.add(
                    _spawn_main,
                    main,
                    name=f"ps {s}",
                    env=self._env(s),
                    restarts=self.max_restarts,
                    critical=True,
                )
            for t in range(self.num_worker):
                index = self._sup.add(
                    _spawn_main,
                    main,
                    name=f"worker {t}",
                    env=self._env(self.num_ps + t),
                    critical=False,
                )
                self._tasks[index] = t
        except BaseException:
            self._sup.close()
            raise
        self._thread = threading.Thread(target=self._supervise, name="agn-local-cluster")
        self._thread.start()
        return self

    def _supervise(self) -> None:
        assert self._sup is not None
        try:
            self._outcomes = self._sup.run()
        except BaseException as exc:
            self._error = exc

    def add_worker(self, args: tuple[Any, ...] | None = None) -> int:
        """Start a late worker running ``worker_fn(ctx, *args)`` (default: the cluster's
        ``args``); returns its task index. It joins the running cluster, pulls the current
        center and commits like the others; ``"p2p"`` only."""
        if self.transport != "p2p":
            raise ValueError("late workers need transport='p2p' (rpc's world is fixed at start)")
        if self._sup is None or self._store is None:
            raise RuntimeError("start() the cluster before adding workers")
        if args is not None and not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        with self._lock:
            ns = store_namespace(self.job)
            task = self.num_worker + int(self._store.add(f"{ns}/late", 1)) - 1
            env = {
                **self._env(0),
                JOIN_ENV: f"127.0.0.1:{self._store.port}",
                TASK_ENV: str(task),
            }
            for k in ("RANK", "LOCAL_RANK"):
                env.pop(k, None)
            main = (self.num_ps, self.options, self.worker_fn, self.args if args is None else args)
            index = self._sup.add(_spawn_main, main, name=f"worker {task}", env=env, critical=False)
            self._tasks[index] = task
        return task

    def _on_worker_failure(self, outcome: ProcessOutcome) -> None:
        """A worker process failed: mark it in the store; a death at start-up fails the run."""
        assert self._store is not None
        task = self._tasks[outcome.index]
        ns = store_namespace(self.job)
        up = self._store.check([f"{ns}/worker/{task}/up"])
        if not outcome.raised and not up and self.on_startup_failure == "fail":
            raise WorkerStartupError(
                outcome.index,
                outcome.name,
                f"died during start-up, before it joined the cluster ({outcome.headline()}); "
                "pass on_startup_failure='drop' to go on without it",
                None,
            )
        key = f"{ns}/worker/{task}/end"
        if not self._store.check([key]):
            self._store.set(key, "failed" if outcome.raised else "dead")

    def wait(self) -> ClusterResult:
        """Block until the run is over; its :class:`ClusterResult`.

        Raises what failed: a shard (after its restarts), a worker that died at start-up
        (``on_startup_failure="fail"``), or -- once every process ended -- the exception of a
        worker that raised (the root cause among failures, see :mod:`distoptim.launch`).
        """
        if self._thread is None:
            raise RuntimeError("start() the cluster first")
        self._thread.join()
        try:
            if self._error is not None:
                raise self._error
            assert self._outcomes is not None
            return self._result(self._outcomes)
        finally:
            self.close()

    def _result(self, outcomes: list[ProcessOutcome]) -> ClusterResult:
        wall = time.monotonic() - self._started
        shards = outcomes[: self.num_ps]
        workers = sorted((self._tasks[o.index], o) for o in outcomes[self.num_ps :])
        failures = [o for o in outcomes if not o.ok]
        raised = [o for _, o in workers if not o.ok and o.raised]
        if raised or any(not o.ok for o in shards):
            root = root_cause(failures)
            others = [o for o in failures if o is not root]
            raise RankFailedError(
                root.index, root.name, root.headline(), root.error, others
            ) from root.exception
        reports = [o.value for o in shards]
        num_tasks = len(workers)
        stats, centers, placement = merge_reports(reports, num_tasks, wall)
        dead = set(stats.dead_workers) | {t for t, o in workers if not o.ok}
        stats.dead_workers = sorted(dead)
        stats.shard_restarts = sum(o.restarts for o in shards)
        return ClusterResult(
            worker_results=[o.value if o.ok else None for _, o in workers],
            center=next(iter(centers.values()), None),
            stats=stats,
            centers=centers,
            placement=placement,
        )

    def pid(self, name: str) -> int | None:
        """The process id of ``"ps 0"``, ``"worker 1"``, ... (it changes when a shard restarts)."""
        if self._sup is None:
            return None
        names = self._sup.names
        return self._sup.pid(names.index(name)) if name in names else None

    def close(self) -> None:
        """Kill whatever still runs (idempotent)."""
        if self._sup is not None:
            self._sup.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
        self._store = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def spawn(
    worker_fn: Callable[..., Any], num_worker: int, *args: Any, **kwargs: Any
) -> ClusterResult:
    """Run a local AGN cluster: ``num_ps`` shard processes and ``num_worker`` worker processes.

    ``LocalCluster(worker_fn, num_worker, *args, **kwargs).start().wait()``: the arguments are
    :class:`LocalCluster`'s -- ``num_ps=1, args=(), timeout=300.0, checkpoint_dir=None,
    checkpoint_every=None`` and, keyword-only, ``rpc_timeout``, ``strategy``, ``num_threads``,
    ``transport``, ``max_restarts``, ``reconnect_timeout``, ``on_startup_failure``,
    ``idle_timeout``, ``grace``, ``start_method`` (``"forkserver"`` or ``"spawn"``, see
    :class:`~distoptim.launch.ProcessSupervisor`) -- described here.

    Each worker runs ``worker_fn(ctx, *args)`` (``ctx``: its :class:`Cluster`, with
    ``task_index``, ``is_chief``, ``num_worker``, ``num_ps``, ``custom_getter``); shards serve
    until every worker returned, raised or died. ``worker_fn`` must be a module-level function.

    * A worker that **dies** (killed, crashed) after it joined does not stop the others: its
      result is ``None`` and ``stats.dead_workers`` names it. One that dies **during start-up**
      (before it connected to every shard) fails the run at once with
      :class:`WorkerStartupError` naming it, unless ``on_startup_failure="drop"`` (p2p).
    * A worker that **raises** does not stop the others either, but its exception is re-raised
      here (:class:`~distoptim.launch.RankFailedError`, the root cause first) once the run ends.
    * A shard that dies is restarted up to ``max_restarts`` times (p2p; needs
      ``checkpoint_dir``) from its latest checkpoint: workers wait for it (``reconnect_timeout``,
      default ``rpc_timeout`` when restarts are allowed), reconnect, pull the resumed center and
      go on; commits accepted after that checkpoint are lost (at most ``checkpoint_every``). A
      shard that fails beyond its restarts fails the run.

    ``timeout`` bounds the whole run (every process is killed after it); ``rpc_timeout``
    (default ``min(60, timeout)``) bounds each request; ``transport``: ``"p2p"`` (default) or
    ``"rpc"`` (see :mod:`distoptim.agn.transport`). Late workers: use :class:`LocalCluster`.
    """
    cluster = LocalCluster(worker_fn, num_worker, *args, **kwargs)
    with cluster:
        return cluster.start().wait()
