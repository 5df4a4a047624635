"""The AGN cluster: roles, ``torch.distributed.rpc`` start-up and shut-down, local ``spawn``.

Owns: who is a parameter server and who is a worker, the RPC names, the calls a worker makes to
the shards (each with a timeout and a clear error when a shard is gone), the serving loop of a
shard (ends when every living worker finished; dead workers are detected, never waited for),
and :func:`spawn`, which runs a whole cluster of local processes.

Roles (the same under :func:`spawn` and under ``torchrun``)
------------------------------------------------------------
``WORLD_SIZE = num_ps + num_worker`` processes. Ranks ``0 .. num_ps-1`` are the parameter-server
shards (RPC names ``"ps:0"``, ...), ranks ``num_ps ..`` are the workers (``"worker:0"``, ...;
``task_index = rank - num_ps``; task 0 is the chief). Every process calls
``rpc.init_rpc(name, rank, world_size, TensorPipeRpcBackendOptions(init_method="env://"))``,
so a local run (:func:`spawn`: the parent hosts the ``TCPStore`` and gives each child torchrun's
environment) and a torchrun job take exactly the same code path: :meth:`Cluster.from_env`.

Ending a run
------------
A worker ends with :meth:`Cluster.shutdown`: it tells every shard it finished (RPC), then sets
``left/<task>`` in the rendezvous store once those replies arrived, then shuts its RPC agent
down without a global barrier (``graceful=False``: a barrier would wait for dead peers). A shard's
:meth:`Cluster.serve` returns when every worker finished or is dead (it pings silent workers
every ``probe_period_s``; a worker whose process is gone fails the ping at once), waits for the
``left`` marks so no reply is cut off, writes a final checkpoint and returns its report.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from distoptim.agn import server as _server
from distoptim.agn.getter import STRATEGIES, AGNCustomGetter
from distoptim.launch import (
    RankFailedError,
    import_dynamo_before_groups,
    require_torchrun_env,
    run_processes,
    torchrun_env,
)
from distoptim.netcheck import check_torchrun_network

__all__ = [
    "Cluster",
    "ClusterResult",
    "ClusterStats",
    "ParameterServerError",
    "ShardReport",
    "current_cluster",
    "merge_reports",
    "spawn",
]

DEFAULT_RPC_TIMEOUT = 60.0
"""Seconds any single RPC may take (also how long a worker waits for the chief's seed)."""


class ParameterServerError(RuntimeError):
    """A parameter-server shard did not answer (it died, hung, or shut down)."""


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class ClusterStats:
    """What the parameter servers counted (merged over shards and optimizers).

    * ``commits_per_worker``: accepted commits of each worker task.
    * ``refused_commits``: commits refused for a non-finite value (center untouched).
    * ``staleness_histogram``: ``{s: n}`` — ``n`` accepted commits were made ``s`` center
      versions after the committing worker's last pull (0: nobody committed in between).
    * ``bytes_in`` / ``bytes_out``: tensor payload bytes received / sent by the shards (seeds,
      commits, pulls), summed over shards.
    * ``global_step``: accepted commits (the center's version), summed over optimizers.
    * ``dead_workers``: tasks that stopped without finishing (killed, crashed, or raised).
    * ``per_optimizer``: the same figures per optimizer name.
    """

    commits_per_worker: dict[int, int] = field(default_factory=dict)
    refused_commits: int = 0
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    wall_time_s: float = 0.0
    dead_workers: list[int] = field(default_factory=list)
    global_step: int = 0
    per_optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy (dict keys become strings)."""
        return json.loads(json.dumps(asdict(self)))


@dataclass
class ClusterResult:
    """What :func:`spawn` returns.

    ``worker_results``: each worker's return value in task order (``None`` for a dead worker).
    ``center``: the final center tensors in parameter order (of the only optimizer; with several
    optimizers, of the first one seeded — see ``centers``). ``centers``/``placement``: per
    optimizer name, the center tensors and the shard that held each parameter.
    """

    worker_results: list[Any]
    center: list[torch.Tensor] | None
    stats: ClusterStats
    centers: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    placement: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ShardReport:
    """What one shard's :meth:`Cluster.serve` returns (``stats`` covers this shard only)."""

    shard: int
    tables: dict[str, dict[str, Any]]
    dead_workers: list[int]
    finished_workers: list[int]
    wall_time_s: float

    @property
    def stats(self) -> ClusterStats:
        return merge_reports([self], num_worker=None, wall_time_s=self.wall_time_s)[0]


def merge_reports(
    reports: Sequence[ShardReport], num_worker: int | None, wall_time_s: float
) -> tuple[ClusterStats, dict[str, list[torch.Tensor]], dict[str, list[int]]]:
    """Merge shard reports into cluster stats, centers and placements.

    Per optimizer, counts of commits (per worker, refused, staleness, version) come from the
    lowest shard holding any of its parameters — every commit reaches every shard that holds
    parameters, so each of them counts it once; bytes are summed over shards.
    """
    names: list[str] = []
    for r in sorted(reports, key=lambda r: r.shard):
        names += [n for n in r.tables if n not in names]
    total = ClusterStats(wall_time_s=wall_time_s)
    commits: Counter[int] = Counter({t: 0 for t in range(num_worker or 0)})
    staleness: Counter[int] = Counter()
    centers: dict[str, list[torch.Tensor]] = {}
    placement: dict[str, list[int]] = {}
    for name in names:
        held = [(r.shard, r.tables[name]) for r in reports if name in r.tables]
        by_index: dict[int, tuple[int, torch.Tensor]] = {}
        for shard, t in held:
            for i, c in zip(t["param_indices"], t["center"]):
                by_index[i] = (shard, c)
        primary = min((s, t) for s, t in held if t["param_indices"])[1]["counters"]
        n = len(by_index)
        centers[name] = [by_index[i][1] for i in range(n)] if set(by_index) == set(range(n)) else []
        placement[name] = [by_index[i][0] for i in range(n)] if centers[name] else []
        b_in = sum(t["counters"]["bytes_in"] for _, t in held)
        b_out = sum(t["counters"]["bytes_out"] for _, t in held)
        per = {
            "commits_per_worker": dict(sorted(primary["commits"].items())),
            "refused_commits": primary["refused"],
            "staleness_histogram": dict(sorted(primary["staleness"].items())),
            "bytes_in": b_in,
            "bytes_out": b_out,
            "global_step": primary["version"],
            "algorithm": held[0][1]["algorithm"],
            "resumed": any(t["resumed"] for _, t in held),
        }
        total.per_optimizer[name] = per
        commits.update(primary["commits"])
        staleness.update(primary["staleness"])
        total.refused_commits += primary["refused"]
        total.bytes_in += b_in
        total.bytes_out += b_out
        total.global_step += primary["version"]
    total.commits_per_worker = dict(sorted(commits.items()))
    total.staleness_histogram = dict(sorted(staleness.items()))
    total.dead_workers = sorted({t for r in reports for t in r.dead_workers})
    return total, centers, placement


# ---------------------------------------------------------------------------------------------
# the cluster
# ---------------------------------------------------------------------------------------------
_CURRENT: Cluster | None = None


def current_cluster() -> Cluster:
    """The cluster this process belongs to; a clear error outside of one."""
    if _CURRENT is None:
        raise RuntimeError(
            "this process is not part of an AGN cluster: run the worker function with "
            "distoptim.agn.spawn(worker_fn, num_worker, num_ps=...), or under torchrun create "
            "cluster = distoptim.agn.Cluster.from_env(num_ps=...) first"
        )
    return _CURRENT


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def _check_checkpointing(checkpoint_dir: Any, checkpoint_every: Any) -> None:
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_dir must be a path or None, got {type(checkpoint_dir).__name__}"
        )
    if checkpoint_every is not None:
        if (
            isinstance(checkpoint_every, bool)
            or not isinstance(checkpoint_every, int)
            or checkpoint_every < 1
        ):
            raise ValueError(
                f"checkpoint_every must be None or an int >= 1, got {checkpoint_every!r}"
            )
        if checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir (where to write checkpoints)")


