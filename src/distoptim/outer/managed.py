"""DiLoCo across torchft replica groups: every fragment sync is one round, committed or not.

Owns what a torchft manager changes in the outer family (``DiLoCo(manager=...)``, and so
LocalSGD and Streaming DiLoCo): which replicas a sync runs over, who contributes, what a
healing replica receives, and what a sync that is not committed leaves behind.

One fragment sync, launched after inner step ``t``:

1. **quorum** -- ``manager.start_quorum()``; the sync's collectives (header and payload) run
   over the quorum's members (:class:`~distoptim.ft.channel.QuorumChannel`), which change from
   sync to sync: the fragment exchange and the header follow (``rebind``; a two-phase or top-k
   wire restarts its error-feedback residuals when the members change, see
   :mod:`distoptim.outer.exchange`).
2. **header** -- every member sends its header (:mod:`distoptim.outer.agreement`) with a
   *healing* flag (torchft will give it a peer's state at the commit: its own state is stale,
   so it contributes zeros) and the bitwise checksum of the fragment's global copy and outer
   state (whole, or a slice of it: below). The contributing members must agree on the step,
   the fragment, the slice and the checksum; a healing member adopts their step (and so the
   fragment), whatever its own counter said -- a replica restarted from scratch lands on the
   schedule of the others.
3. **payload** -- ``Δ`` (zeros from a healing member) averaged over the contributors; before
   it, the error-feedback residuals are saved, so a sync that is not committed takes nothing
   into them.
4. **commit** -- at the sync's apply step (``t + τ``): ``manager.should_commit()``. A healing
   replica loads, inside it, what :meth:`ManagedSyncs.register` registered: the global copy, the
   outer optimizer's state and the sync counters as the donor had them when the quorum formed
   (before this sync's outer step), with the user's model and inner optimizer state (their
   ``state_dict`` given to the manager). On True every replica takes the same outer step on the
   same global copy with the same mean, so the healed replica leaves the sync bit-for-bit equal
   to the others (the next header checks it). On False (a peer died mid-sync, too few replicas,
   a refused joiner): no outer step; the fragment's local parameters are reset to its global
   copy (torchft's own DiLoCo does the same) and the residuals to their saved values.

The state check, amortized as CrossShardOptimizer's (:mod:`distoptim.sync.replicated`). A
sync checks its fragment's *whole* state unless its round runs *clean* on: the previous round
of this replica was clean -- committed, in this same quorum (the same members), with every
member contributing (none healing, none void) -- and so was every round since this quorum's
chain of clean rounds began, one of which checked this fragment. Such a sync checks only slice
``n mod K`` of ``K`` (:func:`~distoptim.comm.checksum.state_slices`), ``n`` the fragment's sync
number (from the agreed step, so every member picks the same). Why every commit's members
still agree on the whole state: in a chain of clean rounds nobody's state is replaced (no heal)
and every member applies the same committed outer steps, deterministically, to states checked
equal (wholly, at the chain's first check of the fragment, then by induction); a state that
drifts nevertheless (a fault outside the protocol) differs in some slice, which a sync of that
fragment within the next ``K`` compares. What a heal or a membership change brings in is
checked whole at the next sync of each fragment. Members that ever picked different slices are
told so by the header and the sync is void (not committed, so the next one is whole).

What a healing replica does *not* receive: the error-feedback residuals (they are what this
replica's own past contributions dropped; a copy of the donor's would count the donor's dropped
mass twice), which restart from zero, and the step counter, taken from the header instead (the
donor's was read when the quorum formed, ``τ`` steps before the commit).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distoptim.comm.checksum import state_checksum, state_slices
from distoptim.comm.guard import RoundKind
from distoptim.ft.channel import QuorumChannel
from distoptim.ft.replicas import ManagedReplicas
from distoptim.outer.agreement import HeaderVerdict, SyncAgreement
from distoptim.outer.exchange import FragmentExchange
from distoptim.outer.fragments import Fragment, FragmentSchedule
from distoptim.outer.groups import local_view
from distoptim.outer.state import PendingSync

__all__ = ["ManagedDiLoCo", "ManagedRound", "ManagedSyncs"]


@dataclass
class ManagedRound:
    """The round of one fragment sync: its channel, and whether this replica is healing."""

    channel: QuorumChannel | None  # None: the quorum failed (no collective this round)
    healing: bool
    residuals: list[dict[str, torch.Tensor]]  # saved before the payload (restored on failure)
    adopted: bool = False  # a healing replica took the contributors' step from the header
    quorum_id: int | None = None
    fragment: int | None = None  # the fragment whose state this round's header checked
    clean: bool = False  # the header's table: every member contributed, the sync stands


class ManagedSyncs:
    """The torchft side of one DiLoCo (see the module docstring)."""

    def __init__(self, manager: Any, owner: str) -> None:
        self.replicas = ManagedReplicas(manager, owner)
        self.owner = owner
        self.round: ManagedRound | None = None
        self._heals_at_start = 0
        self.needs_step = False  # healed without the contributors' step: heal-flag the next sync
        # the chain of clean rounds this replica is in: its quorum, the fragments it checked
        self._clean_quorum: int | None = None
        self._checked: set[int] = set()
        self._slices: dict[tuple[int, int], int] = {}  # K per (fragment, tensors), cached

    def register(
        self, state_dict: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]
    ) -> None:
        """What a healing replica receives (copied when the quorum asks for it)."""
        self.replicas.register_state("syncs", state_dict, load)

    def begin(self, exchanges: Sequence[FragmentExchange]) -> ManagedRound:
        """Start (or join) this sync's round: the quorum, and every exchange rebound to it."""
        heals = self.replicas.stats.heals
        self.replicas.start()
        quorum = self.replicas.quorum()
        # a synchronous-quorum manager heals inside start_quorum(): this replica's local
        # parameters are then the donor's, and its Δ would count the donor's twice
        healing = not quorum.contributes or self.replicas.stats.heals > heals
        # a replica that loaded a donor's state in a sync whose header failed (the donor died
        # mid-sync) holds the others' global copy but not their step: it says it is healing
        # once more, contributes nothing, and adopts the contributors' step from the header
        healing = healing or self.needs_step
        channel = None if quorum.failed else QuorumChannel(self.replicas, quorum)
        if channel is not None:
            for exchange in exchanges:
                exchange.rebind(channel)
        self.round = ManagedRound(channel, healing, [], quorum_id=quorum.quorum_id)
        return self.round

    @property
    def healing(self) -> bool:
        """Whether this replica is healing in the round in progress."""
        return self.round is not None and self.round.healing

    def loaded(self) -> None:
        """A donor's state was loaded (inside the commit): unless this sync's header gave this
        replica the contributors' step, the next sync must (see :meth:`begin`)."""
        if self.round is None or not self.round.adopted:
            self.needs_step = True

    def adopted(self) -> None:
        """This healing replica took the contributors' step from this sync's header."""
        assert self.round is not None
        self.round.adopted = True
        self.needs_step = False

    def caught_up(self, t: int, verdict: HeaderVerdict) -> None:
        """This replica stood at step ``t`` behind the others (the void ``verdict``): said
        once per catch-up, as a ``RuntimeWarning`` (a loop that skips ``step()`` calls would
        otherwise void sync after sync without a word)."""
        self.replicas.stats.caught_up += 1
        warnings.warn(
            f"{self.owner}: this replica was at step {t}, behind the others in its quorum "
            f"({verdict.void}); it jumps {verdict.step - t} inner steps ahead",
            RuntimeWarning,
            stacklevel=4,
        )

    def save_residuals(self, exchange: FragmentExchange) -> None:
        """Keep the fragment's residuals as they are before its payload is encoded."""
        assert self.round is not None
        self.round.residuals = [{k: v.clone() for k, v in r.items()} for r in exchange.residuals]

    def state_word(
        self, fragment: int | None, number: int | None, tensors: Sequence[torch.Tensor]
    ) -> tuple[int, int, int]:
        """``(part, parts, checksum)`` of ``tensors`` (the state of ``fragment``, ``None``: the
        whole global copy), this round's check (see the module docstring): a slice when the
        round runs a clean chain on and ``number`` (the fragment's sync number) is given."""
        rnd = self.round
        part, parts = 0, 1
        if (
            rnd is not None
            and fragment is not None
            and number is not None
            and rnd.quorum_id == self._clean_quorum
            and fragment in self._checked
        ):
            key = (fragment, len(tensors))  # the outer state may appear after a first step
            parts = self._slices.get(key) or self._slices.setdefault(key, state_slices(tensors))
            part = number % parts
        if rnd is not None:
            rnd.fragment = fragment
        return part, parts, state_checksum(tensors, part, parts)

    def judged(self, verdict: HeaderVerdict) -> None:
        """The header's verdict: whether this round's table was clean (every member
        contributed and the sync stands)."""
        rnd = self.round
        if rnd is not None and rnd.channel is not None:
            rnd.clean = (
                verdict.contributors == rnd.channel.size
                and not verdict.void
                and not verdict.refusing
            )

    def fail(self, why: str) -> None:
        """This round must not commit (every replica reaches the same decision)."""
        self.replicas.manager.report_error(RuntimeError(why))

    def commit(self, exchange: FragmentExchange) -> bool:
        """``should_commit()``; on False, the residuals go back to their saved values."""
        ok = self.replicas.commit()
        rnd, self.round = self.round, None
        if ok and rnd is not None and rnd.clean and rnd.fragment is not None:
            if rnd.quorum_id != self._clean_quorum:  # a new chain: this round checked whole
                self._clean_quorum, self._checked = rnd.quorum_id, set()
            self._checked.add(rnd.fragment)
        else:  # not clean: every fragment's next sync checks the whole state
            self._clean_quorum, self._checked = None, set()
        if not ok and rnd is not None and rnd.residuals:
            with torch.no_grad():
                for mine, saved in zip(exchange.residuals, rnd.residuals):
                    for name, value in mine.items():
                        value.copy_(saved[name])
        return ok


