"""CrossShardOptimizer: synchronous data parallelism around any ``torch.optim.Optimizer``.

Owns the user-facing semantics of ``tf.compat.v1.tpu.CrossShardOptimizer``
(``docs/cross_shard.md``): argument validation, the (sub)group a replica reduces with, loss
scaling on the TF path, the divisor on the PyTorch path, and the glue from ``.grad`` /
``(grad, var)`` pairs to the communication machinery in :mod:`distoptim.comm` (buckets, async
all-reduce rounds, overlap hooks, wire compression, the parameter-list fingerprint).

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

``.grad`` always holds this replica's *local* gradient: ``step()`` swaps the reduced gradients
in for the inner ``opt.step()`` only (as ``apply_gradients`` does with its pairs) and puts the
local ones back. The reduction is linear, so accumulating across steps without ``zero_grad``
gives on n replicas exactly what it gives on one process over the concatenated batch, for MEAN
and SUM. Edits of ``.grad`` between ``backward()`` and ``step()`` (clipping, unscaling) act per
replica, before the reduction -- TF's per-replica clipping between ``compute_gradients`` and
``apply_gradients``, on the PyTorch path.
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.fingerprint import MESSAGE_BYTES, check_agreement
from distoptim.comm.overlap import BackwardOverlap
from distoptim.comm.reducer import BucketAllReduce, ReduceRound
from distoptim.comm.stats import CommStats
from distoptim.protocol import GradsAndVars, WrappedOptimizer, run_closure, swapped_grads

__all__ = ["CrossShardOptimizer", "Reduction"]

_MIB = 1 << 20
_FIRST_BUCKET_BYTES = 1 * _MIB  # DDP's dist._DEFAULT_FIRST_BUCKET_BYTES


class Reduction(str, enum.Enum):
    """How replica gradients combine: ``MEAN`` (average over replicas) or ``SUM``."""

    MEAN = "mean"
    SUM = "sum"

    @classmethod
    def parse(cls, value: object) -> Reduction:
        """A :class:`Reduction`, or the strings ``"mean"`` / ``"sum"`` (any case)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.lower() in ("mean", "sum"):
            return cls(value.lower())
        raise ValueError(
            f"unknown reduction {value!r}: allowed values are Reduction.MEAN, Reduction.SUM, "
            "'mean', 'sum'"
        )


