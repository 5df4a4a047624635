"""DiLoCo's state dict: what a checkpoint holds, and how a loaded one is put back.

Owns the wrapper state of :class:`~distoptim.outer.diloco.DiLoCo` (as the
:class:`DiLoCoState` mixin the optimizer inherits): writing it (global copy, outer state,
residuals, the sync in flight settled into its payload slots, counters), checking a loaded one
(:func:`~distoptim.outer.checkpoint.check_wrapper_state`), and restoring it, a sync in flight
included (:class:`PendingSync`). The semantics are the optimizer's (``docs/diloco.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distoptim.outer.checkpoint import check_wrapper_state, warn_between_syncs
from distoptim.outer.exchange import FragmentExchange, InFlight
from distoptim.outer.fragments import Fragment, FragmentSchedule

__all__ = ["DiLoCoState", "PendingSync"]


@dataclass
class PendingSync:
    """A fragment's sync between launch (inner step ``launched_at``) and application."""

    fragment: Fragment
    launched_at: int
    flight: InFlight | None  # None: a managed sync that will not commit (nothing launched)


class DiLoCoState:
    """The checkpoint methods of :class:`~distoptim.outer.diloco.DiLoCo` (a mixin: it reads
    the optimizer's attributes, declared here for type checkers, and calls its ``_config()``
    and ``_peer_guard()``)."""

    _name: str
    iterations: int
    _group_size: int
    _synced_at: list[int]
    _closed_at: int
    _in_flight: PendingSync | None
    _exchanges: list[FragmentExchange]
    _schedule: FragmentSchedule
    _global: list[torch.Tensor]
    _outer: torch.optim.Optimizer
    _syncs: int
    _warned_between_syncs: bool
    _step_being_loaded: int | None
    _managed: Any
    _channel: Any

    def _wrapper_state_dict(self) -> dict[str, Any]:
        """Global copy, outer state, residuals, the sync in flight (settled) and counters.

        The structure depends only on the configuration, never on the step: ``pending`` always
        holds every fragment's payload slots (empty lists when ``τ = 0``), and ``fragment`` /
        ``launched_at`` are -1 when no sync is in flight. So a state_dict of a freshly built
        optimizer is a valid template for ``torch.distributed.checkpoint.load``. ``rank`` is
        this replica's index in its group (a checkpoint loads only on the same replica),
        ``synced_at`` per fragment the step after which its local values were its global copy,
        ``closed_at`` the last step at which ``finish()`` or a refusal closed the sync the
        schedule had in flight. Taken between syncs (with more than one replica) it warns once
        that the local parameters are not the global model.
        """
        if (
            self._group_size > 1
            and not self._warned_between_syncs
            and any(s != self.iterations for s in self._synced_at)
        ):
            self._warned_between_syncs = True
            warn_between_syncs(self._name, stacklevel=4)
        sync = self._in_flight
        if sync is not None:  # wait for its collective (local): the slots then hold its payload
            with self._peer_guard("waiting for the sync in flight", self.iterations):
                self._exchanges[sync.fragment.index].settle(sync.flight)
        return {
            "config": self._config(),
            "rank": 0 if self._managed is not None else self._channel.rank,
            "synced_at": list(self._synced_at),
            "closed_at": self._closed_at,
            "global": list(self._global),
            "outer": self._outer.state_dict(),
            "residuals": [[dict(r) for r in e.residuals] for e in self._exchanges],
            "pending": {
                "fragment": -1 if sync is None else sync.fragment.index,
                "launched_at": -1 if sync is None else sync.launched_at,
                "payload": [list(e.slots) for e in self._exchanges],
            },
            "syncs": self._syncs,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; everything is checked before anything changes.

        The checkpoint must come from the same configuration (options, parameters, group
        size). A sync that was in flight when it was taken is restored and applied at its step.
        """
        step = state_dict.get("iterations") if isinstance(state_dict, dict) else None
        self._step_being_loaded = step if isinstance(step, int) else self.iterations
        try:
            super().load_state_dict(state_dict)
        finally:
            self._step_being_loaded = None

    def _check_wrapper_state_dict(self, state: Any) -> None:
        step = self.iterations if self._step_being_loaded is None else self._step_being_loaded
        check_wrapper_state(
            state,
            owner=self._name,
            config=self._config(),
            global_=self._global,
            outer=self._outer,
            exchanges=self._exchanges,
            schedule=self._schedule,
            step=step,
            rank=0 if self._managed is not None else self._channel.rank,
        )

    def _load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        if self._in_flight is not None:  # its collective was launched on every rank: drain it
            with self._peer_guard("waiting for the sync in flight", self.iterations):
                self._exchanges[self._in_flight.fragment.index].settle(self._in_flight.flight)
            self._in_flight = None
        pending = state["pending"]
        with torch.no_grad():
            torch._foreach_copy_(self._global, list(state["global"]))
            for p, exchange in enumerate(self._exchanges):
                for entry, mine in zip(state["residuals"][p], exchange.residuals):
                    for name, residual in mine.items():
                        residual.copy_(entry[name])
                for saved, slot in zip(pending["payload"][p], exchange.slots):
                    slot.copy_(saved)
        self._outer.load_state_dict(state["outer"])
        if pending["fragment"] >= 0:
            fragment = self._schedule.fragments[pending["fragment"]]
            flight = self._exchanges[fragment.index].restore()
            self._in_flight = PendingSync(fragment, pending["launched_at"], flight)
        self._syncs = state["syncs"]
        # a checkpoint written before these keys existed: no fragment counts as synced
        self._synced_at = list(state.get("synced_at", [-1] * len(self._schedule)))
        self._closed_at = state.get("closed_at", -1)
