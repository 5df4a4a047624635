"""DiLoCo's public read-only facts: the outer optimizer, the replicas, the schedule, the global
copy and the counters (the :class:`DiLoCoFacts` mixin :class:`~distoptim.outer.diloco.DiLoCo`
inherits; the semantics are the optimizer's, ``docs/diloco.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from distoptim.comm.stats import CommStats
from distoptim.outer.fragments import FragmentSchedule
from distoptim.outer.groups import like_param

__all__ = ["DiLoCoFacts", "GlobalParameters"]


class GlobalParameters(list):  # type: ignore[type-arg]
    """The global copy ``θ_g``: one tensor per parameter, in the inner optimizer's order.

    A list of the live tensors (do not modify them). Calling it returns itself, so
    ``opt.global_parameters()`` -- :class:`~distoptim.AsyncDiLoCoOptimizer`'s spelling -- reads
    the same list as ``opt.global_parameters``.
    """

    def __call__(self) -> GlobalParameters:
        return self


class DiLoCoFacts:
    """The read-only properties of :class:`~distoptim.outer.diloco.DiLoCo` (a mixin: it reads
    the optimizer's attributes, declared here for type checkers)."""

    _outer: torch.optim.Optimizer
    _managed: Any
    _channel: Any
    _syncs: int
    _refused_syncs: int
    _group_size: int
    _stats: CommStats
    _schedule: FragmentSchedule
    _global: list[torch.Tensor]
    _params: list[torch.Tensor]

    @property
    def outer(self) -> torch.optim.Optimizer:
        """The outer optimizer (it steps the global copy, once per fragment sync)."""
        return self._outer

    @property
    def num_replicas(self) -> int:
        """Replicas whose pseudo-gradients are averaged: the (sub)group size, 1 outside one
        (with a torchft manager: the contributors of the last sync, 0 before the first)."""
        if self._managed is not None:
            return self._channel.contributors if self._syncs or self._refused_syncs else 0
        return self._group_size

    @property
    def replica_stats(self) -> Any:
        """With a torchft manager: rounds, commits, failed rounds, heals (else None)."""
        return None if self._managed is None else self._managed.replicas.stats

    @property
    def comm_stats(self) -> CommStats:
        """Collectives launched and bytes this rank sent so far (see :class:`CommStats`)."""
        return self._stats

    @property
    def schedule(self) -> FragmentSchedule:
        """The fragments and the steps at which each syncs."""
        return self._schedule

    @property
    def global_parameters(self) -> GlobalParameters:
        """The global copy ``θ_g``: the model every replica agrees on, bit for bit.

        One live tensor per parameter, in the inner optimizer's order (do not modify them);
        each fragment's values are those of its last sync. After :meth:`finish` the model's own
        parameters equal it on every replica. No communication. ``opt.global_parameters()``
        works too (see :class:`GlobalParameters`). A ``DTensor`` parameter's entry is a
        ``DTensor`` of the same mesh and placements around this process's local global copy
        (what it holds of ``θ_g``; ``full_tensor()`` gathers it).
        """
        return GlobalParameters([like_param(g, p) for g, p in zip(self._global, self._params)])

    @property
    def syncs(self) -> int:
        """Fragment syncs applied so far (outer steps taken)."""
        return self._syncs

    @property
    def refused_syncs(self) -> int:
        """Fragment syncs refused because some replica's pseudo-gradient was not finite."""
        return self._refused_syncs
