"""CrossShardOptimizer: synchronous data parallelism around any ``torch.optim.Optimizer``.

Owns the user-facing semantics of ``tf.compat.v1.tpu.CrossShardOptimizer``
(``docs/cross_shard.md``): the options, ``step()`` on the PyTorch path, ``synchronize``,
``zero_grad`` and ``finish()``; the TF path's hooks are :mod:`distoptim.sync.tf_path`, the state
dict and the per-rank checkpoints :mod:`distoptim.sync.state` (mixins the class inherits). The
machinery lives one floor down:
:mod:`distoptim.sync.rounds` (the rounds every rank agrees on), :mod:`distoptim.sync.apply`
(how a round's result reaches the parameters: packed ``.grad``, bucket views, or weight-update
sharding), :mod:`distoptim.sync.collectives` (every collective) and :mod:`distoptim.comm`.

The two paths, for ``n = num_shards`` replicas, ``N = backward_passes_per_step`` and local
gradients ``g_r`` (rank ``r``'s gradient of its own, unscaled loss)::

    TF path       compute_gradients -> g_r / n (MEAN, n > 1) or g_r (SUM)
                  apply_gradients   -> sum_r (given grads)            then opt.step()
    PyTorch path  loss.backward() x N; step() -> sum_r sum_passes g_r / (n N)  (MEAN)
                                                sum_r sum_passes g_r           (SUM)
                                                then opt.step()

With ``N = 1`` both paths give the same update: ``mean_r g_r`` (MEAN) or ``sum_r g_r`` (SUM).
MEAN with ``N > 1`` averages over the N micro-batches too, so N backward passes of a mean loss
over micro-batches equal one pass over their concatenation (no manual ``loss / N``).
Scaling happens exactly once per path -- the TF path scales the loss and never divides, the
PyTorch path never touches the loss and divides once -- so mixing the paths, or either of them
with ``zero_grad(set_to_none=...)``, cannot scale twice.

``.grad`` holds this replica's *local* gradient: ``step()`` swaps the reduced gradients in for
the inner ``opt.step()`` only (as ``apply_gradients`` does with its pairs) and puts the local
ones back. (With ``gradient_as_bucket_view=True`` ``.grad`` lives in the buckets and holds the
replica mean of the local gradients after ``step()``; accumulation stays exact, see
:mod:`distoptim.comm.grad_views`.) The reduction is linear, so accumulating across steps without
``zero_grad`` gives on n replicas exactly what it gives on one process over the concatenated
batch, for MEAN and SUM. Edits of ``.grad`` between ``backward()`` and ``step()`` (clipping,
unscaling) act per replica, before the reduction -- TF's per-replica clipping between
``compute_gradients`` and ``apply_gradients``, on the PyTorch path; every rank warns once when
some rank makes one. To edit the *averaged* gradient, as DDP users do after ``backward()``:
``synchronize()`` reduces now and leaves the reduced gradient in ``.grad`` until the next
``step()``, which applies it without reducing again (Horovod's ``synchronize``); or
``max_grad_norm`` clips it by its global norm before every inner step
(:mod:`distoptim.sync.clipping`). A parameter with ``requires_grad=False`` is never updated,
whatever its ``.grad`` holds (torch's optimizers would apply a stale ``.grad``).

A step's way down: ``step()`` -> :meth:`RoundDriver.reduce_grads
<distoptim.sync.rounds.RoundDriver.reduce_grads>` (the agreed round) -> the apply strategy's
``step`` -> the inner ``opt.step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from distoptim import checks
from distoptim.comm.bucket import BucketPlan
from distoptim.comm.guard import DesyncError, RoundKind
from distoptim.comm.stats import CommStats
from distoptim.protocol import WrappedOptimizer, run_closure
from distoptim.sync.apply import ApplyStrategy
from distoptim.sync.collectives import Collectives, Replicas
from distoptim.sync.group_slices import GroupSlices
from distoptim.sync.local_grads import cross_group, replica_ranks
from distoptim.sync.managed_shards import group_of_shards
from distoptim.sync.options import Reduction, SyncOptions
from distoptim.sync.packed import PackedApply, TensorGrads
from distoptim.sync.replicated import ReplicatedRounds
from distoptim.sync.rounds import RoundDriver
from distoptim.sync.sharded import ShardedApply
from distoptim.sync.state import CrossShardState
from distoptim.sync.tf_path import CrossShardTFPath
from distoptim.sync.views import BucketViews, ViewsApply

__all__ = ["CrossShardOptimizer", "DesyncError", "Reduction"]


def _choose_apply(
    options: SyncOptions,
    opt: torch.optim.Optimizer,
    params: Callable[[], list[torch.Tensor]],
    comm: Collectives,
) -> ApplyStrategy:
    """The apply strategy the options ask for (chosen once, at construction)."""
    if options.shard_optimizer_state:
        grads = BucketViews() if options.gradient_as_bucket_view else TensorGrads()
        return ShardedApply(opt, params, options, comm, grads)
    if options.gradient_as_bucket_view:
        return ViewsApply(opt, params, options, comm)
    return PackedApply(opt, params, options, comm)


def _slices_of(replicas: Replicas, shards: Any) -> GroupSlices | None:
    """Full copies in a replica group of several processes: which ``1/k`` of every bucket this
    process averages across the groups (``None``: one process per group, or FSDP2 shards)."""
    if shards is not None or replicas.size < 2:
        return None
    return GroupSlices(replicas.group, replicas.rank, replicas.size)


def _check_managed(manager: Any, options: SyncOptions) -> None:
    """What a torchft manager cannot be combined with (checked before any side effect)."""
    from distoptim.ft.replicas import check_manager

    check_manager(manager, "CrossShardOptimizer")
    if options.shard_optimizer_state:
        raise ValueError(
            "CrossShardOptimizer(manager=..., shard_optimizer_state=True) is refused: each "
            "replica group would hold 1/n of the optimizer state, and a group that dies takes "
            "its shard with it (a healing group would need every peer's shard). Drop one of "
            "the two; to shard the state inside a replica group, shard the model with FSDP2 "
            "(its optimizer state then follows the parameters' shards)"
        )


def _check_groups(
    opt: torch.optim.Optimizer, options: SyncOptions, group: Any, manager: Any
) -> tuple[Any, tuple[int, ...] | None]:
    """``group=`` resolved (a ``DeviceMesh``'s cross-group dimension), and ``DTensor``
    parameters averaged only with their counterparts (checked before any side effect); with
    a manager and ``DTensor`` parameters, also the ranks of the group's shards
    (:mod:`distoptim.sync.managed_shards`)."""
    owner = "CrossShardOptimizer"
    pg = cross_group(owner, group)
    if pg is not None and options.group_assignment is not None:
        raise ValueError(
            f"{owner}: pass group= (the cross-group channel) or group_assignment=, not both"
        )
    if pg is not None and manager is not None:
        raise ValueError(
            f"{owner}: pass group= or manager= (torchft connects the replica groups), not both"
        )
    params = [p for g in opt.param_groups for p in g["params"]]
    shards = None
    if manager is not None:  # the manager pairs each shard with its counterparts
        from distoptim.outer.groups import manager_group_size

        size = manager_group_size(manager)
        shards = checks.check_managed_shards(owner, params, options.group_assignment, size)
    refused = {
        "overlap=True": options.overlap,
        "gradient_as_bucket_view=True": options.gradient_as_bucket_view,
        "shard_optimizer_state=True": options.shard_optimizer_state,
    }
    ranks = None if shards is not None else replica_ranks(options.group_assignment, pg)
    checks.check_cross_group(owner, params, ranks, refused)
    return pg, shards


class CrossShardOptimizer(CrossShardTFPath, CrossShardState, WrappedOptimizer):
    """Reduce gradients across replicas, then run ``opt`` (TF's ``CrossShardOptimizer``).

    Args:
        opt: any ``torch.optim.Optimizer``; it computes the update. Its hyperparameters must
            be finite (a NaN/Inf ``lr``, ``momentum``, ``weight_decay``, ... is a ValueError).
        reduction: ``Reduction.MEAN`` (default) or ``Reduction.SUM`` (or "mean" / "sum").
        name: returned by ``get_name()``.
        group_assignment: ``None`` (all ranks reduce together) or a list of equal-length lists
            (tuples, ranges, numpy arrays) of ranks partitioning ``range(world_size)``; each
            replica then reduces only within its subgroup (real process groups, created
            collectively here on every rank).
        bucket_cap_mb: payload cap of one gradient bucket in MiB (DDP's default, 25).
        overlap: launch each bucket's all-reduce from backward hooks as soon as its last
            gradient is ready; ``step()`` launches the last bucket and waits (see
            :mod:`distoptim.comm.overlap`). Results are those of ``overlap=False`` (up to the
            summation order of >2 ranks), also when ``.grad`` is edited after backward: then
            every rank reduces again, together.
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the wire dtype of float32/float64
            buckets; the reduced result is stored and applied in the parameter dtype.
        backward_passes_per_step: ``N`` backward passes accumulate locally before one reduction;
            call ``step()`` once after every N ``backward()`` calls.
        sequence_guard: check in every round that all ranks are at the same step counter with
            the same number of backward passes since their last ``step()`` (default). Off, a
            skipped or added ``step()``/``backward()`` on some rank goes unnoticed (gradients
            of different iterations are summed) until the ranks' operations differ.
        gradient_as_bucket_view: ``.grad`` of every trainable parameter lives in its bucket
            (:mod:`distoptim.comm.grad_views`): backward accumulates into the bucket, the
            reduction packs nothing and runs in place, ``zero_grad()`` zeroes the buckets and
            keeps the views (``.grad`` is never None after it). After ``step()``, ``.grad``
            holds the replica mean of the accumulated local gradients (the same on every
            rank; accumulating onto it is exact) instead of this replica's own. With
            ``overlap=True`` the buckets launched during backward reduce a copy (one pass,
            a second buffer per bucket), so ``.grad`` may be read and edited until ``step()``
            exactly as without views.
        shard_optimizer_state: weight-update sharding (Xu et al. 2020; ZeRO stage 1, see
            :mod:`distoptim.sync.sharded`): the flat buckets are reduce-scattered,
            ``opt`` updates only this rank's ``1/n`` of every bucket and keeps its state for
            that slice only, and the updated parameters are all-gathered. ``opt`` must be
            element-wise (SGD, Adam, AdamW, ... or a class marked with
            :func:`~distoptim.elementwise_rule.elementwise`); ``.grad`` keeps the local
            gradient (also with bucket views). The parameters' storage moves into flat
            buffers at the first step. ``consolidate_state_dict()`` (then ``state_dict()``,
            local, on the rank it consolidated to), ``get_slot()``, ``get_slot_names()`` and
            ``variables()`` gather the full per-parameter state: collectives, call them on
            every rank (a call on some ranks only is a ``DesyncError`` on every rank
            involved). The state dict has the unsharded format (either loads into either);
            :meth:`save_sharded` / :meth:`load_sharded` write and read each rank's own part
            instead, through ``torch.distributed.checkpoint``, resharding on load.
        max_grad_norm: ``None`` (default) or ``c > 0``: before every inner step, clip the
            *reduced* gradient to a global L2 norm of at most ``c``
            (``torch.nn.utils.clip_grad_norm_``'s rule; bitwise DDP's ``backward();
            clip_grad_norm_(params, c); step()``; with ``shard_optimizer_state`` the norm is
            summed over the shards with one scalar all-reduce; with ``DTensor`` parameters
            ``clip_grad_norm_`` sums the norm over the group's shards, as under torch's HSDP).
        group: ``None`` or the cross-group channel instead of ``group_assignment``: a
            ``ProcessGroup`` or a ``DeviceMesh`` (a 1-D mesh, or the dimension named
            ``"replicate"`` / ``"dp_replicate"`` of a mesh of several). With a model sharded
            inside each replica group (``fully_shard(model, mesh=mesh["shard"])``, parameters
            ``DTensor``s: HSDP) it must hold this process and its counterpart in every other
            group only: each process averages its local shard's gradient with theirs, ``1/k``
            of the bytes of an unsharded group (:mod:`distoptim.sync.local_grads`). A channel
            holding another process of this process's own group is a ``ValueError``; so are
            ``DTensor`` parameters with ``overlap``, ``gradient_as_bucket_view`` or
            ``shard_optimizer_state`` (not supported yet). With a torchft ``manager=``
            instead (one per process, the group's replica id, its group rank,
            ``world_size`` = the processes the model is sharded over: torchtitan + torchft's
            HSDP), the manager is the channel: each process averages its shard with
            its counterparts, and every commit checks the group's combined state checksum
            (:mod:`distoptim.sync.managed_shards`).

    Collectives are bucketed (see :mod:`distoptim.comm.bucket`). A parameter whose gradient is
    None on some ranks is zero-filled there; one with no gradient on any rank keeps ``None``.
    Before its first gradient collective the optimizer checks, with one small all-gather, that
    every rank of its group has the same parameter list and options; afterwards every round
    carries each rank's sequence words, so a change of the parameter list on some ranks, or
    ranks out of step, raise :class:`~distoptim.comm.guard.ParameterMismatchError` /
    :class:`~distoptim.comm.guard.DesyncError` on every rank (see :mod:`distoptim.comm.guard`).
    Collective waits are bounded by the process group's timeout; a peer that leaves the group
    ends the wait at once with a ``DesyncError`` saying so. Outside an initialized process
    group, or with world size 1, it warns once and behaves as one shard (a plain ``opt`` with
    the TF methods).
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        reduction: Reduction | str = Reduction.MEAN,
        name: str = "CrossShardOptimizer",
        group_assignment: Sequence[Sequence[int]] | None = None,
        *,
        bucket_cap_mb: float = 25,
        overlap: bool = False,
        compression: str | None = None,
        backward_passes_per_step: int = 1,
        sequence_guard: bool = True,
        gradient_as_bucket_view: bool = False,
        shard_optimizer_state: bool = False,
        max_grad_norm: float | None = None,
        manager: Any = None,
        group: Any = None,
    ) -> None:
        # validate everything before any side effect (subgroup creation is collective)
        options = SyncOptions.check(
            opt,
            reduction,
            name,
            group_assignment,
            Replicas.world_size(),
            bucket_cap_mb=bucket_cap_mb,
            overlap=overlap,
            compression=compression,
            backward_passes_per_step=backward_passes_per_step,
            sequence_guard=sequence_guard,
            gradient_as_bucket_view=gradient_as_bucket_view,
            shard_optimizer_state=shard_optimizer_state,
            max_grad_norm=max_grad_norm,
        )
        if manager is not None:
            _check_managed(manager, options)
        pg, shards = _check_groups(opt, options, group, manager)
        replicas = Replicas.join(
            options.group_assignment,
            stacklevel=2,
            quiet=manager is not None,
            pg=pg,
            solo=shards is not None,
        )
        super().__init__(opt, name=name)
        self._options = options
        comm = Collectives(replicas, options.wire, CommStats())
        self._apply = _choose_apply(options, opt, self._all_params, comm)
        self._applying_pairs = False
        self._consolidated = None  # consolidate_state_dict()'s state, until the next step
        self._rounds = RoundDriver(
            self._all_params,
            lambda: self.iterations,
            options,
            comm,
            self._apply,
            inner=opt,
        )
        self._replicated: ReplicatedRounds | None = None
        if manager is not None:
            self._replicated = ReplicatedRounds(
                manager,
                name,
                self._all_params,
                opt,
                options.reduction is Reduction.MEAN,
                options.wire,
                comm.stats,
                within=group_of_shards(shards),
                slices=_slices_of(replicas, shards),
            )
            self._replicated.replicas.register_state(
                "counters", lambda: {"iterations": self.iterations}, self._load_counters
            )

    # ---- the options, read-only ----------------------------------------------------------
    @property
    def reduction(self) -> Reduction:
        return self._options.reduction

    @property
    def group_assignment(self) -> list[list[int]] | None:
        return self._options.group_assignment

    @property
    def bucket_cap_mb(self) -> float:
        return self._options.bucket_cap_mb

    @property
    def overlap(self) -> bool:
        """Whether backward hooks launch the reduction (False after :meth:`remove_hooks`)."""
        return self._rounds.overlapping

    @property
    def compression(self) -> str | None:
        return self._options.wire.name

    @property
    def backward_passes_per_step(self) -> int:
        return self._options.backward_passes_per_step

    @property
    def sequence_guard(self) -> bool:
        return self._options.sequence_guard

    @property
    def gradient_as_bucket_view(self) -> bool:
        return self._options.gradient_as_bucket_view

    @property
    def shard_optimizer_state(self) -> bool:
        return self._options.shard_optimizer_state

    @property
    def max_grad_norm(self) -> float | None:
        return self._options.max_grad_norm

    # ---- public read-only facts --------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Replicas whose gradients are combined: the (sub)group size, 1 outside a group."""
        return self._rounds.size

    @property
    def comm_stats(self) -> CommStats:
        """Collectives launched and bytes this rank sent so far (see :class:`CommStats`)."""
        return self._rounds.stats

    @property
    def bucket_plan(self) -> BucketPlan:
        """The current bucket layout (trainable parameters, ready order)."""
        return self._rounds.plan

    # ---- hooks and the parameter list ----------------------------------------------------------
    def remove_hooks(self) -> None:
        """Detach every backward hook (before dropping the optimizer but keeping the model).

        A round that backward already launched is closed first (one round of collectives:
        call this on every rank, as ``step()``).
        """
        self._rounds.remove_hooks()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its hyperparameters must be finite.

        The new parameters join the reduction once every rank of the group has added them
        (the next round agrees on the new parameter list, or raises ``ParameterMismatchError``
        on every rank if only some ranks changed).
        """
        super().add_param_group(param_group)
        if "_rounds" in self.__dict__:  # not during torch.optim.Optimizer.__init__
            try:
                checks.check_finite_hyperparameters(self._wrapped, "CrossShardOptimizer")
            except ValueError:
                self._wrapped.param_groups.pop()  # leave the optimizer as it was
                raise
            self._rounds.refresh()

    # ---- PyTorch path: backward(); step() ----------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the local ``.grad`` across the group, apply it with ``opt``, count one step.

        The reduced gradient is put in ``.grad`` only while ``opt.step()`` runs; afterwards
        ``.grad`` holds this replica's local gradient again, so accumulating without
        ``zero_grad`` continues exactly as it would on one process (for MEAN and SUM alike).
        With ``overlap=True`` the round launched during backward is used unless ``.grad``
        changed since on some rank: then every rank reduces ``.grad`` again (one-time warning).
        Raises ``DesyncError`` on every rank, with nothing applied, when the ranks' rounds do
        not belong together (see :mod:`distoptim.comm.guard`).
        """
        if self._applying_pairs:  # TF path: the swapped-in grads are already reduced
            return super().step(closure)
        self._consolidated = None  # the state it gathered is about to change
        loss = run_closure(closure)
        if self._replicated is not None:
            self._managed_step()
            return loss
        rounds = self._rounds
        if self._apply.held is not None:  # synchronize() reduced this step's gradients
            if rounds.passes_since_reduce():
                self._apply.drop()
                raise RuntimeError(
                    "CrossShardOptimizer: backward() ran between synchronize() and step(): its "
                    "gradient was added to the reduced one and never reduced, so the replicas "
                    "would drift apart. Call synchronize() after the step's last backward()."
                )
            self._apply.release()
            if rounds.size > 1:
                rounds.end_step()
        elif rounds.size == 1:
            rounds.refresh()
            self._apply.solo_step(rounds)
        else:
            rnd, buffers = rounds.reduce_grads()
            self._apply.step(rnd, buffers)
            rounds.end_step()
        self.iterations += 1
        return loss

    def synchronize(self) -> None:
        """Reduce ``.grad`` across the group now; the next ``step()`` applies it without
        reducing again (Horovod's ``synchronize``, DDP's state after ``backward()``).

        Until that ``step()``, ``.grad`` holds the reduced gradient (MEAN: ``sum_r sum_passes
        g_r / (n N)``; parameters no rank had a gradient for: None), identical on every rank:
        clip or unscale *it* -- ``backward(); opt.synchronize(); clip_grad_norm_(params, c);
        opt.step()`` is DDP's ``backward(); clip_grad_norm_(params, c); opt.step()`` bit for
        bit. Edits must then be the same on every rank (they act on identical gradients).
        After the ``step()``, ``.grad`` is what a ``step()`` leaves (the local gradient; with
        bucket views the replica mean). A second call before ``step()`` does nothing;
        ``zero_grad()`` forgets the reduced gradient; a ``backward()`` before the ``step()`` is
        an error at the ``step()``. A collective round like ``step()``'s (call it on every
        rank: a rank calling ``step()`` directly meanwhile is a ``DesyncError``). Not available
        with ``shard_optimizer_state=True`` (each rank receives only its ``1/n`` of the reduced
        gradient): use ``max_grad_norm`` there.
        """
        if self._apply.held is not None:
            return
        if self._replicated is not None:
            raise ValueError(
                "CrossShardOptimizer(manager=...).synchronize() is refused: a managed step "
                "reduces and commits (or not) in one torchft round, inside step(); to clip the "
                "averaged gradient, pass max_grad_norm="
            )
        if self._options.shard_optimizer_state:
            raise TypeError(
                "CrossShardOptimizer.synchronize() is not available with "
                "shard_optimizer_state=True: each rank receives only its 1/n of the reduced "
                "gradient, never all of it in .grad. To clip the averaged gradient by its norm, "
                "pass max_grad_norm= (computed across the shards)."
            )
        rounds = self._rounds
        if rounds.size == 1:
            rounds.refresh()
            self._apply.hold_solo(rounds)
        else:
            rnd, buffers = rounds.reduce_grads(RoundKind.SYNC)
            self._apply.hold(rnd, buffers)

    def _managed_step(self) -> None:
        """A step as one torchft round: the replica group's round, then the replicas', then
        the inner step only if the round commits (see :mod:`distoptim.sync.replicated`)."""
        replicated = self._replicated
        assert replicated is not None
        rounds = self._rounds
        if rounds.size == 1:  # one process per replica group: pack (and divide passes) locally
            rounds.refresh()
            rnd = rounds.grad_round(rounds.solo_plan())
            buffers = rnd.wait_all()
        else:
            rnd, buffers = rounds.reduce_grads()
        kind = RoundKind.STEP
        if not replicated.reduce_and_commit(rnd, buffers, kind, self.iterations, rounds.plan_word):
            return
        self._apply.step(rnd, buffers)
        if rounds.size > 1:
            rounds.end_step()
        self.iterations += 1

    def _load_counters(self, state: dict[str, int]) -> None:
        """A healing replica takes its peer's step counter (with its parameters and state)."""
        self.iterations = int(state["iterations"])

    @property
    def replica_stats(self) -> Any:
        """With a torchft manager: rounds, commits, failed rounds, heals (else None)."""
        return None if self._replicated is None else self._replicated.replicas.stats

    def finish(self) -> None:
        """Say that this rank takes no more steps; raise if some rank of the group still does.

        One round of the agreed bucket collectives (zeros) whose words carry ``finish()`` and
        the step counter: called on every rank at the end of training (or of an epoch), it
        returns quietly when every rank took the same steps, and raises ``DesyncError`` on
        every rank when some rank skipped or added a ``step()`` -- the peers are then in a
        ``step()`` round (or another ``finish()`` count) and get the same error, instead of
        waiting for a collective this rank never enters. A no-op on one shard.
        """
        if self._rounds.size > 1:
            self._rounds.finish()
        if self._replicated is not None:
            self._replicated.reduce_and_commit(
                None, [], RoundKind.FINISH, self.iterations, self._rounds.plan_word
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``; with bucket views, zero the buckets in place.

        With ``gradient_as_bucket_view=True`` every parameter of the agreed plan gets its
        zeroed bucket slot as ``.grad`` (never None), for either ``set_to_none``; whether a
        parameter then has a gradient is tracked exactly as before (see
        :mod:`distoptim.comm.grad_views`). Other parameters follow torch.
        """
        self._apply.drop()  # a gradient synchronize() reduced is forgotten
        if self._replicated is not None:  # the quorum forms during the forward pass
            self._replicated.start(early=True)
        if self._apply.grads.zero(self._all_params(), set_to_none):
            self._rounds.note_zeroed()  # an in-place reduction in flight read other values
        else:
            super().zero_grad(set_to_none)

    def __repr__(self) -> str:
        return (
            f"CrossShardOptimizer({self.wrapped!r}, reduction={self.reduction.value!r}, "
            f"num_shards={self.num_shards}, overlap={self.overlap}, "
            f"compression={self.compression!r}, "
            f"backward_passes_per_step={self.backward_passes_per_step}, "
            f"sequence_guard={self.sequence_guard}, "
            f"gradient_as_bucket_view={self.gradient_as_bucket_view}, "
            f"shard_optimizer_state={self.shard_optimizer_state}, "
            f"max_grad_norm={self.max_grad_norm})"
        )
