"""Fault tolerance on torchft: replicas that die and join mid-run, healed live from a peer.

``CrossShardOptimizer(..., manager=m)`` and ``DiLoCo(..., manager=m)`` (so ``LocalSGD`` and
Streaming DiLoCo) take a ``torchft.Manager``; every step (CrossShard) or fragment sync (the
DiLoCo family) is then one quorum of replica groups, committed only when ``should_commit()``
says so, and a replica group that joins takes a peer's state before it contributes. The model,
the timeouts and how to run it are in ``docs/fault_tolerance.md``. This package holds the pieces
around that:

* :class:`Lighthouse` / ``distoptim lighthouse`` -- torchft's lighthouse, started for you;
* :func:`make_manager` -- a ``torchft.Manager`` with distoptim's defaults and clear errors;
* :class:`SlotShards` -- which samples a replica trains on: the batch follows the committed step;
* :func:`init_replica_group` -- a torchrun worker's process group that survives torchrun's own
  restarts (``--max-restarts``);
* :func:`run_replicas`, :class:`Chaos` -- replica groups on one machine, with faults on a
  schedule (``distoptim compare --fault-tolerant --chaos kill:30``);
* :mod:`~distoptim.ft.replicas`, :mod:`~distoptim.ft.agreement`, :mod:`~distoptim.ft.channel`
  -- what the optimizers use underneath (one round at a time; the replicas' bitwise agreement).

Needs the ``ft`` extra (``pip install "distoptim[ft]"``); importing a name here without torchft
raises an ImportError that names it.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Chaos",
    "Lighthouse",
    "SlotShards",
    "init_replica_group",
    "make_manager",
    "run_replicas",
]

_NAMES = {
    "Chaos": "distoptim.ft.local",
    "Lighthouse": "distoptim.ft.lighthouse",
    "SlotShards": "distoptim.ft.data",
    "init_replica_group": "distoptim.ft.torchrun",
    "make_manager": "distoptim.ft.replica",
    "run_replicas": "distoptim.ft.local",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'distoptim.ft' has no attribute {name!r}")
    if name not in ("SlotShards", "init_replica_group"):  # need no torchft
        from distoptim.ft._torchft import require

        require()  # the ImportError that names the extra, before anything else
    return getattr(importlib.import_module(module), name)
