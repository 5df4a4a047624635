"""Overlap of gradient all-reduces with backward, driven by post-accumulate-grad hooks.

Owns the per-parameter hooks and the bookkeeping of one optimizer step's backward passes.
Modeled on DDP's reducer (``torch/csrc/distributed/c10d/reducer.cpp``): a parameter is marked
ready when autograd has finished accumulating its gradient (``register_post_accumulate_grad_hook``);
when every member of a bucket is ready the bucket is launched -- but only in bucket order
("buckets are reduced in sequence", reducer.cpp's ``next_bucket_``), so a late bucket holds back
the ones after it and every rank issues the same collectives in the same order. At the end of
the step's last backward pass (an autograd engine callback, the moment DDP's
``finalize_backward`` runs) the buckets that did not fill -- parameters without a gradient in
that pass -- are launched too. Nothing waits in backward: ``step()`` waits. The hooks also
record the order gradients became ready (``observed``), which the optimizer uses once per
parameter list to rebuild the buckets in that order, as DDP rebuilds its buckets after the
first iteration.

Gradient accumulation: with ``passes_per_step = N`` only the N-th backward pass since the last
reset launches anything; the first N-1 accumulate locally into ``.grad``.

The launched round read ``.grad`` when backward produced it. :meth:`take_round` hands it to
``step()`` only if every gradient it read is still the same tensor at the same version
(``Tensor._version`` counts in-place writes): clipping, unscaling, another backward pass or
``zero_grad`` in between make the round *stale*, and the caller reduces ``.grad`` afresh, so
overlap never changes what is applied. Only backward passes that reach ``.grad`` count:
``torch.autograd.grad`` (the TF path's ``compute_gradients``) never runs these hooks.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch.autograd import Variable

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.reducer import ReduceRound
from distoptim.comm.stats import CommStats

__all__ = ["BackwardOverlap"]


class BackwardOverlap:
    """Hooks on ``plan.params`` that launch bucket reductions during the step's last backward.

    ``new_round()`` makes the :class:`ReduceRound` of a step (reading ``.grad``). State per
    step: ``passes`` (backward passes finished since :meth:`reset`) and the round in flight.
    ``observed`` is the order in which gradients became ready in the last completed launching
    pass (parameter indices), for a DDP-style bucket rebuild. ``stats.overlapped`` counts the
    buckets launched while that pass still had gradients to produce.
    """

    def __init__(
        self,
        plan: BucketPlan,
        passes_per_step: int,
        new_round: Callable[[], ReduceRound],
        stats: CommStats,
    ) -> None:
        self.plan = plan
        self.passes_per_step = passes_per_step
        self._new_round = new_round
        self._stats = stats
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._round: ReduceRound | None = None
        self._ready = [0] * len(plan)
        self._callback_queued = False
        self._fired: list[int] = []  # param indices, in hook order, of the launching pass
        self._launched_at: list[int] = []  # len(_fired) when each bucket was launched
        self.observed: list[int] = []
        self.passes = 0

    # ---- hooks ----------------------------------------------------------------------------
    def attach(self) -> None:
        """Register one hook per parameter that requires grad (weakly bound to ``self``)."""
        ref = weakref.ref(self)
        for i, p in enumerate(self.plan.params):
            if p.requires_grad:
                hook = functools.partial(_grad_ready, ref, i)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __del__(self) -> None:
        self.detach()

    # ---- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget this step's passes; wait for (and drop) any collective still in flight."""
        if self._round is not None:
            self._round.drain()
        self._round = None
        self._ready = [0] * len(self.plan)
        self._callback_queued = False  # also recovers from a backward that raised midway
        self._fired = []
        self._launched_at = []
        self.passes = 0

    def take_round(self) -> tuple[ReduceRound | None, bool]:
        """``(round, stale)``: the round launched in backward if still valid, for ``step()``.

        ``round`` is None when no backward pass launched one (fewer than N passes, or none)
        or when it is stale (``stale=True``; it was drained). Either way the caller reduces
        ``.grad`` itself. The state is reset.
        """
        rnd, self._round = self._round, None
        stale = rnd is not None and not rnd.inputs_unchanged()
        if stale:
            rnd.drain()  # type: ignore[union-attr]
            rnd = None
        self.reset()
        return rnd, stale

    def _on_grad_ready(self, index: int) -> None:
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(
                functools.partial(_backward_done, weakref.ref(self))
            )
            self._callback_queued = True
        if self.passes != self.passes_per_step - 1:
            return  # an accumulation pass (or one past the N-th): nothing to send now
        self._fired.append(index)
        self._ready[self.plan.bucket_of[index]] += 1
        if self._round is None:
            self._round = self._new_round()
        rnd = self._round
        buckets = self.plan.buckets
        while rnd.next_bucket < len(buckets) and self._ready[rnd.next_bucket] == len(
            buckets[rnd.next_bucket].members
        ):
            rnd.launch_next()
            self._launched_at.append(len(self._fired))

    def _on_backward_done(self) -> None:
        self._callback_queued = False
        self.passes += 1
        if self.passes != self.passes_per_step:
            return
        if self._round is None:
            self._round = self._new_round()
        self._round.launch_remaining()  # buckets with a member that got no gradient this pass
        # overlapped = launched before the pass's last gradient was ready
        self._stats.overlapped += sum(1 for at in self._launched_at if at < len(self._fired))
        self.observed = self._fired
        self._fired, self._launched_at = [], []


def _grad_ready(ref: weakref.ref[BackwardOverlap], index: int, param: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        owner._on_grad_ready(index)


def _backward_done(ref: weakref.ref[BackwardOverlap]) -> None:
    owner = ref()
    if owner is not None:
        owner._on_backward_done()
