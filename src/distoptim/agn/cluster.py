"""The AGN cluster: roles, membership, the transport, and local clusters (spawn, LocalCluster).

Owns: who is a parameter-server shard and who is a worker, the cluster's keys in the job's
``TCPStore``, the requests a worker makes to the shards (each bounded; a clear error, or a
bounded reconnection, when a shard is gone), the serving loop of a shard (it ends when every
worker the cluster knows of finished, failed or died; dead workers are detected, never waited
for), and local clusters: :class:`LocalCluster` (shards restarted from their checkpoints, late
workers added while it runs) and :func:`spawn`.

Roles (the same under :func:`spawn` and under ``torchrun``)
------------------------------------------------------------
``WORLD_SIZE = num_ps + num_worker`` processes. Ranks ``0 .. num_ps-1`` are the parameter-server
shards, ranks ``num_ps ..`` the workers (``task_index = rank - num_ps``; task 0 is the chief).
``num_worker`` is the *expected* count: with the ``"p2p"`` transport a worker may also join a
running cluster later (:meth:`Cluster.join`; ``DISTOPTIM_AGN_JOIN=host:port`` makes
:meth:`Cluster.from_env` do it, e.g. for a torchrun job started later on another node;
:meth:`LocalCluster.add_worker` locally); it gets the next task index after the expected ones.

Keys in the store (under ``distoptim.agn/<TORCHELASTIC_RESTART_COUNT>``: a torchrun restart of
the whole job starts afresh; ``distoptim.agn/current`` names the namespace for late joiners)
-----------------------------------------------------------------------------------------
* ``config``: ``num_ps``, ``num_worker``, transport and placement strategy (for late joiners);
* ``late``: a counter handing out late workers' task indices;
* ``worker/<t>/starting``: worker ``t`` reached the cluster and starts connecting (set first
  thing; from then on its start-up is bounded: it connects within its own bound or gives up);
* ``worker/<t>/up``: worker ``t`` is connected to every shard (its start-up is over);
* ``worker/<t>/end``: ``finished``, ``failed`` (it raised) or ``dead`` (set by the launcher when
  the process died); shards read it for workers they cannot see otherwise;
* the transport's own keys (``shard/<s>/...``, :mod:`distoptim.agn.transport.p2p`).

Ending a run
------------
A worker ends with :meth:`Cluster.shutdown`: it sends ``Finish`` to every shard, marks
``worker/<t>/end`` and closes its connections. A shard's :meth:`Cluster.serve` returns when every
known worker is finished, failed or dead, writes a final checkpoint and returns its
:class:`ShardReport`. Both transports end quietly: nothing is printed at a clean end.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distoptim.agn.flat import Chunk
from distoptim.agn.getter import STRATEGIES, AGNCustomGetter
from distoptim.agn.server import ParameterServer
from distoptim.agn.transport import TRANSPORTS
from distoptim.agn.transport.base import ParameterServerError, Pending, Stream, Transport
from distoptim.agn.transport.messages import ErrorReply, Finish, Reply, Request
from distoptim.agn.transport.p2p import DEFAULT_IDLE_TIMEOUT, P2PTransport
from distoptim.checks import check_positive
from distoptim.launch import (
    DEFAULT_GRACE,
    ProcessOutcome,
    ProcessSupervisor,
    RankFailedError,
    report_failure,
    require_torchrun_env,
    root_cause,
    torchrun_env,
)
from distoptim.netcheck import check_torchrun_network

__all__ = [
    "JOIN_ENV",
    "STARTUP_POLICIES",
    "TRANSPORTS",
    "Cluster",
    "ClusterResult",
    "ClusterStats",
    "LocalCluster",
    "ParameterServerError",
    "ShardReport",
    "WorkerStartupError",
    "current_cluster",
    "merge_reports",
    "spawn",
]

DEFAULT_RPC_TIMEOUT = 60.0
"""Seconds any single request may take (also how long a worker waits for the shards and the
chief's seed at start-up)."""

JOIN_ENV = "DISTOPTIM_AGN_JOIN"
"""``host:port`` of a running cluster's store; :meth:`Cluster.from_env` then joins it, late."""

TASK_ENV = "DISTOPTIM_AGN_TASK"
"""The task index a launcher reserved for a late worker (with :data:`JOIN_ENV`)."""

STARTUP_POLICIES = ("fail", "drop")
"""What a local cluster does when a worker dies before it joined: fail the run, or drop it."""

_CURRENT_KEY = "distoptim.agn/current"


def _namespace() -> str:
    return f"distoptim.agn/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
@dataclass
class ClusterStats:
    """What the parameter servers counted (merged over shards and optimizers).

    * ``commits_per_worker``: accepted commits of each worker task.
    * ``refused_commits``: commits refused for a non-finite value (center untouched);
      ``refused_results``: of those, the ones refused because the *result* would not have been
      finite (the center guard).
    * ``staleness_histogram``: ``{s: n}`` -- ``n`` accepted commits were made ``s`` center
      versions after the committing worker's last pull (0: nobody committed in between).
    * ``bytes_in`` / ``bytes_out``: tensor payload bytes received / sent by the shards (seeds,
      commits, pulls), summed over shards.
    * ``global_step``: accepted commits (the center's version), summed over optimizers.
    * ``dead_workers``: tasks whose process died (killed, crashed) or vanished without a word.
    * ``failed_workers``: tasks that stopped because they raised (their exception is re-raised
      by :func:`spawn`).
    * ``shard_restarts``: how many times shards were restarted (:class:`LocalCluster`).
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
    refused_results: int = 0
    failed_workers: list[int] = field(default_factory=list)
    shard_restarts: int = 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy (dict keys become strings)."""
        return json.loads(json.dumps(asdict(self)))


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


@dataclass
class ShardReport:
    """What one shard's :meth:`Cluster.serve` returns (``stats`` covers this shard only)."""

    shard: int
    tables: dict[str, dict[str, Any]]
    dead_workers: list[int]
    finished_workers: list[int]
    wall_time_s: float
    failed_workers: list[int] = field(default_factory=list)
    incarnation: int = 1

    @property
    def stats(self) -> ClusterStats:
        return merge_reports([self], num_worker=None, wall_time_s=self.wall_time_s)[0]


def merge_reports(
    reports: Sequence[ShardReport], num_worker: int | None, wall_time_s: float
) -> tuple[ClusterStats, dict[str, list[torch.Tensor]], dict[str, list[int]]]:
    """Merge shard reports into cluster stats, centers and placements.

    Per optimizer, counts of commits (per worker, refused, staleness, version) come from the
    lowest shard holding any of its parameters -- every commit reaches every shard that holds
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
            "refused_results": primary.get("refused_result", 0),
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
        total.refused_results += per["refused_results"]
        total.bytes_in += b_in
        total.bytes_out += b_out
        total.global_step += primary["version"]
    total.commits_per_worker = dict(sorted(commits.items()))
    total.staleness_histogram = dict(sorted(staleness.items()))
    failed = {t for r in reports for t in r.failed_workers}
    total.failed_workers = sorted(failed)
    total.dead_workers = sorted({t for r in reports for t in r.dead_workers} - failed)
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


def _check_transport(transport: Any) -> str:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport


def _check_seconds(name: str, value: Any, allow_zero: bool = False) -> float:
    if allow_zero and value == 0 and not isinstance(value, bool):
        return 0.0
    return check_positive(name, value, "seconds")


class Cluster:
    """This process's place in an AGN cluster (one PS shard or one worker).

    Build it with :meth:`from_env` (torchrun, or the children of :func:`spawn`) or
    :meth:`join` (a late worker). Attributes: ``is_ps``, ``is_worker``, ``task_index`` (worker
    index, or shard index on a PS), ``is_chief`` (worker 0), ``is_late``, ``num_ps``,
    ``num_worker`` (the expected count), ``custom_getter`` (the default placement),
    ``rpc_timeout`` (bound of every request), ``reconnect_timeout`` (how long a worker waits for
    a restarted shard; 0: it does not), ``transport`` (the :class:`Transport`). A worker
    function receives the cluster itself as ``ctx``.
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
        transport: str = "p2p",
        reconnect_timeout: float = 0.0,
        idle_timeout: float | None = None,
        late_task: int | None = None,
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
        if late_task is None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.rpc_timeout = _check_seconds("rpc_timeout", rpc_timeout)
        self.probe_period_s = _check_seconds("probe_period_s", probe_period_s)
        self.reconnect_timeout = _check_seconds("reconnect_timeout", reconnect_timeout, True)
        idle = DEFAULT_IDLE_TIMEOUT if idle_timeout is None else idle_timeout
        self.idle_timeout = _check_seconds("idle_timeout", idle)
        _check_checkpointing(checkpoint_dir, checkpoint_every)
        kind = _check_transport(transport)
        if late_task is not None and kind != "p2p":
            raise ValueError("late workers need transport='p2p' (rpc's world is fixed at start)")
        if _CURRENT is not None:
            raise RuntimeError(
                "this process already belongs to an AGN cluster (shut it down first)"
            )
        self.rank = rank
        self.world_size = world_size
        self.num_ps = num_ps
        self.num_worker = world_size - num_ps
        self.is_late = late_task is not None
        self.is_ps = late_task is None and rank < num_ps
        self.is_worker = not self.is_ps
        if late_task is not None:
            self.task_index = late_task
        else:
            self.task_index = rank if self.is_ps else rank - num_ps
        self.is_chief = self.is_worker and self.task_index == 0
        self.strategy = strategy
        self.custom_getter = AGNCustomGetter(num_ps=num_ps, strategy=strategy)
        self.name = f"ps {self.task_index}" if self.is_ps else f"worker {self.task_index}"
        self.transport_name = kind
        self._closed = False
        self._server: ParameterServer | None = None
        self._late_seen: dict[int, float] = {}  # task -> when this shard first saw it starting
        self.namespace = _namespace()
        self._root = dist.TCPStore(
            master_addr, master_port, is_master=False, timeout=timedelta(seconds=self.rpc_timeout)
        )
        self._store = dist.PrefixStore(self.namespace, self._root)
        if self.is_worker:  # the shards time its start-up from here (Cluster._gone)
            self._store.set(f"worker/{self.task_index}/starting", "1")
        self.transport: Transport
        if self.is_ps:
            self._server = ParameterServer(
                self.task_index, num_ps, self.num_worker, checkpoint_dir, checkpoint_every
            )
            if self.task_index == 0:
                self._root.set(_CURRENT_KEY, self.namespace)
                config = {"num_ps": num_ps, "num_worker": self.num_worker, "transport": kind}
                self._store.set("config", pickle.dumps({**config, "strategy": strategy}))
        if kind == "p2p":
            p2p = P2PTransport(
                master_addr,
                master_port,
                self.namespace,
                num_ps=num_ps,
                timeout=self.rpc_timeout,
                idle_timeout=self.idle_timeout,
            )
            self.transport = p2p
            if self._server is not None:
                self._server.incarnation = int(
                    self._store.add(f"shard/{self.task_index}/incarnation", 1)
                )
                p2p.serve(self._server)
            else:
                try:
                    p2p.connect(self.task_index, timeout=self.rpc_timeout)
                except BaseException:
                    p2p.close()
                    raise
        else:
            from distoptim.agn.transport.rpc import RpcTransport

            self.transport = RpcTransport(rank, num_ps, self.num_worker, self.rpc_timeout)
            if self._server is not None:
                self.transport.serve(self._server)
        if self.is_worker:
            self._store.set(f"worker/{self.task_index}/up", "1")
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
        transport: str = "p2p",
        reconnect_timeout: float = 0.0,
        idle_timeout: float | None = None,
    ) -> Cluster:
        """Join the cluster described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``): the first ``num_ps`` ranks serve, the rest work.

        With ``DISTOPTIM_AGN_JOIN=host:port`` set, this process instead joins the running
        cluster whose store is there, as a late worker (:meth:`join`).
        """
        join = os.environ.get(JOIN_ENV)
        if join:
            host, _, port = join.rpartition(":")
            task = os.environ.get(TASK_ENV)
            return cls.join(
                host,
                int(port),
                task_index=None if task is None else int(task),
                rpc_timeout=rpc_timeout,
                reconnect_timeout=reconnect_timeout,
                idle_timeout=idle_timeout,
            )
        require_torchrun_env("Cluster.from_env", "distoptim.agn.spawn")
        kind = _check_transport(transport)
        check_torchrun_network(
            "Cluster.from_env", ("gloo",) if kind == "p2p" else ("gloo", "tensorpipe"), rpc_timeout
        )
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
            transport=kind,
            reconnect_timeout=reconnect_timeout,
            idle_timeout=idle_timeout,
        )

    @classmethod
    def join(
        cls,
        host: str,
        port: int,
        *,
        task_index: int | None = None,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        reconnect_timeout: float = 0.0,
        idle_timeout: float | None = None,
    ) -> Cluster:
        """Join a running cluster (``"p2p"``) as a late worker, through its store at
        ``host:port``. Its task index is the next one after the expected workers (or
        ``task_index``, when a launcher reserved it); it pulls the current center like any
        worker and commits from then on."""
        timeout = _check_seconds("rpc_timeout", rpc_timeout)
        root = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        try:
            namespace = root.get(_CURRENT_KEY).decode()
            config = pickle.loads(root.get(f"{namespace}/config"))
        except dist.DistStoreError as exc:
            raise RuntimeError(
                f"no AGN cluster found in the store at {host}:{port} within {timeout:g}s (its "
                "shard 0 publishes the cluster there when it starts)"
            ) from exc
        if config["transport"] != "p2p":
            raise ValueError(
                f"the cluster at {host}:{port} uses transport {config['transport']!r}; late "
                "workers need 'p2p'"
            )
        if task_index is None:
            late = int(root.add(f"{namespace}/late", 1))
            task_index = config["num_worker"] + late - 1
        return cls(
            rank=-1,
            world_size=config["num_ps"] + config["num_worker"],
            num_ps=config["num_ps"],
            master_addr=host,
            master_port=port,
            rpc_timeout=timeout,
            strategy=config["strategy"],
            transport="p2p",
            reconnect_timeout=reconnect_timeout,
            idle_timeout=idle_timeout,
            late_task=task_index,
        )

    def __repr__(self) -> str:
        return (
            f"Cluster({self.name}, num_ps={self.num_ps}, num_worker={self.num_worker}, "
            f"transport={self.transport_name!r})"
        )

    @property
    def store(self) -> dist.Store:
        """This run's namespace of the job's store (both transports), shared by every process
        of the cluster. The keys listed in the module docstring are the cluster's; an algorithm
        or a caller keeps its own under its own prefix (e.g. AsyncDiLoCo's ``asyncdiloco/...``).
        Every blocking read on it is bounded by ``rpc_timeout``."""
        return self._store

    # ---- worker -> shard requests ---------------------------------------------------------------
    def send(
        self,
        shard: int,
        request: Request,
        *,
        into: dict[str, torch.Tensor] | None = None,
        timeout: float | None = None,
    ) -> Pending:
        """Start ``request`` to ``shard`` (bounded by ``timeout``, default ``rpc_timeout``)."""
        return self.transport.send(
            shard, request, self.rpc_timeout if timeout is None else timeout, into
        )

    def stream(
        self,
        shard: int,
        request: Request,
        chunks: Sequence[Chunk],
        into: dict[str, torch.Tensor] | None = None,
        *,
        timeout: float | None = None,
    ) -> Stream | None:
        """Start ``request`` (a commit written chunk by chunk in the plan ``chunks``) as a
        stream to ``shard`` (bounded by ``timeout``, default ``rpc_timeout``), or None when the
        transport cannot stream it (:meth:`Transport.stream`)."""
        return self.transport.stream(
            shard, request, chunks, self.rpc_timeout if timeout is None else timeout, into
        )

    @staticmethod
    def receive(pending: Pending) -> Reply:
        """The reply of a request started by :meth:`send`; a shard-side error re-raises by type,
        a shard that does not answer raises :class:`ParameterServerError`."""
        reply = pending.wait()
        if isinstance(reply, ErrorReply):
            raise reply.to_exception()
        return reply

    def request(self, shard: int, request: Request, **kwargs: Any) -> Reply:
        """:meth:`send` then :meth:`receive`."""
        return self.receive(self.send(shard, request, **kwargs))

    def incarnation(self, shard: int) -> int:
        """The incarnation of ``shard`` this worker talks to (it grows when a shard restarts)."""
        return self.transport.incarnation(shard)

    def reconnect(self, shard: int, cause: BaseException | None = None) -> int:
        """After a lost connection: wait up to ``reconnect_timeout`` for ``shard`` to be back
        (restarted) and connect; returns its incarnation. Without a reconnect timeout, or on a
        transport without restarts, re-raise ``cause`` (a clear error)."""
        if self.reconnect_timeout <= 0 or not self.transport.supports_restart:
            detail = f": {cause}" if cause is not None else ""
            raise ParameterServerError(
                f"parameter server {shard} is gone{detail}. The shard died, hung or already "
                "shut down; a shard started with checkpoint_dir resumes from its last "
                "checkpoint when restarted (agn.spawn(max_restarts=N), or torchrun's restarts), "
                "and workers wait for it with reconnect_timeout > 0"
            ) from cause
        started = time.monotonic()
        try:
            return self.transport.reconnect(shard, self.reconnect_timeout)
        except ParameterServerError as exc:
            raise ParameterServerError(
                f"parameter server {shard} did not come back within reconnect_timeout="
                f"{self.reconnect_timeout:g}s ({time.monotonic() - started:.1f}s): {exc}"
            ) from exc

    # ---- serving --------------------------------------------------------------------------------
    def _task_count(self) -> int:
        if self.transport_name != "p2p":
            return self.num_worker
        return self.num_worker + int(self._store.add("late", 0))

    def _gone(self, pending: list[int]) -> Mapping[int, str]:
        """Which pending workers are known to have ended, and how.

        A worker that started connecting (``worker/<t>/starting``; a late one: reserved its
        task index) but did not come up within twice ``rpc_timeout`` of this shard first seeing
        it so (its own start-up bound) died joining: nobody else would tell (a late job has no
        launcher watching it for the cluster, and under torchrun a whole node can die: its
        agent dies with it). Without this, a node that died while its workers were connecting
        left the shards waiting for them forever.
        """
        news = {t: "dead" for t in self.transport.gone(pending)}
        now = time.monotonic()
        for t in pending:
            key = f"worker/{t}/end"
            if self._store.check([key]):
                news[t] = self._store.get(key).decode()
            elif not self._store.check([f"worker/{t}/up"]) and (
                t >= self.num_worker or self._store.check([f"worker/{t}/starting"])
            ):
                first = self._late_seen.setdefault(t, now)
                if now - first > 2 * self.rpc_timeout:
                    news[t] = "dead"
        return news

    def serve(self, timeout: float | None = None) -> ShardReport:
        """Serve until every worker finished, failed or died; returns this shard's report.

        ``timeout`` (seconds, default unbounded) bounds the wait for workers.
        """
        if not self.is_ps or self._server is None:
            raise RuntimeError(f"serve() runs on parameter servers; this process is {self.name}")
        srv = self._server
        srv.wait_for_workers(self._gone, self.probe_period_s, timeout, task_count=self._task_count)
        if self.transport_name == "rpc":
            # replies to `finish` are on their way; let them land before rpc shuts down
            for t in range(self.num_worker):
                if srv.is_done(t):
                    with contextlib.suppress(dist.DistStoreError):
                        self._store.wait([f"worker/{t}/end"], timedelta(seconds=self.rpc_timeout))
        srv.checkpoint()
        rep = srv.report()
        return ShardReport(
            shard=rep["shard"],
            tables=rep["tables"],
            dead_workers=rep["dead_workers"],
            finished_workers=rep["finished_workers"],
            wall_time_s=rep["wall_time_s"],
            failed_workers=rep["failed_workers"],
            incarnation=rep["incarnation"],
        )

    # ---- shut-down ------------------------------------------------------------------------------
    def shutdown(self, failed: bool = False) -> None:
        """Leave the cluster (idempotent). A worker first tells every shard it is done
        (``failed=True``: it stopped because it raised; it is listed among ``failed_workers``)."""
        global _CURRENT
        if self._closed:
            return
        self._closed = True
        try:
            if self.is_worker:
                pending = []
                for s in range(self.num_ps):
                    with contextlib.suppress(ParameterServerError, RuntimeError):
                        pending.append(self.send(s, Finish(self.task_index, failed)))
                for p in pending:  # a dead shard needs no news
                    with contextlib.suppress(ParameterServerError, RuntimeError):
                        self.receive(p)
                with contextlib.suppress(dist.DistStoreError, RuntimeError):
                    end = "failed" if failed else "finished"
                    self._store.set(f"worker/{self.task_index}/end", end)
        finally:
            self.transport.close()
            _CURRENT = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.shutdown(failed=exc_type is not None)