def _check_group_assignment(value: object, world_size: int | None) -> list[list[int]] | None:
    """Validate ``group_assignment`` (TF's ``tpu.cross_replica_sum`` rules: equal-size groups
    partitioning ``range(world_size)``); ``world_size=None``: form only."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(
            "group_assignment must be a non-empty list of lists of ranks, e.g. [[0, 1], [2, 3]]; "
            f"got {value!r}"
        )
    groups: list[list[int]] = []
    for i, g in enumerate(value):
        if not isinstance(g, (list, tuple)) or not g:
            raise ValueError(
                f"group_assignment must be a list of non-empty lists; entry {i} is {g!r}"
            )
        for r in g:
            if not isinstance(r, int) or isinstance(r, bool):
                raise ValueError(f"group_assignment[{i}] must hold int ranks, got {r!r}")
        groups.append(list(g))
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"group_assignment subgroups must all have the same size, got sizes "
            f"{[len(g) for g in groups]}"
        )
    flat = [r for g in groups for r in g]
    dupes = sorted({r for r in flat if flat.count(r) > 1})
    if dupes:
        raise ValueError(f"group_assignment lists rank(s) {dupes} more than once")
    expected = world_size if world_size is not None else len(flat)
    bad = sorted(r for r in flat if r < 0 or r >= expected)
    if bad:
        raise ValueError(f"group_assignment has rank(s) {bad} outside range(world_size={expected})")
    missing = sorted(set(range(expected)) - set(flat))
    if missing:
        raise ValueError(
            f"group_assignment must cover every rank of range(world_size={expected}); "
            f"missing {missing}"
        )
    return groups


def _check_options(
    name: object, bucket_cap_mb: object, overlap: object, backward_passes_per_step: object
) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if (
        not isinstance(bucket_cap_mb, (int, float))
        or isinstance(bucket_cap_mb, bool)
        or not math.isfinite(bucket_cap_mb)
        or bucket_cap_mb <= 0
    ):
        raise ValueError(f"bucket_cap_mb must be a finite number > 0 (MiB), got {bucket_cap_mb!r}")
    if not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True or False, got {overlap!r}")
    if (
        not isinstance(backward_passes_per_step, int)
        or isinstance(backward_passes_per_step, bool)
        or backward_passes_per_step < 1
    ):
        raise ValueError(
            f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}"
        )


class CrossShardOptimizer(WrappedOptimizer):
    """Reduce gradients across replicas, then run ``opt`` (TF's ``CrossShardOptimizer``).

    Args:
        opt: any ``torch.optim.Optimizer``; it computes the update.
        reduction: ``Reduction.MEAN`` (default) or ``Reduction.SUM`` (or "mean" / "sum").
        name: returned by ``get_name()``.
        group_assignment: ``None`` (all ranks reduce together) or a list of equal-length lists
            of ranks partitioning ``range(world_size)``; each replica then reduces only within
            its subgroup (real process groups, created collectively here on every rank).
        bucket_cap_mb: payload cap of one gradient bucket in MiB (DDP's default, 25).
        overlap: launch each bucket's all-reduce from backward hooks as soon as its last
            gradient is ready; ``step()`` then only waits (see :mod:`distoptim.comm.overlap`).
            Results are those of ``overlap=False`` (up to the summation order of >2 ranks).
        compression: ``None``, ``"fp16"`` or ``"bf16"``: the wire dtype of float32/float64
            buckets; the reduced result is stored and applied in the parameter dtype.
        backward_passes_per_step: ``N`` backward passes accumulate locally before one reduction;
            call ``step()`` once after every N ``backward()`` calls.

    Collectives are bucketed (see :mod:`distoptim.comm.bucket`). A parameter whose gradient is
    None on some ranks is zero-filled there; one with no gradient on any rank keeps ``None``.
    Before its first gradient collective the optimizer checks, with one small all-gather, that
    every rank of its group has the same parameter list and options
    (:class:`~distoptim.comm.fingerprint.ParameterMismatchError` otherwise). Collective waits are
    bounded by the process group's timeout. Outside an initialized process group, or with
    world size 1, it warns once and behaves as one shard (a plain ``opt`` with the TF methods).
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
    ) -> None:
        # -- validate everything before any side effect (subgroup creation is collective) --
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"CrossShardOptimizer wraps a torch.optim.Optimizer, got {type(opt).__name__}"
            )
        red = Reduction.parse(reduction)
        _check_options(name, bucket_cap_mb, overlap, backward_passes_per_step)
        wire = WireFormat.parse(compression)
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        groups = _check_group_assignment(group_assignment, world if distributed else None)

        group: dist.ProcessGroup | None = None
        num_shards = world
        if world == 1:
            warnings.warn(
                "CrossShardOptimizer: "
                + (
                    "the default process group has world size 1"
                    if distributed
                    else "torch.distributed is not initialized"
                )
                + "; behaving as one shard (gradients are not reduced)",
                UserWarning,
                stacklevel=2,
            )
            num_shards = 1
        elif groups is not None:
            group, _ = dist.new_subgroups_by_enumeration(groups)
            num_shards = len(groups[0])

        super().__init__(opt, name=name)
        self.reduction = red
        self.group_assignment = groups
        self.bucket_cap_mb = bucket_cap_mb
        self.overlap = overlap
        self.compression = wire.name
        self.backward_passes_per_step = backward_passes_per_step
        self._group = group
        self._num_shards = num_shards
        self._stats = CommStats()
        self._reducer = BucketAllReduce(group, num_shards, wire, self._stats)
        self._applying_pairs = False
        self._warned_stale = False
        self._agreed = num_shards == 1
        self._plan_key: tuple[tuple[int, bool], ...] = ()
        self._plan: BucketPlan = BucketPlan([], 1)
        self._index_of: dict[int, int] = {}
        self._overlap: BackwardOverlap | None = None
        self._order_synced = False
        self._refresh_plan()

    # ---- public read-only facts --------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        """Replicas whose gradients are combined: the (sub)group size, 1 outside a group."""
        return self._num_shards

    @property
    def comm_stats(self) -> CommStats:
        """Collectives launched and bytes this rank sent so far (see :class:`CommStats`)."""
        return self._stats

    @property
    def bucket_plan(self) -> BucketPlan:
        """The current bucket layout (trainable parameters, ready order)."""
        return self._plan

    def remove_hooks(self) -> None:
        """Detach the overlap hooks (before dropping the optimizer but keeping the model)."""
        if self._overlap is not None:
            self._overlap.reset()
            self._overlap.detach()
            self._overlap = None
        self.overlap = False

    # ---- the bucket plan follows the parameter list ------------------------------------------
    def _current_key(self) -> tuple[tuple[int, bool], ...]:
        return tuple((id(p), p.requires_grad) for p in self._all_params())

    def _refresh_plan(self) -> None:
        """Rebuild buckets (and hooks) if parameters were added or requires_grad changed."""
        key = self._current_key()
        if key == self._plan_key:
            return
        params = [p for p in self._all_params() if p.requires_grad]
        self._install_plan(params, order=None)
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self._plan_key = key
        self._agreed = self._num_shards == 1
        self._order_synced = False

    def _install_plan(self, params: list[torch.Tensor], order: list[int] | None) -> None:
        if self._overlap is not None:
            self._overlap.reset()
            self._overlap.detach()
            self._overlap = None
        self._plan = BucketPlan(
            params,
            cap_bytes=max(1, int(self.bucket_cap_mb * _MIB)),
            first_cap_bytes=_FIRST_BUCKET_BYTES if self.overlap else None,
            order=order,
        )
        if self.overlap and self._num_shards > 1:
            self._overlap = BackwardOverlap(
                self._plan, self.backward_passes_per_step, self._grad_round, self._stats
            )
            self._overlap.attach()

    def _sync_ready_order(self) -> None:
        """DDP's bucket rebuild: after the first overlapped step, follow the observed order.

        Gradients may become ready in another order than reverse registration (modules
        defined in one order, called in another); a bucket then waits for a late member and
        holds back every bucket after it. The order seen by the group's first rank (observed
        parameters first, the rest as before) is broadcast, so every rank rebuilds the same
        buckets, once per parameter list. Ranks call this at the same ``step()``.
        """
        observed = self._overlap.observed if self._overlap is not None else []
        plan = self._plan
        seen = set(observed)
        order = list(observed) + [i for i in plan.order if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self._comm_device())
        # approximate: a pipelined broadcast forwards the message once per rank
        self._stats.send(t.numel() * t.element_size())
        src = 0 if self._group is None else dist.get_global_rank(self._group, 0)
        dist.broadcast(t, src=src, group=self._group)
        self._order_synced = True
        agreed = t.tolist()
        if agreed != plan.order:
            self._install_plan(plan.params, agreed)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if "_plan" in self.__dict__:  # not during torch.optim.Optimizer.__init__
            self._refresh_plan()

    # ---- communication -----------------------------------------------------------------------
    def _ensure_agreed(self) -> None:
        """One-time check that every rank of the group has the same parameters and options."""
        if self._agreed:
            return
        options = {
            "reduction": self.reduction.value,
            "cap": self._plan_caps(),
            "compression": self.compression,
            "backward_passes_per_step": self.backward_passes_per_step,
            "num_shards": self._num_shards,
        }
        # all-gather: this rank forwards (n - 1) fixed-size messages
        self._stats.send(MESSAGE_BYTES * (self._num_shards - 1))
        check_agreement(self._plan.params, options, self._group, self._comm_device())
        self._agreed = True

    def _comm_device(self) -> torch.device:
        """Where small control messages live: the current GPU for NCCL, else the CPU."""
        if dist.get_backend(self._group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _plan_caps(self) -> tuple[int, bool]:
        return (int(self.bucket_cap_mb * _MIB), self.overlap)

    def _divisor(self) -> int:
        if self.reduction is Reduction.MEAN:
            return self._num_shards * self.backward_passes_per_step
        return 1

    def _grad_round(self) -> ReduceRound:
        """A round over ``.grad`` in the persistent bucket buffers (the PyTorch path)."""
        self._ensure_agreed()
        params = self._plan.params
        return ReduceRound(
            self._plan,
            self._reducer,
            grads_of=lambda b: [params[i].grad for i in b.members],
            buffer_of=Bucket.persistent_buffer,
            divisor=self._divisor(),
        )

    def _reduced_pairs(self, rnd: ReduceRound) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Wait for ``rnd``; ``(reduced grad, param)`` for every param some rank had a grad for.

        The gradients are views of the round's buffers (no copy-out).
        """
        params = rnd.plan.params
        pairs = []
        for bucket, buffer in zip(rnd.plan.buckets, rnd.wait_all()):
            for i, view, present in zip(
                bucket.members, bucket.views(buffer), bucket.present(buffer)
            ):
                if present:  # no rank had a gradient: leave it out, the optimizer skips it
                    pairs.append((view, params[i]))
        return pairs

    # ---- PyTorch path: backward(); step() ----------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce the local ``.grad`` across the group, apply it with ``opt``, count one step.

        The reduced gradient is put in ``.grad`` only while ``opt.step()`` runs; afterwards
        ``.grad`` holds this replica's local gradient again, so accumulating without
        ``zero_grad`` continues exactly as it would on one process (for MEAN and SUM alike).
        With ``overlap=True`` the reduction launched during backward is used unless ``.grad``
        changed since (then ``.grad`` is reduced again, with a one-time warning).
        """
        if self._applying_pairs:  # TF path: the swapped-in grads are already reduced
            return super().step(closure)
        loss = run_closure(closure)
        rnd = None
        if self._overlap is not None:
            rnd, stale = self._overlap.take_round()
            if stale and not self._warned_stale:
                self._warned_stale = True
                warnings.warn(
                    "CrossShardOptimizer(overlap=True): .grad changed after backward had "
                    "launched its reduction (clipping, unscaling or an extra backward before "
                    "step()); reducing .grad again, so this step gets no overlap. Use "
                    "overlap=False when gradients are edited between backward() and step().",
                    UserWarning,
                    stacklevel=2,
                )
        if rnd is None:
            self._refresh_plan()
            if self._num_shards > 1 or self._divisor() != 1:
                rnd = self._grad_round()
        if rnd is None:  # one shard, nothing to divide: a plain step
            self._wrapped.step()
        else:
            with swapped_grads(self._all_params(), self._reduced_pairs(rnd)):
                self._wrapped.step()
        if self._overlap is not None and not self._order_synced:
            self._sync_ready_order()
        self._refresh_plan()
        self.iterations += 1
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients and start the step's backward passes afresh (overlap state too)."""
        if self._overlap is not None:
            self._overlap.reset()
        super().zero_grad(set_to_none=set_to_none)

    # ---- TF path: compute_gradients / apply_gradients -----------------------------------------
    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        if self.reduction is Reduction.MEAN and self._num_shards > 1:
            return loss / self._num_shards
        return loss

    def _apply_pairs(self, pairs: GradsAndVars) -> None:
        """SUM the given gradients across the group into fresh tensors, then apply them once."""
        for _, v in pairs:
            if not v.requires_grad:
                raise ValueError(
                    f"CrossShardOptimizer reduces gradients of trainable parameters only; a var "
                    f"of shape {tuple(v.shape)} has requires_grad=False"
                )
        self._refresh_plan()
        if self._num_shards == 1:
            reduced: list[tuple[torch.Tensor, torch.Tensor]] = list(pairs)  # type: ignore[arg-type]
        else:
            self._ensure_agreed()
            grads: list[torch.Tensor | None] = [None] * len(self._plan.params)
            for g, v in pairs:
                grads[self._index_of[id(v)]] = g
            rnd = ReduceRound(
                self._plan,
                self._reducer,
                grads_of=lambda b: [grads[i] for i in b.members],
                # fresh buffers: a PyTorch-path round may be in flight in the persistent ones
                buffer_of=Bucket.new_buffer,
                divisor=1,
            )
            reduced = self._reduced_pairs(rnd)
        self._applying_pairs = True
        try:
            with swapped_grads(self._all_params(), reduced):
                self.step()
        finally:
            self._applying_pairs = False

    def __repr__(self) -> str:
        return (
            f"CrossShardOptimizer({self.wrapped!r}, reduction={self.reduction.value!r}, "
            f"num_shards={self._num_shards}, overlap={self.overlap}, "
            f"compression={self.compression!r}, "
            f"backward_passes_per_step={self.backward_passes_per_step})"
        )