class ManagedDiLoCo:
    """The managed-sync methods of :class:`~distoptim.outer.diloco.DiLoCo` (a mixin, as
    :class:`~distoptim.outer.state.DiLoCoState` is for checkpoints: it reads the optimizer's
    attributes, declared here for type checkers, and calls its ``_agree()`` and ``_refuse()``)."""

    iterations: int
    _managed: ManagedSyncs | None
    _channel: Any
    _agreement: SyncAgreement | None
    _exchanges: list[FragmentExchange]
    _schedule: FragmentSchedule
    _global: list[torch.Tensor]
    _params: list[torch.Tensor]
    _outer: torch.optim.Optimizer
    _syncs: int
    _refused_syncs: int
    _synced_at: list[int]
    _agree: Callable[..., HeaderVerdict]
    _refuse: Callable[[Fragment, int, list[str]], None]

    def _managed_launch(self, fragment: Fragment, t: int, kind: RoundKind) -> PendingSync | None:
        """The same, as one torchft round (see :mod:`distoptim.outer.managed`)."""
        managed = self._managed
        assert managed is not None
        rnd = managed.begin(self._exchanges)
        if rnd.channel is None:  # the quorum failed: nothing travels, the commit will say no
            return PendingSync(fragment, t, None)
        self._channel = rnd.channel
        assert self._agreement is not None
        self._agreement.rebind(rnd.channel)
        exchange = self._exchanges[fragment.index]
        finite = True if rnd.healing else exchange.form()
        verdict = self._agree(kind, t, fragment, finite, healing=rnd.healing)
        managed.judged(verdict)
        if rnd.healing and not verdict.void:  # take the contributors' step and fragment
            managed.adopted()
            self.iterations = verdict.step - 1  # step() counts this one afterwards
            t = verdict.step
            fragment = self._schedule.fragments[verdict.fragment or 0]
            exchange = self._exchanges[fragment.index]
            exchange.zero()
        if verdict.void:
            if verdict.catch_up and t < verdict.step:  # a straggler: on to the others' step
                managed.caught_up(t, verdict)
                self.iterations = verdict.step - 1  # step() counts this one afterwards
                t = verdict.step
                fragment = self._schedule.fragments[verdict.fragment or 0]
            managed.fail(verdict.void)
            return PendingSync(fragment, t, None)
        if verdict.refusing:
            managed.fail("a non-finite pseudo-gradient")
            managed.commit(exchange)
            self._refuse(fragment, t, verdict.refusing)
            return None
        rnd.channel.contributors = verdict.contributors
        managed.save_residuals(exchange)
        return PendingSync(fragment, t, exchange.launch())

    def _state_word(
        self, kind: RoundKind, t: int, fragment: Fragment | None
    ) -> tuple[int, int, int]:
        """The header's state word ``(part, parts, checksum)``: the bitwise checksum of
        ``fragment``'s global copy and its parameters' outer optimizer state (this process's
        shards), whole or one slice (see :mod:`distoptim.outer.managed`)."""
        managed = self._managed
        assert managed is not None
        if fragment is None:
            tensors, params = list(self._global), self._params
        else:
            tensors = list(self._exchanges[fragment.index].global_)
            params = self._params[fragment.start : fragment.stop]
        for p in params:
            state = self._outer.state.get(p, {})
            tensors += [local_view(v) for _, v in sorted(state.items()) if torch.is_tensor(v)]
        number = None  # a sync in step(): the fragment's sync number, the same on every member
        if fragment is not None and kind is RoundKind.STEP:
            number = (t // self._schedule.period - 1) // len(self._schedule)
        index = None if fragment is None else fragment.index
        return managed.state_word(index, number, tensors)

    def _role(self) -> str:
        """This replica's role in the round in progress, as fault injection names it."""
        managed = self._managed
        healing = managed is not None and (managed.healing or managed.needs_step)
        return "joiner" if healing else "contributor"

    def _heal_state(self) -> dict[str, Any]:
        """What a healing replica receives from this one (see :mod:`distoptim.outer.managed`)."""
        return {
            "global": list(self._global),
            "outer": self._outer.state_dict(),
            "syncs": self._syncs,
            "refused_syncs": self._refused_syncs,
            "synced_at": list(self._synced_at),
        }

    def _load_heal_state(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            torch._foreach_copy_(self._global, list(state["global"]))
            for exchange in self._exchanges:  # this replica's own dropped mass: none yet
                for residuals in exchange.residuals:
                    for value in residuals.values():
                        value.zero_()
        self._outer.load_state_dict(state["outer"])
        self._syncs = int(state["syncs"])
        self._refused_syncs = int(state["refused_syncs"])
        self._synced_at = list(state["synced_at"])
        if self._managed is not None:
            self._managed.loaded()