# ---------------------------------------------------------------------------------------------
# local clusters
# ---------------------------------------------------------------------------------------------
def _spawn_main(
    num_ps: int, options: dict[str, Any], worker_fn: Callable[..., Any], args: tuple[Any, ...]
) -> Any:
    """A local cluster process: serve (shard) or run ``worker_fn(ctx, *args)`` (worker)."""
    cluster = Cluster.from_env(num_ps=num_ps, **options)
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
    ) -> None:
        if not callable(worker_fn):
            raise TypeError(f"worker_fn must be callable, got {type(worker_fn).__name__}")
        for label, v in (("num_worker", num_worker), ("num_ps", num_ps)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{label} must be an int >= 1, got {v!r}")
        if not isinstance(args, tuple):
            raise TypeError(f"args must be a tuple, got {type(args).__name__}")
        timeout = _check_seconds("timeout", timeout)
        rpc_timeout = _check_seconds(
            "rpc_timeout",
            min(DEFAULT_RPC_TIMEOUT, timeout) if rpc_timeout is None else rpc_timeout,
        )
        _check_checkpointing(checkpoint_dir, checkpoint_every)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        kind = _check_transport(transport)
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if max_restarts and kind != "p2p":
            raise ValueError("restarting a shard needs transport='p2p' (rpc's world is fixed)")
        if max_restarts and checkpoint_dir is None:
            raise ValueError(
                "max_restarts needs checkpoint_dir: a restarted shard resumes its center from "
                "its last checkpoint"
            )
        if reconnect_timeout is None:
            reconnect_timeout = rpc_timeout if max_restarts else 0.0
        reconnect_timeout = _check_seconds("reconnect_timeout", reconnect_timeout, True)
        if on_startup_failure not in STARTUP_POLICIES:
            raise ValueError(
                f"on_startup_failure must be one of {STARTUP_POLICIES}, got {on_startup_failure!r}"
            )
        if on_startup_failure == "drop" and kind != "p2p":
            raise ValueError("on_startup_failure='drop' needs transport='p2p' (rpc starts as one)")
        self.worker_fn = worker_fn
        self.num_worker = num_worker
        self.num_ps = num_ps
        self.args = args
        self.timeout = timeout
        self.transport = kind
        self.max_restarts = max_restarts
        self.on_startup_failure = on_startup_failure
        self.grace = grace
        self.num_threads = (
            num_threads
            if num_threads is not None
            else max(1, (os.cpu_count() or 1) // (num_ps + num_worker))
        )
        self._options = {
            "rpc_timeout": rpc_timeout,
            "checkpoint_dir": None if checkpoint_dir is None else os.fspath(checkpoint_dir),
            "checkpoint_every": checkpoint_every,
            "strategy": strategy,
            "transport": kind,
            "reconnect_timeout": reconnect_timeout,
            "idle_timeout": timeout if idle_timeout is None else idle_timeout,
        }
        self._store: dist.TCPStore | None = None
        self._sup: ProcessSupervisor | None = None
        self._thread: threading.Thread | None = None
        self._tasks: dict[int, int] = {}  # supervisor index -> worker task
        self._outcomes: list[ProcessOutcome] | None = None
        self._error: BaseException | None = None
        self._started = 0.0
        self._lock = threading.Lock()

    # ---- running --------------------------------------------------------------------------------
    @property
    def store_address(self) -> tuple[str, int]:
        """``(host, port)`` of the cluster's store (for :meth:`Cluster.join` from elsewhere)."""
        if self._store is None:
            raise RuntimeError("the cluster is not started")
        return "127.0.0.1", self._store.port

    def _env(self, rank: int) -> dict[str, str]:
        assert self._store is not None
        env = torchrun_env(rank, self.num_ps + self.num_worker, self._store.port)
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
        )
        self._started = time.monotonic()
        main = (self.num_ps, self._options, self.worker_fn, self.args)
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
            task = self.num_worker + int(self._store.add(f"{_namespace()}/late", 1)) - 1
            env = {
                **self._env(0),
                JOIN_ENV: f"127.0.0.1:{self._store.port}",
                TASK_ENV: str(task),
            }
            for k in ("RANK", "LOCAL_RANK"):
                env.pop(k, None)
            main = (self.num_ps, self._options, self.worker_fn, self.args if args is None else args)
            index = self._sup.add(_spawn_main, main, name=f"worker {task}", env=env, critical=False)
            self._tasks[index] = task
        return task

    def _on_worker_failure(self, outcome: ProcessOutcome) -> None:
        """A worker process failed: mark it in the store; a death at start-up fails the run."""
        assert self._store is not None
        task = self._tasks[outcome.index]
        ns = _namespace()
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
) -> ClusterResult:
    """Run a local AGN cluster: ``num_ps`` shard processes and ``num_worker`` worker processes.

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
    cluster = LocalCluster(
        worker_fn,
        num_worker,
        num_ps,
        args,
        timeout,
        checkpoint_dir,
        checkpoint_every,
        rpc_timeout=rpc_timeout,
        strategy=strategy,
        num_threads=num_threads,
        transport=transport,
        max_restarts=max_restarts,
        reconnect_timeout=reconnect_timeout,
        on_startup_failure=on_startup_failure,
        idle_timeout=idle_timeout,
        grace=grace,
    )
    with cluster:
        return cluster.start().wait()
