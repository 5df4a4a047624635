"""Asynchronous data parallelism on a parameter server (``torch.distributed.rpc``).

Owns nothing itself; the public names of the package:

* :func:`spawn`, :class:`Cluster` (``Cluster.from_env`` under torchrun), :class:`ClusterResult`,
  :class:`ClusterStats`, :class:`ShardReport`, :class:`ParameterServerError` — the cluster
  (:mod:`distoptim.agn.cluster`);
* :class:`AGNOptimizer` (:mod:`~distoptim.agn.agn`), :class:`DownpourOptimizer`
  (:mod:`~distoptim.agn.downpour`), :class:`ElasticAverageOptimizer`
  (:mod:`~distoptim.agn.easgd`) — the algorithms, all on :mod:`distoptim.agn.worker`;
* :class:`AGNCustomGetter` (:mod:`~distoptim.agn.getter`) — placement of center variables;
* :class:`ParameterServer` (:mod:`~distoptim.agn.server`) — a shard.
"""

from distoptim.agn.agn import AGNOptimizer
from distoptim.agn.cluster import (
    Cluster,
    ClusterResult,
    ClusterStats,
    ParameterServerError,
    ShardReport,
    current_cluster,
    spawn,
)
from distoptim.agn.downpour import DownpourOptimizer
from distoptim.agn.easgd import ElasticAverageOptimizer
from distoptim.agn.getter import AGNCustomGetter
from distoptim.agn.server import ParameterServer

__all__ = [
    "AGNCustomGetter",
    "AGNOptimizer",
    "Cluster",
    "ClusterResult",
    "ClusterStats",
    "DownpourOptimizer",
    "ElasticAverageOptimizer",
    "ParameterServer",
    "ParameterServerError",
    "ShardReport",
    "current_cluster",
    "spawn",
]
