"""DiLoCo's state dict: what a checkpoint holds, and how a loaded one is put back.

Owns the wrapper state of :class:`~distoptim.outer.diloco.DiLoCo` (as the
:class:`DiLoCoState` mixin the optimizer inherits): writing it (global copy, outer state,
residuals, the sync in flight settled into its payload slots, counters), checking a loaded one
(:func:`~distoptim.outer.checkpoint.check_wrapper_state`), and restoring it, a sync in flight
included (:class:`PendingSync`). The semantics are the optimizer's (``docs/diloco.md``).

The error-feedback residuals and payload slots have the layout of the channel the fragment's
exchange was last bound to (its size and this member's rank: a two-phase mean's shard, a
gather's rows); the checkpoint records that layout per fragment (``"layout"``). Under a torchft
manager the channel is the quorum's, which a freshly built optimizer has not met yet: it loads
residuals of another layout by binding its exchanges to an :class:`UnboundChannel` of the saved
layout (buffers of those shapes, no collective). The first sync's quorum then rebinds them to
its channel: with the saved layout (the same membership) the residuals are kept, exactly as an
uninterrupted run keeps them; with another they restart from zero, as they would have there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distoptim.comm.channel import Channel, Handle
from distoptim.comm.stats import CommStats
from distoptim.comm.wire import parse_wire
from distoptim.outer.checkpoint import ExchangeLayout, check_wrapper_state, warn_between_syncs
from distoptim.outer.exchange import FragmentExchange, InFlight
from distoptim.outer.fragments import Fragment, FragmentSchedule

__all__ = ["DiLoCoState", "PendingSync", "UnboundChannel"]


class UnboundChannel(Channel):
    """A channel layout (``size`` members, this one ``rank``) with no members behind it.

    What a managed optimizer's exchanges are bound to after loading a checkpoint, until the
    first sync's quorum rebinds them: their buffers get the saved layout's shapes. Any
    collective over it is a bug (a sync always begins by binding its quorum) and raises.
    """

    def __init__(self, size: int, rank: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"an unbound channel needs 0 <= rank < size, got {rank}, {size}")
        self._size, self._rank = size, rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def _unbound(self) -> Handle:
        raise RuntimeError(
            "a collective over a restored channel layout: the sync's quorum must bind it first"
        )

    def all_reduce_sum(self, tensor: torch.Tensor) -> Handle:
        return self._unbound()

    def all_gather_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        return self._unbound()

    def all_to_all_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        return self._unbound()


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
    wire: str
    error_feedback: bool
    fragment_sync_delay: int

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
            "layout": [[e.channel.size, e.channel.rank] for e in self._exchanges],
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
            exchanges=self._saved_layouts(state),
            schedule=self._schedule,
            step=step,
            rank=0 if self._managed is not None else self._channel.rank,
        )

    def _saved_layouts(self, state: Any) -> list[FragmentExchange | ExchangeLayout]:
        """What each fragment's residuals and slots are checked against: the exchange itself,
        or (managed, another layout saved) the buffers it would have with the saved layout."""
        layouts = self._layouts_to_restore(state)
        return [
            exchange if layout is None else self._template(exchange, layout)
            for exchange, layout in zip(self._exchanges, layouts)
        ]

    def _layouts_to_restore(self, state: Any) -> list[tuple[int, int] | None]:
        """Per fragment, the saved ``(size, rank)`` when it differs from its exchange's and the
        optimizer is managed (a plain group's layout is fixed: config and rank say so)."""
        saved = state.get("layout") if isinstance(state, dict) else None
        none: list[tuple[int, int] | None] = [None] * len(self._exchanges)
        if self._managed is None or saved is None:
            return none
        if not isinstance(saved, list) or len(saved) != len(self._exchanges):
            raise ValueError(
                f"state_dict['wrapper']['layout'] must be a list of {len(self._exchanges)} "
                f"[size, rank] pairs, got {saved!r}"
            )
        out: list[tuple[int, int] | None] = []
        for entry, exchange in zip(saved, self._exchanges):
            if (
                not isinstance(entry, (list, tuple))
                or len(entry) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
                or not 0 <= entry[1] < entry[0]
            ):
                raise ValueError(
                    "state_dict['wrapper']['layout'] must hold [size, rank] pairs with "
                    f"0 <= rank < size, got {entry!r}"
                )
            here = (exchange.channel.size, exchange.channel.rank)
            out.append(None if tuple(entry) == here else (entry[0], entry[1]))
        return out

    def _template(self, exchange: FragmentExchange, layout: tuple[int, int]) -> ExchangeLayout:
        """The residuals and slots ``exchange`` would have over a channel of ``layout``."""
        mean = parse_wire(self.wire).mean(UnboundChannel(*layout), CommStats(), self.error_feedback)
        keep = self.fragment_sync_delay > 0
        buffers = [
            mean.buffers(torch.empty(b.numel, dtype=b.dtype, device=b.device), keep)
            for b in exchange.plan.buckets
        ]
        return ExchangeLayout(
            residuals=[b.residuals for b in buffers if b.residuals],
            slots=[b.slot for b in buffers if b.slot is not None],
        )

    def _load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        if self._in_flight is not None:  # its collective was launched on every rank: drain it
            with self._peer_guard("waiting for the sync in flight", self.iterations):
                self._exchanges[self._in_flight.fragment.index].settle(self._in_flight.flight)
            self._in_flight = None
        for exchange, layout in zip(self._exchanges, self._layouts_to_restore(state)):
            if layout is not None:  # the saved layout, until the first quorum rebinds it
                exchange.rebind(UnboundChannel(*layout))
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
