"""DiLoCo and Streaming DiLoCo: local inner steps, outer steps on averaged pseudo-gradients.

Owns the user-facing semantics of the synchronous outer-optimizer family (``docs/diloco.md``):
argument validation, the (sub)group of replicas, the sync schedule, how the outer optimizer --
built by the user over the *model's* parameters -- is applied to the global copy, the mixing of
local and global values, how a run ends (:meth:`DiLoCo.finish`: the final sync of every
fragment), what every replica does with a sync refused for a non-finite pseudo-gradient, a
collective that fails because a peer left, and checkpoints. What travels, and in which wire
format, is :mod:`distoptim.outer.exchange`; which parameters sync when is
:mod:`distoptim.outer.fragments`; what the replicas agree on before a sync is
:mod:`distoptim.outer.agreement`; what a checkpoint must hold is :mod:`distoptim.outer.checkpoint`;
the argument checks are :mod:`distoptim.outer.arguments`; replica groups of several processes
(DTensor parameters averaged by local shard, ``model=``, a ``DeviceMesh`` as ``group=``) are
:mod:`distoptim.outer.groups` (``docs/groups.md``); the read-only properties
:mod:`distoptim.outer.facts`.

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
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import (
    type_name,
)
from distoptim.comm.channel import Channel, GroupChannel
from distoptim.comm.groups import comm_device
from distoptim.comm.guard import DesyncError, RoundKind
from distoptim.comm.stats import CommStats
from distoptim.ft import inject
from distoptim.outer.agreement import (
    HeaderVerdict,
    NonFiniteSyncError,
    ReplicaIdentity,
    SyncAgreement,
)
from distoptim.outer.arguments import DiLoCoArguments, check_arguments
from distoptim.outer.exchange import FragmentExchange
from distoptim.outer.facts import DiLoCoFacts, GlobalParameters
from distoptim.outer.fragments import Fragment, FragmentSchedule
from distoptim.outer.groups import combine_checksums, like_param, local_view, within_group
from distoptim.outer.managed import ManagedDiLoCo, ManagedSyncs
from distoptim.outer.sharded_state import DiLoCoShardedState
from distoptim.outer.state import DiLoCoState, PendingSync
from distoptim.protocol import WrappedOptimizer, swapped_grads

__all__ = ["DiLoCo", "GlobalParameters"]

_MIB = 1 << 20


class DiLoCo(ManagedDiLoCo, DiLoCoFacts, DiLoCoState, DiLoCoShardedState, WrappedOptimizer):
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
            subgroup runs its own DiLoCo), an existing ``ProcessGroup``, or a ``DeviceMesh``
            (a 1-D mesh, or the dimension named ``"replicate"`` / ``"dp_replicate"`` of a mesh
            of several). With replica groups of several processes it is the cross-group
            channel: this process and its counterparts in the other groups (``docs/groups.md``).
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
        model: (keyword only) the ``DistributedDataParallel`` module that keeps a replica group
            of several processes one model (FSDP2 / tensor-parallel models say so through their
            DTensor parameters, a ``CrossShardOptimizer`` inner through itself). A group that
            cannot be one model fails here (:mod:`distoptim.outer.groups`). DTensor parameters
            average their local shards: the global copy, outer state and residuals are shards.

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
    ``save_sharded()`` / ``load_sharded()`` (``sharded_state_dict()`` for ``dcp.save``) are
    the DCP format that reshards to another number of processes per replica group
    (:mod:`distoptim.outer.sharded_state`, ``docs/groups.md``); collectives (under a torchft
    manager over one replica group's processes: each group saves its own).
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
        group: Sequence[Sequence[int]] | dist.ProcessGroup | Any | None = None,
        name: str = "DiLoCo",
        *,
        error_feedback: bool = True,
        bucket_cap_mb: float = 25,
        manager: Any = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        # -- validate everything before any side effect (subgroup creation is collective) --
        owner = name if isinstance(name, str) else type(self).__name__
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type_name(name)}")
        args = check_arguments(
            owner, inner, outer, group, manager, model, sync_every=sync_every,
            fragments=fragments, fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha, wire=wire,
            error_feedback=error_feedback, bucket_cap_mb=bucket_cap_mb,
        )  # fmt: skip

        # -- side effects --
        group_obj, group_size = args.group, 0 if manager is not None else 1  # 0: the quorum's
        if args.assignment is not None:
            group_obj, _ = dist.new_subgroups_by_enumeration(args.assignment)
        if group_obj is not None:
            group_size = dist.get_world_size(group_obj)
        elif manager is None and dist.is_available() and dist.is_initialized():
            group_size = dist.get_world_size()
        super().__init__(inner, name=name)
        self._outer = outer
        self.sync_every = args.sync_every
        self.fragments = args.fragments
        self.fragment_sync_delay = args.delay
        self.fragment_update_alpha = args.alpha
        self.wire = args.wire.name
        self.error_feedback = args.error_feedback
        self.bucket_cap_mb = args.cap_mb
        self.group_assignment = args.assignment
        self.layout = args.layout
        self._group = group_obj
        self._group_size = group_size
        self._channel: Channel = GroupChannel(group_obj, max(group_size, 1))
        self._params = args.params
        self._stats = CommStats()
        self._build(args, manager)

    def _build(self, args: DiLoCoArguments, manager: Any) -> None:
        """The global copy (local shards), the fragments, their exchanges, header and torchft
        side, and the counters."""
        params, name = self._params, self._name
        with torch.no_grad():
            self._global = [local_view(p).detach().clone() for p in params]
        # fragments by the parameters' global sizes: the same on every process of every group
        self._schedule = FragmentSchedule(
            [p.numel() * p.element_size() for p in params],
            args.fragments,
            args.sync_every,
            args.delay,
        )
        self._exchanges = [
            FragmentExchange(
                params[f.start : f.stop],
                self._global[f.start : f.stop],
                args.wire,
                self._channel,
                self._stats,
                args.error_feedback,
                cap_bytes=max(1, int(args.cap_mb * _MIB)),
                keep_payload=args.delay > 0,
            )
            for f in self._schedule.fragments
        ]
        self._agreement: SyncAgreement | None = None
        if self._group_size > 1 or manager is not None:
            device = comm_device(self._group) if manager is None else torch.device("cpu")
            self._agreement = SyncAgreement(
                self._channel, self._stats, device, name, odd_one_out=manager is not None
            )
        self._managed: ManagedSyncs | None = None
        # a torchft replica group of several processes: its header's state checksum combines
        # every process's (a group whose processes differ is refused as a whole)
        self._within = within_group(args.layout) if manager is not None else None
        if manager is not None:
            self._managed = ManagedSyncs(manager, name)
            self._managed.register(self._heal_state, self._load_heal_state)
        # what every header says about this replica: parameters, options, optimizers
        self._identity = ReplicaIdentity(
            type(self).__name__, params, self._config(), self.wrapped, self._outer
        )
        self._in_flight: PendingSync | None = None
        self._syncs = 0
        self._refused_syncs = 0
        self._refused: list[str] = []  # refusals not raised yet (raised at the end of the call)
        # per fragment, the step after which its local values were its global copy (they are
        # "synced" iff that is the current step); the step at which finish() or a refusal last
        # closed the sync the schedule had in flight
        self._synced_at = [0] * len(self._schedule)
        self._closed_at = -1
        self._joining = False  # join(): the next step launches a sync whatever its counter
        self._warned_between_syncs = False
        self._step_being_loaded: int | None = None
        self._built = True

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

    def join(self) -> None:
        """This replica joins a running job (a restarted or spare replica group): its next
        :meth:`step` launches a sync at once, whatever its step counter says, so it heals from
        a peer at the others' next sync -- and adopts their step and fragment there -- instead
        of after ``H`` inner steps of its own, which the heal would overwrite and the others
        would wait for (the lighthouse holds their quorum for a replica that heartbeats but has
        not asked yet). Needs a torchft manager; call it before the first ``step()``. A replica
        that turns out not to be behind (the job had not started) has that sync voided, and
        catches up on the schedule as any straggler.
        """
        if self._managed is None:
            raise ValueError(
                f"{self._name}.join() needs a torchft manager: without one a sync at another "
                "step than the group's desynchronises it"
            )
        if self.iterations != 0:
            raise ValueError(
                f"{self._name}.join() is for a replica that has not stepped yet; this one is at "
                f"step {self.iterations}"
            )
        self._joining = True

    def _after_inner_step(self) -> None:
        """After inner step ``t``: apply the sync due at ``t``, launch the fragment due at ``t``
        (or the first fragment, on a replica that joins: :meth:`join`)."""
        t = self.iterations + 1
        sync = self._in_flight
        if sync is not None and sync.launched_at + self.fragment_sync_delay == t:
            self._in_flight = None
            self._apply(sync, t, self.fragment_update_alpha)
        fragment = self._schedule.launching_at(t)
        if fragment is None and self._joining:
            fragment = self._schedule.fragments[0]  # it adopts the others' in the header
        self._joining = False
        if fragment is None:
            return
        sync = self._launch(fragment, t, RoundKind.STEP)
        if sync is None:  # refused: nothing in flight until the next launch
            self._closed_at = t
        elif self.fragment_sync_delay == 0:
            # at the sync's own step: a healing replica adopted the contributors' step in the
            # launch, so its local ``t`` may be another
            self._apply(sync, sync.launched_at, self.fragment_update_alpha)
        else:
            self._in_flight = sync
            if inject.ARMED:
                inject.hit("in_flight", self._role())

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
        if inject.ARMED:
            inject.hit("finish", self._role())
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
        if self._refused:
            what, self._refused = "; ".join(self._refused), []
            raise _refused_error(self._name, what)

    def _peer_guard(self, what: str, t: int) -> contextlib.AbstractContextManager[None]:
        """A collective that fails because a peer left becomes a ``DesyncError`` saying so."""
        return _peer_guard(self._name, self._channel, what, t)

    def _apply(self, sync: PendingSync, t: int, alpha: float, header: bool = True) -> None:
        """The outer step of one fragment on the global copy, then the local mix (see module).

        ``header``: agree first when the mean still runs a collective (phase 2) after inner
        steps in flight; ``finish()`` has agreed already. Whether that header goes is decided
        from what every replica agreed on (the wire and ``τ``, in the plan fingerprint), never
        from a local step counter: a healing replica issues exactly the contributors'
        collectives.
        """
        exchange = self._exchanges[sync.fragment.index]
        # a managed round whose peer died leaves garbage in the buffers: it will not commit
        void = ""
        if sync.flight is not None and not self._channel.failed:
            if header and exchange.finishes_with_collective and self.fragment_sync_delay > 0:
                healing = self._managed is not None and self._managed.healing
                # e.g. phase 2 of a two-phase mean
                void = self._agree(RoundKind.STEP, t, sync.fragment, healing=healing).void
                if void and self._managed is not None:  # e.g. a replica refused: not applied
                    self._managed.fail(void)
            if not void:
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
            params = self._fragment_params(sync.fragment)
            grads = [like_param(m, p) for m, p in zip(mean, params)]  # DTensor: its local mean
            with swapped_grads(self._params, list(zip(grads, params))):
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
        state = (0, 1, 0)
        if self._managed is not None:  # the state word compares the copy: no float64 sums
            part, parts, word = self._state_word(kind, t, fragment)
            if self._within is not None:  # the group's: every process's checksum, in order
                word = combine_checksums(word, self._within, self._name, t)
            state, copy = (part, parts, word), []
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
        } | self.layout.options(self._global)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.wrapped!r}, outer={self._outer!r}, "
            f"sync_every={self.sync_every}, fragments={self.fragments}, "
            f"fragment_sync_delay={self.fragment_sync_delay}, "
            f"fragment_update_alpha={self.fragment_update_alpha}, wire={self.wire!r}, "
            f"num_replicas={self._group_size})"
        )


def _refused_error(name: str, what: str) -> NonFiniteSyncError:
    return NonFiniteSyncError(
        f"{name}: refused on every replica: {what}. No outer step was taken: the "
        "global copy is unchanged and every replica's parameters of the fragment were reset "
        "to it (the inner optimizers' states were not). The replicas are still in step and "
        "training can go on (catch NonFiniteSyncError), but look for the cause first: a "
        "learning rate too large, an fp16/bf16 overflow, a NaN loss on that replica's data."
    )


@contextlib.contextmanager
def _peer_guard(name: str, channel: Channel, what: str, t: int) -> Iterator[None]:
    """A collective over ``channel`` that fails because a peer left: a ``DesyncError`` naming
    this rank, what failed at which step, and the likely causes."""
    try:
        yield
    except (DesyncError, torch.OutOfMemoryError):
        raise
    except RuntimeError as exc:
        rank = channel.ranks[channel.rank]
        raise DesyncError(
            f"{name}: rank {rank}: {what} of step {t} failed while waiting for the "
            "other replicas: a replica stopped taking part in this group's syncs. Its "
            "training loop ended before this sync without finish() -- call opt.finish() on "
            "every replica when training ends, so that a replica that stops early fails the "
            "others at once, by name -- or it took fewer step() calls, raised (its own error "
            f"is the real cause) or crashed.\n(the collective said: {type(exc).__name__}: "
            f"{str(exc).strip()})"
        ) from exc
