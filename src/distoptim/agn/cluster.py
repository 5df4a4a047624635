"""The AGN cluster: roles, membership, the transport (of one process, under any launcher).

Owns: who is a parameter-server shard and who is a worker, the cluster's keys in the job's
``TCPStore``, the requests a worker makes to the shards (each bounded; a clear error, or a
bounded reconnection, when a shard is gone), the serving loop of a shard (it ends when every
worker the cluster knows of finished, failed or died; dead workers are detected, never waited
for). Local clusters (:func:`~distoptim.agn.local_cluster.spawn`,
:class:`~distoptim.agn.local_cluster.LocalCluster`) run these roles as local processes.

Roles (the same under :func:`~distoptim.agn.local_cluster.spawn` and under ``torchrun``)
----------------------------------------------------------------------------------------
``WORLD_SIZE = num_ps + num_worker`` processes. Ranks ``0 .. num_ps-1`` are the parameter-server
shards, ranks ``num_ps ..`` the workers (``task_index = rank - num_ps``; task 0 is the chief).
``num_worker`` is the *expected* count: with the ``"p2p"`` transport a worker may also join a
running cluster later (:meth:`Cluster.join`; ``DISTOPTIM_AGN_JOIN=host:port`` makes
:meth:`Cluster.from_env` do it, e.g. for a torchrun job started later on another node;
:meth:`~distoptim.agn.local_cluster.LocalCluster.add_worker` locally); it gets the next task
index after the expected ones.

Keys in the store (under the job's namespace ``distoptim.agn/<job>/<TORCHELASTIC_RESTART_COUNT>``,
:mod:`distoptim.agn.store`: one per job, and a torchrun restart of the whole job starts afresh)
-----------------------------------------------------------------------------------------------
* ``member/<rank>/<restart>``: which process holds each rank (a second job that shares the
  store and the job id stops at once, :func:`~distoptim.agn.store.claim`);
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
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distoptim.agn.flat import Chunk
from distoptim.agn.getter import STRATEGIES, AGNCustomGetter
from distoptim.agn.server import ParameterServer
from distoptim.agn.store import (
    CURRENT_KEY,
    JOB_ENV,
    StoreUnreachableError,
    claim,
    connect,
    current_key,
    job_id,
    parse_address,
    store_namespace,
)
from distoptim.agn.transport import TRANSPORTS
from distoptim.agn.transport.base import (
    ParameterServerError,
    Pending,
    Stream,
    Transport,
    WorkerDroppedError,
)
from distoptim.agn.transport.messages import ErrorReply, Finish, Reply, Request
from distoptim.agn.transport.p2p import DEFAULT_IDLE_TIMEOUT, P2PTransport
from distoptim.agn.transport.shared_center import SharedCenters, shm_enabled
from distoptim.checks import (
    check_choice,
    check_int,
    check_optional_int,
    check_path,
    check_seconds,
    type_name,
)
from distoptim.launch import require_torchrun_env
from distoptim.netcheck import check_torchrun_network

__all__ = [
    "JOB_ENV",
    "JOIN_ENV",
    "TRANSPORTS",
    "Cluster",
    "ClusterOptions",
    "ClusterStats",
    "ParameterServerError",
    "ShardReport",
    "StoreUnreachableError",
    "current_cluster",
    "merge_reports",
    "store_namespace",
]

DEFAULT_RPC_TIMEOUT = 60.0
"""Seconds any single request may take (also how long a worker waits for the shards and the
chief's seed at start-up)."""

JOIN_ENV = "DISTOPTIM_AGN_JOIN"
"""``host:port`` of a running cluster's store; :meth:`Cluster.from_env` then joins it, late."""

TASK_ENV = "DISTOPTIM_AGN_TASK"
"""The task index a launcher reserved for a late worker (with :data:`JOIN_ENV`)."""


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
      by :func:`~distoptim.agn.local_cluster.spawn`).
    * ``shard_restarts``: how many times shards were restarted
      (:class:`~distoptim.agn.local_cluster.LocalCluster`).
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
def _env_int(name: str, low: int) -> int:
    """The environment variable ``name`` as an int >= ``low``, or an error naming it."""
    raw = os.environ[name]
    try:
        return check_int(name, int(raw), low)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer >= {low}") from None


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


@dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    """How every process of one AGN cluster behaves: the options :class:`Cluster` takes (as
    keywords, or this record), the same on every process of a cluster (a local cluster hands its
    record to each of its processes, :mod:`distoptim.agn.local_cluster`).

    Validated once, here, through :mod:`distoptim.checks` (a record holds no impossible value):

    * ``rpc_timeout``: seconds any single request may take (also how long a worker waits for the
      shards and the chief's seed at start-up);
    * ``checkpoint_dir``: where each shard writes ``ps<shard>.pt`` (None: no checkpoints);
      ``checkpoint_every``: also every that many accepted commits of a table (None: only when
      the shard stops; needs ``checkpoint_dir``);
    * ``strategy``: the default placement (:data:`~distoptim.agn.getter.STRATEGIES`);
    * ``probe_period_s``: how often a shard without news asks which pending workers ended;
    * ``transport``: ``"p2p"`` or ``"rpc"`` (:data:`~distoptim.agn.transport.TRANSPORTS`);
    * ``reconnect_timeout``: seconds a worker waits for a restarted shard (0: it does not);
    * ``idle_timeout``: seconds a p2p shard waits for a connected worker's next request (None:
      :data:`~distoptim.agn.transport.p2p.DEFAULT_IDLE_TIMEOUT`).
    """

    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int | None = None
    strategy: str = "round_robin"
    probe_period_s: float = 1.0
    transport: str = "p2p"
    reconnect_timeout: float = 0.0
    idle_timeout: float | None = None

    def __post_init__(self) -> None:
        idle = DEFAULT_IDLE_TIMEOUT if self.idle_timeout is None else self.idle_timeout
        valid = {
            "rpc_timeout": check_seconds("rpc_timeout", self.rpc_timeout),
            "strategy": check_choice("strategy", self.strategy, STRATEGIES, fold_case=False),
            "probe_period_s": check_seconds("probe_period_s", self.probe_period_s),
            "reconnect_timeout": check_seconds(
                "reconnect_timeout", self.reconnect_timeout, allow_zero=True
            ),
            "idle_timeout": check_seconds("idle_timeout", idle),
            "checkpoint_dir": check_path("checkpoint_dir", self.checkpoint_dir, optional=True),
            "checkpoint_every": check_optional_int("checkpoint_every", self.checkpoint_every, 1),
            "transport": check_choice("transport", self.transport, TRANSPORTS, fold_case=False),
        }
        if valid["checkpoint_every"] is not None and valid["checkpoint_dir"] is None:
            raise ValueError("checkpoint_every needs checkpoint_dir (where to write checkpoints)")
        for name, value in valid.items():
            object.__setattr__(self, name, value)


def _options(options: ClusterOptions | None, fields: dict[str, Any]) -> ClusterOptions:
    """``options``, or a record of ``fields`` (the keywords of :class:`ClusterOptions`)."""
    if options is None:
        return ClusterOptions(**fields)
    if not isinstance(options, ClusterOptions):
        raise TypeError(f"options must be a ClusterOptions, got {type_name(options)}")
    if fields:
        raise TypeError(f"pass options or its fields {sorted(fields)}, not both")
    return options


