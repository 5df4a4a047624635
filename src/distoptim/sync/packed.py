"""The default apply strategy: ``.grad`` in tensors of its own, reduced gradients swapped in.

Owns :class:`TensorGrads` (``.grad`` as torch leaves it: a round packs a copy of each gradient
into the bucket buffers) and :class:`PackedApply`: the buckets are all-reduced, and the inner
``opt.step()`` runs with the reduced gradients -- views of the reduced buffers -- swapped into
``.grad`` (:class:`~distoptim.sync.apply.SwappedHeld`, from ``synchronize()`` or ``step()``
until the inner step is over); afterwards ``.grad`` holds this replica's local gradient again,
so accumulating without ``zero_grad`` continues exactly as on one process. Parameters no rank
had a gradient for, and frozen ones, get ``.grad`` None for the inner step only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.reducer import ReduceRound
from distoptim.sync.apply import (
    AllReduceApply,
    BufferOf,
    GradSource,
    Held,
    SwappedHeld,
    reduced_pairs,
)
from distoptim.sync.collectives import Collectives
from distoptim.sync.local_grads import local_grad
from distoptim.sync.options import SyncOptions

if TYPE_CHECKING:  # pragma: no cover
    from distoptim.sync.rounds import RoundDriver

__all__ = ["PackedApply", "TensorGrads"]


class TensorGrads(GradSource):
    """``.grad`` in tensors of its own: rounds pack a copy; nothing aliases the buffers."""

    def follow(self, plan: BucketPlan) -> None:
        pass

    def grads_of(self, plan: BucketPlan) -> Callable[[Bucket], Sequence[torch.Tensor | None]]:
        params = plan.params
        return lambda b: [local_grad(params[i]) for i in b.members]

    def buffers(self, plan: BucketPlan, fresh: bool, copy: bool) -> tuple[BufferOf, None]:
        return (Bucket.new_buffer if fresh else Bucket.persistent_buffer), None

    def scratch_buffer(self) -> BufferOf:
        return Bucket.persistent_buffer

    def in_place(self, rnd: ReduceRound) -> bool:
        return False

    def settle(self, rnd: ReduceRound, buffers: Sequence[torch.Tensor], factor: float) -> None:
        raise AssertionError("a round over tensors of their own never reduces .grad in place")

    def adopt_packed(self) -> None:
        pass

    def zero(self, params: Sequence[torch.Tensor], set_to_none: bool) -> bool:
        return False


class PackedApply(AllReduceApply):
    """All-reduce packed copies of ``.grad``; the inner step sees the reduced gradients."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        params: Callable[[], list[torch.Tensor]],
        options: SyncOptions,
        comm: Collectives,
    ) -> None:
        super().__init__(opt, params, options, comm, TensorGrads())

    def _hold(self, rnd: ReduceRound, buffers: list[torch.Tensor]) -> Held:
        return SwappedHeld(self.params(), reduced_pairs(rnd, buffers))

    def _hold_solo(self, rounds: RoundDriver) -> Held:
        """One shard: divide accumulated passes (MEAN), never update frozen parameters."""
        plan = rounds.plan
        if self.divisor != 1:
            rnd = rounds.grad_round(plan)
            pairs = reduced_pairs(rnd, rnd.wait_all())
        else:
            pairs = [(p.grad, p) for p in plan.params if p.grad is not None]
        return SwappedHeld(self.params(), pairs)  # type: ignore[arg-type]
