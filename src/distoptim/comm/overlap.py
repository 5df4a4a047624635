"""Overlap of gradient all-reduces with backward, driven by post-accumulate-grad hooks.

Owns the per-parameter hooks and the bookkeeping of one optimizer step's backward passes.
Modeled on DDP's reducer (``torch/csrc/distributed/c10d/reducer.cpp``): a parameter is marked
ready when autograd has finished accumulating its gradient (``register_post_accumulate_grad_hook``);
when every member of a bucket is ready the bucket is launched -- but only in bucket order
("buckets are reduced in sequence", reducer.cpp's ``next_bucket_``), so a late bucket holds back
the ones after it and every rank issues the same collectives in the same order. At the end of
the step's last backward pass (an autograd engine callback, as DDP's ``finalize_backward``)
the buckets that did not fill -- parameters without a gradient in that pass -- are launched,
everything is waited for, and ``on_complete`` writes the reduced gradients into ``.grad``.
``step()`` then only applies them, and code between ``backward()`` and ``step()`` (clipping,
logging) sees the reduced gradients, as it does under DDP.

Gradient accumulation: with ``passes_per_step = N`` only the N-th backward pass since the last
reset launches anything; the first N-1 accumulate locally into ``.grad``.

Only backward passes that reach ``.grad`` count: ``torch.autograd.grad`` (the TF path's
``compute_gradients``) never runs these hooks. A backward pass after the step's reduction
completed (more than N before ``step()``) would add local gradients onto reduced ones; it is
recorded as ``overrun`` and ``step()`` refuses to apply that mix.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

import torch
from torch.autograd import Variable

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.reducer import ReduceRound

__all__ = ["BackwardOverlap"]


class BackwardOverlap:
    """Hooks on ``plan.params`` that reduce buckets during the step's last backward pass.

    ``new_round()`` makes the :class:`ReduceRound` of a step (reading ``.grad``);
    ``on_complete(round)`` waits for it and writes the results back. State per step:
    ``passes`` (backward passes finished), ``completed`` (the reduction is in ``.grad``),
    ``overrun`` (a backward pass ran after that). :meth:`reset` starts a new step.
    """

    def __init__(
        self,
        plan: BucketPlan,
        passes_per_step: int,
        new_round: Callable[[], ReduceRound],
        on_complete: Callable[[ReduceRound], None],
    ) -> None:
        self.plan = plan
        self.passes_per_step = passes_per_step
        self._new_round = new_round
        self._on_complete = on_complete
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._round: ReduceRound | None = None
        self._ready = [0] * len(plan)
        self._callback_queued = False
        self.passes = 0
        self.completed = False
        self.overrun = False

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
    @property
    def in_flight(self) -> bool:
        return self._round is not None and self._round.next_bucket > 0

    def reset(self) -> None:
        """Forget this step's passes; wait for (and drop) any collective still in flight."""
        if self._round is not None:
            self._round.drain()
        self._round = None
        self._ready = [0] * len(self.plan)
        self._callback_queued = False  # also recovers from a backward that raised midway
        self.passes = 0
        self.completed = False
        self.overrun = False

    def _on_grad_ready(self, index: int) -> None:
        if self.completed:
            self.overrun = True
            return
        if not self._callback_queued:
            Variable._execution_engine.queue_callback(
                functools.partial(_backward_done, weakref.ref(self))
            )
            self._callback_queued = True
        if self.passes != self.passes_per_step - 1:
            return  # an accumulation pass: nothing to send yet
        b = self.plan.bucket_of[index]
        self._ready[b] += 1
        if self._round is None:
            self._round = self._new_round()
        rnd = self._round
        buckets = self.plan.buckets
        while rnd.next_bucket < len(buckets) and self._ready[rnd.next_bucket] == len(
            buckets[rnd.next_bucket].members
        ):
            rnd.launch_next(overlapped=True)

    def _on_backward_done(self) -> None:
        self._callback_queued = False
        if self.completed:
            return
        self.passes += 1
        if self.passes < self.passes_per_step:
            return
        rnd = self._round if self._round is not None else self._new_round()
        self._round = None
        self._on_complete(rnd)  # launches the rest, waits, writes .grad
        self.completed = True


def _grad_ready(ref: weakref.ref[BackwardOverlap], index: int, param: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        owner._on_grad_ready(index)


def _backward_done(ref: weakref.ref[BackwardOverlap]) -> None:
    owner = ref()
    if owner is not None:
        owner._on_backward_done()
