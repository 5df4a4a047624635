"""Asynchronous data parallelism on a parameter server (AGN, DOWNPOUR, EASGD).

Owns nothing itself; the public names of the package:

* :func:`spawn`, :class:`LocalCluster` (late workers, shard restarts), :class:`Cluster`
  (``Cluster.from_env`` under torchrun, ``Cluster.join`` for a late worker),
  :class:`ClusterOptions` (what every process of a cluster runs with), :class:`ClusterResult`,
  :class:`ClusterStats`, :class:`ShardReport`, :class:`ParameterServerError` (and
  :class:`ShardLostError`, :class:`WorkerDroppedError`, :class:`StoreUnreachableError`: the store,
  :mod:`distoptim.agn.store`) -- the cluster
  (:mod:`distoptim.agn.cluster`; local clusters: :mod:`distoptim.agn.local_cluster`), on the
  transports of :mod:`distoptim.agn.transport` (``"p2p"``, the default, or ``"rpc"``);
* :class:`AGNOptimizer` (:mod:`~distoptim.agn.agn`), :class:`DownpourOptimizer`
  (:mod:`~distoptim.agn.downpour`), :class:`ElasticAverageOptimizer`
  (:mod:`~distoptim.agn.easgd`), :class:`AsyncDiLoCoOptimizer`
  (:mod:`~distoptim.agn.async_diloco`) -- the algorithms, all on :mod:`distoptim.agn.worker`;
* :class:`ShardLink` (:mod:`~distoptim.agn.shard_link`) and the server rules
  (:mod:`~distoptim.agn.rules`) -- the extension point for new algorithms;
* :class:`AGNCustomGetter` (:mod:`~distoptim.agn.getter`) -- placement of center variables;
* :class:`ParameterServer` (:mod:`~distoptim.agn.server`) -- a shard.

The algorithms' math, the transports and the fault semantics are in ``docs/agn.md``.
"""

from distoptim.agn.agn import AGNOptimizer
from distoptim.agn.async_diloco import AsyncDiLoCoOptimizer
from distoptim.agn.cluster import (
    TRANSPORTS,
    Cluster,
    ClusterOptions,
    ClusterStats,
    ShardReport,
    current_cluster,
)
from distoptim.agn.downpour import DownpourOptimizer
from distoptim.agn.easgd import ElasticAverageOptimizer
from distoptim.agn.getter import AGNCustomGetter
from distoptim.agn.local_cluster import ClusterResult, LocalCluster, WorkerStartupError, spawn
from distoptim.agn.rules import (
    AddUpdate,
    ApplyOptimizer,
    DelayedNesterov,
    ElasticUpdate,
    ServerRule,
)
from distoptim.agn.server import ParameterServer
from distoptim.agn.shard_link import ShardLink
from distoptim.agn.store import StoreUnreachableError
from distoptim.agn.transport import ParameterServerError, ShardLostError, WorkerDroppedError

__all__ = [
    "TRANSPORTS",
    "AGNCustomGetter",
    "AGNOptimizer",
    "AddUpdate",
    "ApplyOptimizer",
    "AsyncDiLoCoOptimizer",
    "Cluster",
    "ClusterOptions",
    "ClusterResult",
    "ClusterStats",
    "DelayedNesterov",
    "DownpourOptimizer",
    "ElasticAverageOptimizer",
    "ElasticUpdate",
    "LocalCluster",
    "ParameterServer",
    "ParameterServerError",
    "ServerRule",
    "ShardLink",
    "ShardLostError",
    "ShardReport",
    "StoreUnreachableError",
    "WorkerDroppedError",
    "WorkerStartupError",
    "current_cluster",
    "spawn",
]