class Cluster:
    """This process's place in an AGN cluster (one PS shard or one worker).

    Build it with :meth:`from_env` (torchrun, or the children of
    :func:`~distoptim.agn.local_cluster.spawn`) or
    :meth:`join` (a late worker). Attributes: ``is_ps``, ``is_worker``, ``task_index`` (worker
    index, or shard index on a PS), ``is_chief`` (worker 0), ``is_late``, ``num_ps``,
    ``num_worker`` (the expected count), ``custom_getter`` (the default placement),
    ``rpc_timeout`` (bound of every request), ``reconnect_timeout`` (how long a worker waits for
    a restarted shard; 0: it does not), ``transport`` (the :class:`Transport`), ``namespace``
    (where the cluster's keys live in the job's store: ``namespace``, default this job's,
    :func:`~distoptim.agn.store.store_namespace`). A worker function receives the cluster itself
    as ``ctx``. Reaching the store at ``master_addr:master_port`` is bounded by ``rpc_timeout``
    (:func:`~distoptim.agn.store.connect`).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        num_ps: int,
        master_addr: str,
        master_port: int,
        late_task: int | None = None,
        options: ClusterOptions | None = None,
        namespace: str | None = None,
        **fields: Any,
    ) -> None:
        global _CURRENT
        opts = _options(options, fields)
        num_ps = check_int("num_ps", num_ps, 1)
        if world_size - num_ps < 1:
            raise ValueError(
                f"an AGN cluster needs at least one worker: WORLD_SIZE={world_size} processes "
                f"with num_ps={num_ps} leaves {world_size - num_ps} (start num_ps + num_worker "
                "processes)"
            )
        if late_task is None and not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if late_task is not None and opts.transport != "p2p":
            raise ValueError("late workers need transport='p2p' (rpc's world is fixed at start)")
        if _CURRENT is not None:
            raise RuntimeError(
                "this process already belongs to an AGN cluster (shut it down first)"
            )
        self.options = opts
        self.rpc_timeout = opts.rpc_timeout
        self.probe_period_s = opts.probe_period_s
        self.reconnect_timeout = opts.reconnect_timeout
        self.idle_timeout = opts.idle_timeout
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
        self.strategy = opts.strategy
        self.custom_getter = AGNCustomGetter(num_ps=num_ps, strategy=opts.strategy)
        self.name = f"ps {self.task_index}" if self.is_ps else f"worker {self.task_index}"
        self.transport_name = opts.transport
        self._closed = False
        self._server: ParameterServer | None = None
        self._late_seen: dict[int, float] = {}  # task -> when this shard first saw it starting
        self.namespace = store_namespace() if namespace is None else namespace
        where = f"{master_addr}:{master_port}"
        self._root = connect(
            master_addr, master_port, self.rpc_timeout, f"the cluster's store at {where}"
        )
        self._store = dist.PrefixStore(self.namespace, self._root)
        if late_task is None:  # before anything is written: a second job sharing it stops here
            claim(self._store, rank, self.namespace, where)
        if self.is_worker:  # the shards time its start-up from here (Cluster._gone)
            self._store.set(f"worker/{self.task_index}/starting", "1")
        self.transport: Transport
        if self.is_ps:
            self._server = ParameterServer(
                self.task_index,
                num_ps,
                self.num_worker,
                opts.checkpoint_dir,
                opts.checkpoint_every,
                store=self._store,
                centers=SharedCenters() if opts.transport == "p2p" and shm_enabled() else None,
            )
            if self.task_index == 0:
                self._root.set(CURRENT_KEY, self.namespace)
                job = self.namespace.split("/")[1]
                self._root.set(current_key(job), self.namespace)
                config = {"num_ps": num_ps, "num_worker": self.num_worker}
                config |= {"transport": opts.transport, "strategy": opts.strategy}
                self._store.set("config", pickle.dumps(config))
        if opts.transport == "p2p":
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
        cls, num_ps: int = 1, *, options: ClusterOptions | None = None, **fields: Any
    ) -> Cluster:
        """Join the cluster described by torchrun's environment (``RANK``, ``WORLD_SIZE``,
        ``MASTER_ADDR``, ``MASTER_PORT``): the first ``num_ps`` ranks serve, the rest work.
        ``fields``: the options of :class:`ClusterOptions` as keywords (``rpc_timeout``,
        ``checkpoint_dir``, ``transport``, ...), or ``options``, a record of them.

        With ``DISTOPTIM_AGN_JOIN=host:port`` set, this process instead joins the running
        cluster whose store is there, as a late worker (:meth:`join`; ``DISTOPTIM_AGN_JOB``,
        when set, names the job to join). Every wait for the store is bounded by
        ``rpc_timeout``; an address that cannot be resolved or where nothing listens is
        reported at once (:class:`~distoptim.agn.store.StoreUnreachableError`).
        """
        opts = _options(options, fields)
        join = os.environ.get(JOIN_ENV)
        if join:
            host, port = parse_address(JOIN_ENV, join)
            task = os.environ.get(TASK_ENV)
            return cls.join(
                host,
                port,
                task_index=None if task is None else _env_int(TASK_ENV, 0),
                rpc_timeout=opts.rpc_timeout,
                reconnect_timeout=opts.reconnect_timeout,
                idle_timeout=opts.idle_timeout,
                job=os.environ.get(JOB_ENV) or None,
                what=f"{JOIN_ENV}={join}",
            )
        require_torchrun_env("Cluster.from_env", "distoptim.agn.spawn")
        rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        _, master_port = parse_address("MASTER_PORT", f"x:{os.environ['MASTER_PORT']}")
        job_id()  # a bad DISTOPTIM_AGN_JOB is named before anything starts
        backends = ("gloo",) if opts.transport == "p2p" else ("gloo", "tensorpipe")
        check_torchrun_network("Cluster.from_env", backends, opts.rpc_timeout)
        return cls(
            rank=rank,
            world_size=world_size,
            num_ps=num_ps,
            master_addr=os.environ["MASTER_ADDR"],
            master_port=master_port,
            options=opts,
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
        job: str | None = None,
        what: str | None = None,
    ) -> Cluster:
        """Join a running cluster (``"p2p"``) as a late worker, through its store at
        ``host:port``. Its task index is the next one after the expected workers (or
        ``task_index``, when a launcher reserved it); it pulls the current center like any
        worker and commits from then on. The other options come from the running cluster.

        ``job``: the id of the job to join when several share the store (default: the one that
        started last). Every wait is bounded by ``rpc_timeout``; an address that cannot be
        resolved or where nothing listens raises
        :class:`~distoptim.agn.store.StoreUnreachableError` at once. ``what`` names the address
        in errors (default ``host:port``)."""
        opts = ClusterOptions(
            rpc_timeout=rpc_timeout, reconnect_timeout=reconnect_timeout, idle_timeout=idle_timeout
        )
        timeout = opts.rpc_timeout
        where = f"{host}:{port}"
        root = connect(host, port, timeout, f"joining the cluster at {what or where}")
        key = CURRENT_KEY if job is None else current_key(job_id(job))
        try:
            namespace = root.get(key).decode()
            config = pickle.loads(root.get(f"{namespace}/config"))
        except dist.DistStoreError as exc:
            name = "" if job is None else f" of job {job!r}"
            raise RuntimeError(
                f"no AGN cluster{name} found in the store at {where} within {timeout:g}s (its "
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
            late_task=task_index,
            options=replace(opts, strategy=config["strategy"], transport="p2p"),
            namespace=namespace,
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
        if isinstance(cause, WorkerDroppedError) and self.reconnect_timeout <= 0:
            raise cause  # the shard is alive: its message says why it dropped this worker
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
