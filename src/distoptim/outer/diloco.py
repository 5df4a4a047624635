"""DiLoCo and Streaming DiLoCo: local inner steps, outer steps on averaged pseudo-gradients.

Owns the user-facing semantics of the synchronous outer-optimizer family (``docs/diloco.md``):
argument validation, the (sub)group of replicas, the sync schedule, how the outer optimizer --
built by the user over the *model's* parameters -- is applied to the global copy, the mixing of
local and global values, how a run ends (:meth:`DiLoCo.finish`: the final sync of every
fragment), what every replica does with a sync refused for a non-finite pseudo-gradient, a
collective that fails because a peer left, and checkpoints. What travels, and in which wire
format, is :mod:`distoptim.outer.exchange`; which parameters sync when is
:mod:`distoptim.outer.fragments`; what the replicas agree on before a sync is
:mod:`distoptim.outer.agreement`; what a checkpoint must hold is :mod:`distoptim.outer.checkpoint`.

The algorithm (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models", arXiv 2311.08105, Algorithm 1; fragments, delay and mixing from Douillard et
al. 2025, "Streaming DiLoCo with overlapping communication", arXiv 2501.18512, Algorithm 2).
Each of the ``n`` replicas of the group holds local parameters ``θ_r`` and the same global copy
``θ_g`` (initially the parameters at construction, which must be equal on every replica).
``step()`` runs the inner optimizer on ``θ_r``; when inner step ``t`` completes and fragment
``p`` is due (``t ≡ (p + 1)·H/F mod H``, see :mod:`~distoptim.outer.fragments`), for the
parameters of that fragment::

    Δ       = mean_r (θ_g - θ_r(t))                 all-reduced at t, in the wire format
    θ_g'    = OuterOpt(θ_g, grad = Δ)               applied at t + τ
    θ_r     ← alpha·θ_r(t + τ) + (1 - alpha)·θ_g'   on every replica;  θ_g ← θ_g'

With ``F = 1``, ``τ = 0``, ``alpha = 0``: DiLoCo, a sync every ``H`` steps after which every
replica holds ``θ_g'``. With ``alpha = 0`` and ``τ > 0`` the ``τ`` inner steps a fragment took while
its sync was in flight are dropped for that fragment (the paper's choice); ``alpha > 0`` keeps a
share of them.

How the outer optimizer reaches the global copy: ``outer`` is a plain ``torch.optim`` optimizer
over the same parameter objects as ``inner`` (its state, e.g. Nesterov momentum, is keyed by
them). At an outer step the fragment's parameters are loaded with ``θ_g``, ``Δ`` is swapped into
their ``.grad`` (every other ``.grad`` is ``None``, so the outer optimizer updates only the
fragment), ``outer.step()`` runs, its result is copied back into the global copy, and the
parameters then take ``alpha·θ_r + (1 - alpha)·θ_g'``. The caller's ``.grad`` are restored
afterwards.
No tensor changes identity: schedulers, hooks and ``torch.compile`` keep seeing the same
parameters, and ``outer`` can be stepped by the user's own scheduler or inspected as usual.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import (
    check_bool,
    check_bucket_cap_mb,
    check_finite_hyperparameters,
    check_int,
    type_name,
)
from distoptim.comm.channel import Channel, GroupChannel
from distoptim.comm.groups import check_group_assignment, comm_device
from distoptim.comm.guard import DesyncError, RoundKind
from distoptim.comm.stats import CommStats
from distoptim.comm.wire import parse_wire
from distoptim.outer.agreement import (
    HeaderVerdict,
    NonFiniteSyncError,
    ReplicaIdentity,
    SyncAgreement,
)
from distoptim.outer.exchange import FragmentExchange
from distoptim.outer.fragments import Fragment, FragmentSchedule
from distoptim.outer.managed import ManagedSyncs
from distoptim.outer.state import DiLoCoState, PendingSync
from distoptim.protocol import WrappedOptimizer, swapped_grads

__all__ = ["DiLoCo", "GlobalParameters"]

_MIB = 1 << 20


class GlobalParameters(list):  # type: ignore[type-arg]
    """The global copy ``θ_g``: one tensor per parameter, in the inner optimizer's order.

    A list of the live tensors (do not modify them). Calling it returns itself, so
    ``opt.global_parameters()`` -- :class:`~distoptim.AsyncDiLoCoOptimizer`'s spelling -- reads
    the same list as ``opt.global_parameters``.
    """

    def __call__(self) -> GlobalParameters:
        return self


class DiLoCo(DiLoCoState, WrappedOptimizer):
    """DiLoCo / Streaming DiLoCo over any inner and outer ``torch.optim.Optimizer``.

    Args:
        inner: the optimizer of the local steps (DiLoCo's paper: AdamW).
        outer: the optimizer of the global copy, built over exactly ``inner``'s parameters
            (DiLoCo's paper: ``SGD(lr=0.7, momentum=0.9, nesterov=True)``); it may group them
            differently and have its own scheduler. It steps once per fragment sync.
        sync_every: ``H``, inner steps between two syncs of the same fragment (``>= 1``).
        fragments: ``F``, contiguous fragments balanced by bytes that sync in turn, one every
            ``H/F`` steps (``H`` divisible by ``F``, ``F <= number of parameters``).
        fragment_sync_delay: ``τ``, inner steps a sync stays in flight before its outer step
            is applied (``0 <= τ < H/F``); the collective overlaps those steps.
        fragment_update_alpha: ``alpha`` in ``[0, 1]``, the share of the local values a fragment
            keeps when the new global values arrive.
        wire: how pseudo-gradients travel, a name of the wire registry
            (:mod:`distoptim.comm.wire`, case-insensitive): ``"fp32"`` (lossless: the
            parameters' own dtype; a SUM all-reduce), ``"fp16"``, ``"bf16"``, ``"int8"``,
            ``"int4"``, ``"int2"`` (16-bit casts, or integers with per-chunk absmax scales; a
            two-phase encoded mean), ``"topk:D"`` or ``"topk:D+V"`` (per chunk the fraction
            ``D`` of values of largest magnitude, values in format ``V``; gather-and-sum).
            See ``docs/compression.md``.
        group: ``None`` (all ranks form one group of replicas), a ``group_assignment``
            (equal-size lists of ranks partitioning the world, as CrossShardOptimizer's; each
            subgroup runs its own DiLoCo), or an existing ``ProcessGroup``.
        name: returned by ``get_name()``.
        error_feedback: with a lossy wire, add what the encoding dropped to the next
            pseudo-gradient encoded at the same place (per replica, kept in ``state_dict``;
            keyword only; default on).
        bucket_cap_mb: payload cap of one pseudo-gradient bucket in MiB (keyword only).
        manager: a ``torchft.Manager`` (keyword only): the replicas are torchft replica groups
            that may die and join; every fragment sync is one quorum, committed only if
            ``should_commit()`` says so, a failed sync resets the fragment to its global copy,
            and a joiner is healed from a peer (see :mod:`distoptim.outer.managed` and
            ``docs/fault_tolerance.md``). ``group`` must then be None.

    Outside an initialized process group (or on a group of one) the optimizer runs as one
    replica: ``Δ`` is the replica's own and nothing is sent. Every sync starts with a small
    fixed-size header (:mod:`~distoptim.outer.agreement`) in which the replicas agree on the
    step, the fragment, the parameters, the options, both optimizers' hyperparameters and the
    fragment's global copy, and say whether their pseudo-gradient is finite, so a divergence
    raises :class:`~distoptim.comm.guard.DesyncError` (or its subclass
    ``ParameterMismatchError``) on every rank instead of mixing wrong values or hanging, and a
    non-finite pseudo-gradient is refused on every replica
    (:class:`~distoptim.outer.agreement.NonFiniteSyncError`).

    Collective calls (every replica of the group must make them, at the same step): ``step()``
    at a sync step (and, with ``τ > 0`` and a two-phase wire, at the step that applies the sync
    in flight) and ``finish()``. ``state_dict()`` and ``load_state_dict()`` are local (with a
    sync in flight they wait for its launched collective, which every replica started).
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        outer: torch.optim.Optimizer,
        sync_every: int,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        wire: str = "fp32",
        group: Sequence[Sequence[int]] | dist.ProcessGroup | None = None,
        name: str = "DiLoCo",
        *,
        error_feedback: bool = True,
        bucket_cap_mb: float = 25,
        manager: Any = None,
    ) -> None:
        # -- validate everything before any side effect (subgroup creation is collective) --
        owner = name if isinstance(name, str) else type(self).__name__
        if manager is not None:
            _check_managed(owner, manager, group)
        for arg, value in (("inner", inner), ("outer", outer)):
            if not isinstance(value, torch.optim.Optimizer):
                raise TypeError(
                    f"{owner}: {arg} must be a torch.optim.Optimizer, got {type_name(value)}"
                )
        if outer is inner:
            raise ValueError(
                f"{owner}: outer must be a separate optimizer over the same parameters as "
                "inner (its state is the global copy's), not the inner optimizer itself"
            )
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type_name(name)}")
        sync_every = check_int("sync_every", sync_every, 1)
        fragments = check_int("fragments", fragments, 1)
        delay = check_int("fragment_sync_delay", fragment_sync_delay, 0)
        alpha = _check_alpha(fragment_update_alpha)
        wire_format = parse_wire(wire)
        error_feedback = check_bool("error_feedback", error_feedback)
        cap = check_bucket_cap_mb(bucket_cap_mb)
        params = [p for g in inner.param_groups for p in g["params"]]
        _check_same_parameters(owner, params, outer)
        if fragments > len(params):
            raise ValueError(
                f"fragments={fragments} is more than the {len(params)} parameters of the inner "
                "optimizer: every fragment needs at least one parameter"
            )
        if sync_every % fragments:
            raise ValueError(
                f"sync_every={sync_every} must be divisible by fragments={fragments} (fragments "
                "sync in turn, one every sync_every/fragments inner steps)"
            )
        if delay >= sync_every // fragments:
            raise ValueError(
                f"fragment_sync_delay={delay} must be < sync_every/fragments = "
                f"{sync_every // fragments}: a fragment's sync must be applied before the next "
                "fragment's starts"
            )
        check_finite_hyperparameters(inner, owner)
        check_finite_hyperparameters(outer, owner)
        assignment, group_obj = _check_group(group)

        # -- side effects --
        group_size = 0 if manager is not None else 1  # 0: the quorum's, sync by sync
        if assignment is not None:
            group_obj, _ = dist.new_subgroups_by_enumeration(assignment)
        if group_obj is not None:
            group_size = dist.get_world_size(group_obj)
        elif manager is None and dist.is_available() and dist.is_initialized():
            group_size = dist.get_world_size()
        super().__init__(inner, name=name)
        self._outer = outer
        self.sync_every = sync_every
        self.fragments = fragments
        self.fragment_sync_delay = delay
        self.fragment_update_alpha = alpha
        self.wire = wire_format.name
        self.error_feedback = error_feedback
        self.bucket_cap_mb = cap
        self.group_assignment = assignment
        self._group = group_obj
        self._group_size = group_size
        self._channel: Channel = GroupChannel(group_obj, max(group_size, 1))
        self._params = params
        self._stats = CommStats()
        with torch.no_grad():
            self._global = [p.detach().clone() for p in params]
        self._schedule = FragmentSchedule(
            [p.numel() * p.element_size() for p in params], fragments, sync_every, delay
        )
        self._exchanges = [
            FragmentExchange(
                params[f.start : f.stop],
                self._global[f.start : f.stop],
                wire_format,
                self._channel,
                self._stats,
                error_feedback,
                cap_bytes=max(1, int(cap * _MIB)),
                keep_payload=delay > 0,
            )
            for f in self._schedule.fragments
        ]
        self._agreement: SyncAgreement | None = None
        if group_size > 1 or manager is not None:
            device = comm_device(group_obj) if manager is None else torch.device("cpu")
            self._agreement = SyncAgreement(self._channel, self._stats, device, name)
        self._managed: ManagedSyncs | None = None
        if manager is not None:
            self._managed = ManagedSyncs(manager, name)
            self._managed.register(self._heal_state, self._load_heal_state)
        # what every header says about this replica: parameters, options, optimizers
        self._identity = ReplicaIdentity(type(self).__name__, params, self._config(), inner, outer)
        self._in_flight: PendingSync | None = None
        self._syncs = 0
        self._refused_syncs = 0
        self._refused: list[str] = []  # refusals not raised yet (raised at the end of the call)
        # per fragment, the step after which its local values were its global copy (they are
        # "synced" iff that is the current step); the step at which finish() or a refusal last
        # closed the sync the schedule had in flight
        self._synced_at = [0] * len(self._schedule)
        self._closed_at = -1
        self._warned_between_syncs = False
        self._step_being_loaded: int | None = None
        self._built = True

    # ---- public read-only facts --------------------------------------------------------------
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
        works too (see :class:`GlobalParameters`).
        """
        return GlobalParameters(self._global)

    @property
    def syncs(self) -> int:
        """Fragment syncs applied so far (outer steps taken)."""
        return self._syncs

    @property
    def refused_syncs(self) -> int:
        """Fragment syncs refused because some replica's pseudo-gradient was not finite."""
        return self._refused_syncs

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.__dict__.get("_built"):
            raise ValueError(
                f"{self._name} fixes its parameters at construction (the global copy, the "
                "fragments and the buckets are built from them); build a new optimizer instead"
            )
        super().add_param_group(param_group)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The inner step, then the sync due now, if any (collective at a sync step).

        Raises :class:`~distoptim.outer.agreement.NonFiniteSyncError` on every replica, after
        the step is counted, when the sync was refused for a non-finite pseudo-gradient.
        """
        loss = super().step(closure)
        self._raise_refused()
        return loss

    def _after_inner_step(self) -> None:
        """After inner step ``t``: apply the sync due at ``t``, launch the fragment due at ``t``."""
        t = self.iterations + 1
        sync = self._in_flight
        if sync is not None and sync.launched_at + self.fragment_sync_delay == t:
            self._in_flight = None
            self._apply(sync, t, self.fragment_update_alpha)
        fragment = self._schedule.launching_at(t)
        if fragment is None:
            return
        sync = self._launch(fragment, t, RoundKind.STEP)
        if sync is None:  # refused: nothing in flight until the next launch
            self._closed_at = t
        elif self.fragment_sync_delay == 0:
            self._apply(sync, t, self.fragment_update_alpha)
        else:
            self._in_flight = sync

    def finish(self) -> None:
        """End a run (or a phase of it) with every replica holding the global model.

        Collective: every replica of the group calls it, after the same number of ``step()``
        calls. It applies the sync in flight, if any, then syncs now every fragment whose local
        values are not its global copy -- each such fragment as if its sync were due: ``Δ``
        averaged in the wire format, one outer step -- and sets the fragment's local values to
        the new global copy (``alpha`` does not apply). A fragment whose sync was applied at
        this very step with ``alpha = 0`` is left as it is, so at a sync step of plain DiLoCo
        nothing changes. Afterwards ``model.parameters()`` equal :attr:`global_parameters` on
        every replica, bit for bit.

        If some replica still steps (it reached a sync while this one finished), or finished at
        another step, every replica raises ``DesyncError`` as soon as both are in the header
        (no update applied). Training may go on after ``finish()``; the schedule continues.
        Raises ``NonFiniteSyncError`` (after finishing every other fragment) if a final sync
        was refused. On one replica: the same final syncs, no communication. With a torchft
        manager every final sync is a round of its own, committed or not, and a finish with
        nothing left to sync exchanges nothing.
        """
        t = self.iterations
        managed = self._managed is not None
        sync = self._in_flight
        if sync is not None:
            if not managed:  # a managed sync in flight is judged by its commit
                self._agree(RoundKind.FINISH, t, sync.fragment)  # before its last collective
            self._in_flight, self._closed_at = None, t
            self._apply(sync, t, self.fragment_update_alpha, header=False)
        left = [f for f in self._schedule.fragments if self._synced_at[f.index] != t]
        if sync is None and not left and not managed:
            self._agree(RoundKind.FINISH, t, None)  # nothing to sync: only agree on the end
        for fragment in left:
            launched = self._launch(fragment, t, RoundKind.FINISH)
            if launched is not None:
                self._apply(launched, t, 0.0, header=False)
        self._raise_refused()

    def _launch(self, fragment: Fragment, t: int, kind: RoundKind) -> PendingSync | None:
        """Form the fragment's ``Δ``, agree on the header, launch its mean (``None``: refused)."""
        if self._managed is not None:
            return self._managed_launch(fragment, t, kind)
        exchange = self._exchanges[fragment.index]
        refusing = self._agree(kind, t, fragment, exchange.form()).refusing
        if refusing:
            self._refuse(fragment, t, refusing)
            return None
        with self._peer_guard("the pseudo-gradient mean", t):
            return PendingSync(fragment, t, exchange.launch())

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
        if rnd.healing and not verdict.void:  # take the contributors' step and fragment
            managed.adopted()
            self.iterations = verdict.step - 1  # step() counts this one afterwards
            t = verdict.step
            fragment = self._schedule.fragments[verdict.fragment or 0]
            exchange = self._exchanges[fragment.index]
            exchange.zero()
        if verdict.void:
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

    def _refuse(self, fragment: Fragment, t: int, replicas: list[str]) -> None:
        """Every replica refuses the sync: no outer step, the fragment's local values reset to
        its global copy; the error is raised at the end of the call (the step is counted)."""
        exchange = self._exchanges[fragment.index]
        with torch.no_grad():
            torch._foreach_copy_(exchange.local, exchange.global_)
        self._synced_at[fragment.index] = t
        self._refused_syncs += 1
        self._refused.append(
            f"the sync of fragment {fragment.index} after step {t} (the pseudo-gradient "
            f"θ_g - θ_r of {', '.join(replicas)} is not finite)"
        )

    def _raise_refused(self) -> None:
        if not self._refused:
            return
        what, self._refused = "; ".join(self._refused), []
        raise NonFiniteSyncError(
            f"{self._name}: refused on every replica: {what}. No outer step was taken: the "
            "global copy is unchanged and every replica's parameters of the fragment were reset "
            "to it (the inner optimizers' states were not). The replicas are still in step and "
            "training can go on (catch NonFiniteSyncError), but look for the cause first: a "
            "learning rate too large, an fp16/bf16 overflow, a NaN loss on that replica's data."
        )

    @contextlib.contextmanager
    def _peer_guard(self, what: str, t: int) -> Iterator[None]:
        """A collective that fails because a peer left becomes a ``DesyncError`` saying so."""
        try:
            yield
        except (DesyncError, torch.OutOfMemoryError):
            raise
        except RuntimeError as exc:
            rank = self._channel.ranks[self._channel.rank]
            raise DesyncError(
                f"{self._name}: rank {rank}: {what} of step {t} failed while waiting for the "
                "other replicas: a replica stopped taking part in this group's syncs. Its "
                "training loop ended before this sync without finish() -- call opt.finish() on "
                "every replica when training ends, so that a replica that stops early fails the "
                "others at once, by name -- or it took fewer step() calls, raised (its own error "
                f"is the real cause) or crashed.\n(the collective said: {type(exc).__name__}: "
                f"{str(exc).strip()})"
            ) from exc

    def _apply(self, sync: PendingSync, t: int, alpha: float, header: bool = True) -> None:
        """The outer step of one fragment on the global copy, then the local mix (see module).

        ``header``: agree first when the mean still runs a collective (phase 2) at another step
        than its launch; ``finish()`` has agreed already.
        """
        exchange = self._exchanges[sync.fragment.index]
        # a managed round whose peer died leaves garbage in the buffers: it will not commit
        if sync.flight is not None and not self._channel.failed:
            if header and exchange.finishes_with_collective and t != sync.launched_at:
                healing = self._managed is not None and self._managed.healing
                # e.g. phase 2 of a two-phase mean
                self._agree(RoundKind.STEP, t, sync.fragment, healing=healing)
            with self._peer_guard("the pseudo-gradient mean", t):
                mean = exchange.finish(sync.flight)
        if self._managed is not None and not self._managed.commit(exchange):
            with torch.no_grad():  # not committed: back to the last global copy
                torch._foreach_copy_(exchange.local, exchange.global_)
            self._synced_at[sync.fragment.index] = t
            return
        local, global_ = exchange.local, exchange.global_
        with torch.no_grad():
            kept = [p.detach().clone() for p in local] if alpha > 0 else None
            torch._foreach_copy_(local, global_)
            with swapped_grads(self._params, list(zip(mean, local))):
                self._outer.step()
            torch._foreach_copy_(global_, local)
            if kept is not None:
                torch._foreach_lerp_(local, kept, alpha)  # alpha·θ_r + (1 - alpha)·θ_g'
        if alpha == 0:
            self._synced_at[sync.fragment.index] = t
        self._syncs += 1

    def _agree(
        self,
        kind: RoundKind,
        t: int,
        fragment: Fragment | None,
        finite: bool = True,
        healing: bool = False,
    ) -> HeaderVerdict:
        """The sync header (see :mod:`~distoptim.outer.agreement`) before sized collectives.

        ``fragment``: the fragment whose sync follows (its global copy is compared), ``None``
        for a header that precedes no payload (the whole global copy is compared); ``finite``:
        whether this replica's pseudo-gradient of it is finite; ``healing``: (with a manager)
        this replica's state is about to be replaced by a peer's. Returns the verdict (the
        replicas whose pseudo-gradient is not finite, ...); raises on every disagreement.
        """
        index = None if fragment is None else fragment.index
        if self._agreement is None:
            mine = f"rank {self._channel.ranks[self._channel.rank]}"
            return HeaderVerdict([] if finite else [mine], t, index, 1)
        copy = self._global if fragment is None else self._exchanges[fragment.index].global_
        state = 0
        if self._managed is not None:
            outer_state = [self._outer.state.get(p, {}) for p in self._fragment_params(fragment)]
            state = self._managed.checksum(copy, outer_state)
        header = self._identity.header(kind, t, index, finite, healing, state)
        with self._peer_guard("the sync header", t):
            return self._agreement.check(header, copy, self._identity.describe)

    def _fragment_params(self, fragment: Fragment | None) -> list[torch.Tensor]:
        if fragment is None:
            return self._params
        return self._params[fragment.start : fragment.stop]

    def _config(self) -> dict[str, Any]:
        return {
            "sync_every": self.sync_every,
            "fragments": self.fragments,
            "fragment_sync_delay": self.fragment_sync_delay,
            "fragment_update_alpha": self.fragment_update_alpha,
            "wire": self.wire,
            "error_feedback": self.error_feedback,
            "bucket_cap_mb": self.bucket_cap_mb,
            "num_replicas": self._group_size,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.wrapped!r}, outer={self._outer!r}, "
            f"sync_every={self.sync_every}, fragments={self.fragments}, "
            f"fragment_sync_delay={self.fragment_sync_delay}, "
            f"fragment_update_alpha={self.fragment_update_alpha}, wire={self.wire!r}, "
            f"num_replicas={self._group_size})"
        )


