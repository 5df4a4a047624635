"""Gradients as bucket views: ``.grad`` in the buckets, reduced in place, applied where it lies.

Owns :class:`BucketViews` (the :class:`~distoptim.comm.grad_views.GradViews` of the agreed plan:
``.grad`` of every trainable parameter aliases its slot in its bucket's persistent buffer, so
backward accumulates into the bucket and a round packs nothing) and :class:`ViewsApply`
(``gradient_as_bucket_view=True`` without sharding): the all-reduce runs in place on ``.grad``
and the inner ``opt.step()`` reads the reduced gradient from ``.grad`` itself.

After the step ``.grad`` holds ``S = sum_r L_r / n``, the replica mean of the accumulated local
gradients (the same on every rank; see :mod:`distoptim.comm.grad_views` for why accumulating
onto it stays exact). A round launched during backward (overlap) reduces a copy in the spare
buffers, so ``.grad`` may be read and edited until ``step()``; its result is copied into
``.grad`` when it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.grad_views import GradViews
from distoptim.comm.reducer import ReduceRound
from distoptim.protocol import swapped_grads
from distoptim.sync.apply import (
    AllReduceApply,
    BufferOf,
    GradSource,
    Held,
    SwappedHeld,
    reduced_pairs,
)
from distoptim.sync.clipping import GradClip
from distoptim.sync.collectives import Collectives
from distoptim.sync.options import SyncOptions

if TYPE_CHECKING:  # pragma: no cover
    from distoptim.sync.rounds import RoundDriver

__all__ = ["BucketViews", "ViewsApply"]


class BucketViews(GradSource):
    """``.grad`` as aliases of the bucket slots of the plan it follows (None before that)."""

    def __init__(self) -> None:
        self.views: GradViews | None = None

    def _on(self, plan: BucketPlan) -> bool:
        return self.views is not None and self.views.plan is plan

    def follow(self, plan: BucketPlan) -> None:
        """``.grad`` follows ``plan``'s buckets (values and presence carried over)."""
        if self._on(plan):
            return
        views = GradViews(plan)
        if self.views is not None:
            views.take_over(self.views)
        self.views = views

    def grads_of(self, plan: BucketPlan) -> Callable[[Bucket], Sequence[torch.Tensor | None]]:
        if self._on(plan):
            return self.views.grads  # type: ignore[union-attr]
        params = plan.params
        return lambda b: [params[i].grad for i in b.members]

    def buffers(
        self, plan: BucketPlan, fresh: bool, copy: bool
    ) -> tuple[BufferOf, BufferOf | None]:
        """The buckets' own buffers *are* ``.grad``: a round there packs nothing and, if its
        collective writes in place, leaves the reduced sum in ``.grad``; other buffers get
        ``.grad`` copied whole from them."""
        on = self._on(plan)
        buffer_of: BufferOf = Bucket.persistent_buffer
        if fresh:
            buffer_of = Bucket.new_buffer
        elif on and copy:
            buffer_of = Bucket.spare_buffer
        if on and buffer_of is not Bucket.persistent_buffer:
            return buffer_of, Bucket.persistent_buffer
        return buffer_of, None

    def scratch_buffer(self) -> BufferOf:
        return Bucket.persistent_buffer if self.views is None else Bucket.new_buffer

    def in_place(self, rnd: ReduceRound) -> bool:
        return (
            self._on(rnd.plan)
            and rnd.reduces_in_place
            and rnd.buffer_of is Bucket.persistent_buffer
        )

    def settle(self, rnd: ReduceRound, buffers: Sequence[torch.Tensor], factor: float) -> None:
        assert self.views is not None
        self.views.settle(rnd.present(buffers), factor)

    def adopt_packed(self) -> None:
        if self.views is not None:
            self.views.adopt(self.views.foreign())

    def zero(self, params: Sequence[torch.Tensor], set_to_none: bool) -> bool:
        """Zero the buckets in place and keep the views (``.grad`` is never None after it);
        parameters outside the plan follow torch."""
        views = self.views
        if views is None:
            return False
        views.zero(set_to_none)
        planned = views.ids
        for p in params:
            if p.grad is None or id(p) in planned:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_() if p.grad.grad_fn is not None else p.grad.requires_grad_(False)
                p.grad.zero_()
        return True


class ViewsApply(AllReduceApply):
    """All-reduce ``.grad`` in its buckets; the inner step reads the reduced ``.grad``."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        params: Callable[[], list[torch.Tensor]],
        options: SyncOptions,
        comm: Collectives,
    ) -> None:
        self.bucket_views = BucketViews()
        super().__init__(opt, params, options, comm, self.bucket_views)

    def _hold(self, rnd: ReduceRound, buffers: list[torch.Tensor]) -> Held:
        """``.grad`` holds (or receives) the reduced gradient, which the inner step reads.

        Parameters no rank had a gradient for, and parameters outside the plan (frozen ones),
        are hidden from ``opt`` (``.grad`` None for the inner step only).
        """
        views = self.bucket_views.views
        assert views is not None and views.plan is rnd.plan
        if not self.grads.in_place(rnd):  # an overlapped round reduced a copy: take its result
            for bucket, buffer in zip(rnd.plan.buckets, buffers):
                bucket.persistent_buffer()[: bucket.numel].copy_(buffer[: bucket.numel])
        present = rnd.present(buffers)
        views.hold_reduced(present)
        return _ReducedViews(views, rnd.plan, present, self.divisor / self.comm.replicas.size)

    def _hold_solo(self, rounds: RoundDriver) -> Held:
        """One shard: divide accumulated passes (MEAN) in fresh buffers, or step on ``.grad``
        as it is; never update frozen parameters."""
        plan = rounds.plan
        views = self.bucket_views.views
        assert views is not None
        if self.divisor != 1:
            rnd = rounds.grad_round(plan, fresh=True)
            pairs = reduced_pairs(rnd, rnd.wait_all())
        else:
            pairs = [(g, p) for p, g in zip(plan.params, views.present_grads()) if g is not None]
        return SwappedHeld(self.params(), pairs)  # type: ignore[arg-type]


class _ReducedViews(Held):
    """The buckets hold the reduced gradient ``R`` in place: ``.grad`` is it. The inner step
    hides parameters without one; afterwards the slots become the replica mean ``R d / n``."""

    def __init__(
        self, views: GradViews, plan: BucketPlan, present: Sequence[bool], factor: float
    ) -> None:
        self.views = views
        self.plan = plan
        self.present = present
        self.factor = factor

    def _hidden(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        if all(self.present) and len(params) == len(self.plan.params):
            return []
        shown = {id(p) for p, here in zip(self.plan.params, self.present) if here}
        return [p for p in params if p.grad is not None and id(p) not in shown]

    def step(self, opt: torch.optim.Optimizer, clip: GradClip | None) -> None:
        params = [p for g in opt.param_groups for p in g["params"]]
        try:
            with swapped_grads(self._hidden(params), []):
                if clip is not None:
                    clip.clip(params)
                opt.step()
        finally:
            self.drop()

    def drop(self) -> None:
        self.views.rescale(self.factor)