class Cluster:
    """This process's place in an AGN cluster (one PS shard or one worker).

    Build it with :meth:`from_env` (torchrun, or the children of :func:`spawn`). Attributes:
    ``is_ps``, ``is_worker``, ``task_index`` (worker index, or shard index on a PS),
    ``is_chief`` (worker 0), ``num_ps``, ``num_worker``, ``custom_getter`` (the default
    placement), ``rpc_timeout``. A worker function receives the cluster itself as ``ctx``.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        num_ps: int,
        master_addr: str,
        master_port: int,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        strategy: str = "round_robin",
        probe_period_s: float = 1.0,
    ) -> None:
        global _CURRENT
        if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
            raise ValueError(f"num_ps must be an int >= 1, got {num_ps!r}")
        if world_size - num_ps < 1:
            raise ValueError(
                f"an AGN cluster needs at least one worker: WORLD_SIZE={world_size} processes "
                f"with num_ps={num_ps} leaves {world_size - num_ps} (start num_ps + num_worker "
                "processes)"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.rpc_timeout = _check_positive("rpc_timeout", rpc_timeout)
        self.probe_period_s = _check_positive("probe_period_s", probe_period_s)
        _check_checkpointing(checkpoint_dir, checkpoint_every)
        if _CURRENT is not None:
            raise RuntimeError(
                "this process already belongs to an AGN cluster (shut it down first)"
            )
        self.rank = rank
        self.world_size = world_size
        self.num_ps = num_ps
        self.num_worker = world_size - num_ps
        self.is_ps = rank < num_ps
        self.is_worker = not self.is_ps
        self.task_index = rank if self.is_ps else rank - num_ps
        self.is_chief = self.is_worker and self.task_index == 0
        self.custom_getter = AGNCustomGetter(num_ps=num_ps, strategy=strategy)
        self.name = self.ps_name(rank) if self.is_ps else self.worker_name(self.task_index)
        self._closed = False
        self._server: _server.ParameterServer | None = None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._store = dist.PrefixStore(
            f"distoptim.agn/{restart}/",
            dist.TCPStore(
                master_addr,
                master_port,
                is_master=False,
                timeout=timedelta(seconds=self.rpc_timeout),
            ),
        )
        if self.is_ps:
            self._server = _server.ParameterServer(
                rank, num_ps, self.num_worker, checkpoint_dir, checkpoint_every
            )
            _server.install(self._server)
        options = rpc.TensorPipeRpcBackendOptions(
            init_method="env://",
            rpc_timeout=self.rpc_timeout,
            num_worker_threads=max(16, self.num_worker + 8),
        )
        import_dynamo_before_groups()  # rpc's gloo group must not outlive shutdown
        try:
            with warnings.catch_warnings():
                # rpc's start-up exchanges device maps over a gloo group the old way; not ours
                warnings.filterwarnings("ignore", message="You are using a Backend")
                rpc.init_rpc(
                    self.name, rank=rank, world_size=world_size, rpc_backend_options=options
                )
        except BaseException:
            if self.is_ps:
                _server.install(None)
            raise
        _CURRENT = self

    @classmethod
    def from_env(
        cls,
        num_ps: int = 1,
        *,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        strategy: str = "round_robin",
        probe_period_s: float = 1.0,
    ) -> Cluster:
        """Join the cluster described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``): the first ``num_ps`` ranks serve, the rest work."""
        require_torchrun_env("Cluster.from_env", "distoptim.agn.spawn")
        check_torchrun_network("Cluster.from_env", ("gloo", "tensorpipe"), rpc_timeout)
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            num_ps=num_ps,
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            rpc_timeout=rpc_timeout,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            strategy=strategy,
            probe_period_s=probe_period_s,
        )

    def __repr__(self) -> str:
        return (
            f"Cluster({self.name}, num_ps={self.num_ps}, num_worker={self.num_worker}, "
            f"rank={self.rank})"
        )

    @staticmethod
    def ps_name(shard: int) -> str:
        return f"ps:{shard}"

    @staticmethod
    def worker_name(task: int) -> str:
        return f"worker:{task}"

    # ---- worker -> shard calls ------------------------------------------------------------------
    def call_async(
        self,
        shard: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None = None,
    ) -> tuple[torch.futures.Future, float, float]:
        """Start ``fn(*args)`` on shard ``shard``; returns (future, start time, timeout)."""
        t = self.rpc_timeout if timeout is None else timeout
        fut = rpc.rpc_async(self.ps_name(shard), fn, args=args, timeout=t)
        return fut, time.monotonic(), t

    def result(self, call: tuple[torch.futures.Future, float, float], shard: int, what: str) -> Any:
        """Wait for a call started by :meth:`call_async`; server errors re-raise by type."""
        fut, started, timeout = call
        try:
            value = fut.wait()
        except Exception as exc:
            raise ParameterServerError(
                f"parameter server {self.ps_name(shard)!r} did not complete {what} "
                f"({time.monotonic() - started:.1f}s, rpc timeout {timeout:g}s): {exc}. The "
                "shard died, hung or already shut down; restart the cluster (a shard started "
                "with checkpoint_dir resumes from its last checkpoint and workers re-pull)"
            ) from exc
        if isinstance(value, _server.RemoteError):
            raise value.to_exception()
        return value

    # ---- serving --------------------------------------------------------------------------------
    def _probe(self, tasks: Sequence[int]) -> list[int]:
        """Workers among ``tasks`` that do not answer a ping (their process is gone)."""
        calls = {
            t: rpc.rpc_async(self.worker_name(t), _server.rpc_ping, timeout=self.rpc_timeout)
            for t in tasks
        }
        gone = []
        for t, fut in calls.items():
            try:
                fut.wait()
            except Exception:
                gone.append(t)
        return gone

    def serve(self, timeout: float | None = None) -> ShardReport:
        """Serve until every worker finished or died; returns this shard's report.

        ``timeout`` (seconds, default unbounded) bounds the wait for workers.
        """
        if not self.is_ps or self._server is None:
            raise RuntimeError(f"serve() runs on parameter servers; this process is {self.name}")
        srv = self._server
        srv.wait_for_workers(self._probe, self.probe_period_s, timeout)
        for t in range(self.num_worker):  # replies to `finish` are on their way; let them land
            if srv.is_finished(t):
                with contextlib.suppress(dist.DistStoreError):
                    self._store.wait([f"left/{t}"], timedelta(seconds=self.rpc_timeout))
        srv.checkpoint()
        rep = srv.report()
        return ShardReport(
            shard=rep["shard"],
            tables=rep["tables"],
            dead_workers=rep["dead_workers"],
            finished_workers=rep["finished_workers"],
            wall_time_s=rep["wall_time_s"],
        )

    # ---- shut-down ------------------------------------------------------------------------------
    def shutdown(self, failed: bool = False) -> None:
        """Leave the cluster (idempotent). A worker first tells every shard it is done
        (``failed=True``: it stopped early and is listed among ``dead_workers``)."""
        global _CURRENT
        if self._closed:
            return
        self._closed = True
        try:
            if self.is_worker:
                calls = [
                    (s, self.call_async(s, _server.rpc_finish, (self.task_index, failed)))
                    for s in range(self.num_ps)
                ]
                for s, call in calls:
                    with contextlib.suppress(ParameterServerError):  # a dead shard needs no news
                        self.result(call, s, "finish")
                self._store.set(f"left/{self.task_index}", "1")
        finally:
            rpc.shutdown(graceful=False)
            if self.is_ps:
                _server.install(None)
            _CURRENT = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.shutdown(failed=exc_type is not None)


# ---------------------------------------------------------------------------------------------
# spawn: a local cluster
# ---------------------------------------------------------------------------------------------
def _spawn_main(
    num_ps: int, options: dict[str, Any], worker_fn: Callable[..., Any], args: tuple[Any, ...]
) -> Any:
    cluster = Cluster.from_env(num_ps=num_ps, **options)
    if cluster.is_ps:
        try:
            return cluster.serve()
        finally:
            cluster.shutdown()
    ok = False
    try:
        value = worker_fn(cluster, *args)
        ok = True
        return value
    finally:
        cluster.shutdown(failed=not ok)


def spawn(
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
) -> ClusterResult:
    """Run a local AGN cluster: ``num_ps`` shard processes and ``num_worker`` worker processes.

    Each worker runs ``worker_fn(ctx, *args)`` (``ctx``: its :class:`Cluster`, with
    ``task_index``, ``is_chief``, ``num_worker``, ``num_ps``, ``custom_getter``); shards serve
    until every worker returned or died. ``worker_fn`` must be a module-level function.

    A worker that dies (killed, crashed) does not stop the others: its result is ``None`` and
    ``stats.dead_workers`` names it. A worker that *raises* also does not stop the others, but
    its error is re-raised here (:class:`~distoptim.launch.RankFailedError`) once the run ends,
    as is a shard's failure. ``timeout`` bounds the whole run (every process is killed after it);
    ``rpc_timeout`` (default ``min(60, timeout)``) bounds each RPC.
    """
    if not callable(worker_fn):
        raise TypeError(f"worker_fn must be callable, got {type(worker_fn).__name__}")
    for label, v in (("num_worker", num_worker), ("num_ps", num_ps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{label} must be an int >= 1, got {v!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")
    timeout = _check_positive("timeout", timeout)
    rpc_timeout = _check_positive(
        "rpc_timeout", min(DEFAULT_RPC_TIMEOUT, timeout) if rpc_timeout is None else rpc_timeout
    )
    _check_checkpointing(checkpoint_dir, checkpoint_every)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")

    world = num_ps + num_worker
    options = {
        "rpc_timeout": rpc_timeout,
        "checkpoint_dir": None if checkpoint_dir is None else os.fspath(checkpoint_dir),
        "checkpoint_every": checkpoint_every,
        "strategy": strategy,
    }
    names = [f"ps {i}" for i in range(num_ps)] + [f"worker {t}" for t in range(num_worker)]
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    started = time.monotonic()
    # Children inherit the environment at start: unless the user chose a level, keep their C++
    # logs to errors -- a local shut-down without a global barrier makes TensorPipe log a
    # "pipe closed" warning per connection, which is expected here and says nothing useful.
    quiet = "TORCH_CPP_LOG_LEVEL" not in os.environ
    if quiet:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        outcomes = run_processes(
            _spawn_main,
            [(num_ps, options, worker_fn, args)] * world,
            timeout=timeout,
            names=names,
            envs=[torchrun_env(r, world, store.port) for r in range(world)],
            fail_fast=False,
            num_threads=num_threads,
        )
    finally:
        if quiet:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
        del store
    wall = time.monotonic() - started
    for o in outcomes[:num_ps]:
        if not o.ok:
            raise RankFailedError(o.index, o.name, o.error or "failed", o.error) from o.exception
    for o in outcomes[num_ps:]:
        if not o.ok and o.exitcode == 0:  # it raised (the error was reported), it did not die
            raise RankFailedError(o.index, o.name, o.headline(), o.error) from o.exception
    reports = [o.value for o in outcomes[:num_ps]]
    stats, centers, placement = merge_reports(reports, num_worker, wall)
    dead = set(stats.dead_workers) | {o.index - num_ps for o in outcomes[num_ps:] if not o.ok}
    stats.dead_workers = sorted(dead)
    return ClusterResult(
        worker_results=[o.value if o.ok else None for o in outcomes[num_ps:]],
        center=next(iter(centers.values()), None),
        stats=stats,
        centers=centers,
        placement=placement,
    )