# ---------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------
def _check_alpha(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or not 0.0 <= float(value) <= 1.0
    ):
        raise ValueError(f"fragment_update_alpha must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_same_parameters(
    owner: str, params: list[torch.Tensor], outer: torch.optim.Optimizer
) -> None:
    """``outer`` must hold exactly the parameter objects of ``inner`` (any grouping, any order)."""
    outer_params = [p for g in outer.param_groups for p in g["params"]]
    mine = {id(p) for p in params}
    theirs = {id(p) for p in outer_params}
    if mine == theirs:
        return
    missing = [tuple(p.shape) for p in params if id(p) not in theirs]
    extra = [tuple(p.shape) for p in outer_params if id(p) not in mine]
    raise ValueError(
        f"{owner}: outer must be built over exactly the inner optimizer's parameters (the same "
        f"tensor objects, e.g. both from model.parameters()); outer lacks {len(missing)} "
        f"of them (shapes {missing[:5]}) and has {len(extra)} others (shapes {extra[:5]})"
    )


def _check_managed(owner: str, manager: Any, group: Any) -> None:
    """A torchft manager replaces ``group`` (the replicas are its quorum's)."""
    from distoptim.ft.replicas import check_manager

    check_manager(manager, owner)
    if group is not None:
        raise ValueError(
            f"{owner}: with a torchft manager the replicas are the manager's quorum, so group "
            f"must be None (got {type_name(group)}); a manager's process group must not also "
            "be given as group="
        )


def _check_group(
    group: Any,
) -> tuple[list[list[int]] | None, dist.ProcessGroup | None]:
    """``(group_assignment, None)``, ``(None, process_group)`` or ``(None, None)``."""
    if group is None:
        return None, None
    distributed = dist.is_available() and dist.is_initialized()
    if isinstance(group, dist.ProcessGroup):
        if not distributed:
            raise ValueError("group is a ProcessGroup but torch.distributed is not initialized")
        return None, group
    if not distributed:
        raise ValueError(
            "group is a group_assignment, which needs an initialized torch.distributed default "
            "group (init_process_group, torchrun or distoptim.launch.spawn)"
        )
    return check_group_assignment(group, dist.get_world_size()), None
