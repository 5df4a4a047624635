"""Backward-pass hooks: counting a step's backward passes, and overlapping buckets with them.

Owns the per-parameter hooks and the bookkeeping of one optimizer step's backward passes.

:class:`PassCounter` counts the backward passes since the last ``step()`` that reached the
parameters it watches (a post-accumulate-grad hook marks the pass, an autograd engine callback
counts it when the pass ends). The sequence guard (:mod:`distoptim.comm.guard`) compares the
count across ranks, which is how a skipped ``step()`` (two passes where peers had one) or an
extra ``backward()`` becomes an error instead of gradients of different iterations summed.
Without overlap it watches a few *sentinel* parameters only (:func:`sentinels`), so counting
costs a handful of hook calls per pass, not one per parameter.

The counter also stamps the sentinels' ``.grad`` (identity and ``Tensor._version``) twice per
pass: when autograd has accumulated each one (in its hook), and once the pass is completely
over -- in a second engine callback, queued from the first, so it runs after every callback the
pass queued, such as ``DistributedDataParallel``'s ``finalize_backward``. A gradient that
changed between the two stamps was rewritten during backward by someone else's hook (a DDP
reducer averaging it: :attr:`PassCounter.foreign`); one that changed between the second stamp
and ``step()`` was edited by user code after backward (:meth:`PassCounter.edited_since_pass`:
clipping, unscaling, zeroing, assigning). Both are cheap signals on a few tensors, not proofs:
an edit of non-sentinel gradients only goes unseen.

:class:`BackwardOverlap` is modeled on DDP's reducer (``torch/csrc/distributed/c10d/
reducer.cpp``): a parameter is marked ready when autograd has finished accumulating its gradient
(``register_post_accumulate_grad_hook``); when every member of a bucket is ready the bucket is
launched -- but only in bucket order ("buckets are reduced in sequence", reducer.cpp's
``next_bucket_``), so a late bucket holds back the ones after it and every rank issues the same
collectives in the same order. At the end of the step's last backward pass (the moment DDP's
``finalize_backward`` runs) the buckets that did not fill -- parameters without a gradient in
that pass -- are launched too, except the round's *held* last bucket, which ``step()`` launches
with the round's sequence words (see :mod:`distoptim.comm.reducer`). Nothing waits in backward:
``step()`` waits. The hooks also record the order gradients became ready (``observed``), which
the optimizer uses once per parameter list to rebuild the buckets in that order, as DDP rebuilds
its buckets after the first iteration.

Gradient accumulation: with ``passes_per_step = N`` only the N-th backward pass since the last
``step()`` launches anything; earlier passes accumulate locally into ``.grad``, later ones
(an extra ``backward()``) launch nothing more. At most one round is launched per step; the
optimizer owns it until ``step()`` closes it, whatever happens in between (``zero_grad``,
another pass, a new parameter list), so every rank issues exactly one set of bucket
collectives per round.

The launched round read ``.grad`` when backward produced it; ``step()`` checks (by
``Tensor._version``) whether it is still what ``.grad`` holds, and the ranks agree on reducing
again if it is not on any of them. Only backward passes that reach ``.grad`` count:
``torch.autograd.grad`` (the TF path's ``compute_gradients``) never runs these hooks.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.autograd import Variable

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.reducer import ReduceRound
from distoptim.comm.stats import CommStats

__all__ = ["BackwardOverlap", "PassCounter", "sentinels"]

MAX_SENTINELS = 4


def sentinels(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Up to :data:`MAX_SENTINELS` parameters spread over ``params``: first, last, between.

    A backward pass that reaches none of them is not counted (a model whose first and last
    trainable parameters, and two between, all go unused in a pass, on some ranks only).
    """
    n = len(params)
    if n <= MAX_SENTINELS:
        return list(params)
    picks = sorted({round(k * (n - 1) / (MAX_SENTINELS - 1)) for k in range(MAX_SENTINELS)})
    return [params[i] for i in picks]


def _queue_at_backward_end(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward pass ends (autograd engine callback).

    The one private torch API this module uses; callable only from within a backward hook.
    """
    Variable._execution_engine.queue_callback(fn)


Stamp = tuple[int, int]
"""A ``.grad`` at one moment: ``(id, _version)``, ``(0, -1)`` for None (compared, never kept)."""


def _stamp(param: torch.Tensor) -> Stamp:
    g = param.grad
    return (0, -1) if g is None else (id(g), g._version)


class PassCounter:
    """Backward passes since :meth:`reset` that reached at least one watched parameter.

    ``completed``: passes that have ended. Parameters are watched either by :meth:`watch`
    (this counter's own hooks) or by a :class:`BackwardOverlap` calling :meth:`note_grad` from
    its hooks. ``listeners`` run at the end of every counted pass, after ``completed`` grew.
    ``foreign``: since :meth:`reset`, a stamped gradient changed during a pass after autograd
    had accumulated it (see the module docstring); stamped are the parameters given to
    :meth:`watch` or :meth:`track`.
    """

    def __init__(self) -> None:
        self.completed = 0
        self.listeners: list[Callable[[], None]] = []
        self.foreign = False
        self._queued = False
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._tracked: dict[int, torch.Tensor] = {}  # id(param) -> param, the stamped ones
        self._at_hook: dict[int, Stamp] = {}  # stamped when autograd accumulated them
        self._settled: dict[int, Stamp] = {}  # stamped when the last counted pass was over

    def watch(self, params: Sequence[torch.Tensor]) -> None:
        """Hook and stamp ``params`` (weakly bound to ``self``); replaces what was watched."""
        self.unwatch()
        ref = weakref.ref(self)
        for p in params:
            if p.requires_grad:
                self._handles.append(
                    p.register_post_accumulate_grad_hook(functools.partial(_noted, ref))
                )
        self.track(params)

    def track(self, params: Sequence[torch.Tensor]) -> None:
        """Stamp ``params`` when :meth:`note_grad` names them (another object's hooks)."""
        self._tracked = {id(p): p for p in params}
        self._at_hook, self._settled = {}, {}

    def unwatch(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.track([])

    def __del__(self) -> None:
        self.unwatch()

    def note_grad(self, param: torch.Tensor | None = None) -> None:
        """A watched gradient was accumulated: make sure the running pass gets counted."""
        if param is not None and id(param) in self._tracked:
            self._at_hook[id(param)] = _stamp(param)
        if not self._queued:
            _queue_at_backward_end(functools.partial(_pass_ended, weakref.ref(self)))
            self._queued = True

    def _on_pass_end(self) -> None:
        self._queued = False
        self.completed += 1
        for fn in list(self.listeners):
            fn()
        # after every callback this pass queued (a DDP reducer's finalize_backward among them)
        _queue_at_backward_end(functools.partial(_pass_settled, weakref.ref(self)))

    def _on_pass_settled(self) -> None:
        tracked = self._tracked
        if any(_stamp(tracked[k]) != v for k, v in self._at_hook.items() if k in tracked):
            self.foreign = True
        self._at_hook = {}
        self._settled = {k: _stamp(p) for k, p in tracked.items()}

    def edited_since_pass(self) -> bool:
        """Did a stamped ``.grad`` change after the last counted pass was over?"""
        tracked = self._tracked
        return any(_stamp(tracked[k]) != v for k, v in self._settled.items() if k in tracked)

    def reset(self) -> None:
        """Start counting afresh (``step()``); also recovers from a backward that raised."""
        self.completed = 0
        self.foreign = False
        self._queued = False
        self._at_hook, self._settled = {}, {}


def _noted(ref: weakref.ref[PassCounter], param: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        owner.note_grad(param)


def _pass_ended(ref: weakref.ref[PassCounter]) -> None:
    owner = ref()
    if owner is not None:
        owner._on_pass_end()


def _pass_settled(ref: weakref.ref[PassCounter]) -> None:
    owner = ref()
    if owner is not None:
        owner._on_pass_settled()


class BackwardOverlap:
    """Hooks on ``plan.params`` that launch bucket reductions during the step's N-th pass.

    ``round_for_launch()`` returns the round to launch into (the optimizer creates it on first
    use and keeps it until ``step()``), or None when nothing may be launched now (the plan is
    not yet agreed by every rank). ``counter`` counts the passes; this object's hooks feed it.
    ``observed`` is the order in which gradients became ready in the last completed launching
    pass (parameter indices), for a DDP-style bucket rebuild. ``stats.overlapped`` counts the
    buckets launched while that pass still had gradients to produce.
    """

    def __init__(
        self,
        plan: BucketPlan,
        passes_per_step: int,
        counter: PassCounter,
        round_for_launch: Callable[[], ReduceRound | None],
        stats: CommStats,
    ) -> None:
        self.plan = plan
        self.passes_per_step = passes_per_step
        self.counter = counter
        self._round_for_launch = round_for_launch
        self._stats = stats
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._ready = [0] * len(plan)
        self._fired: list[int] = []  # param indices, in hook order, of the launching pass
        self._launched_at: list[int] = []  # len(_fired) when each bucket was launched
        self._listener: Callable[[], None] | None = None
        self.observed: list[int] = []

    # ---- hooks ----------------------------------------------------------------------------
    def attach(self) -> None:
        """Register one hook per parameter that requires grad (weakly bound to ``self``)."""
        ref = weakref.ref(self)
        for i, p in enumerate(self.plan.params):
            if p.requires_grad:
                hook = functools.partial(_grad_ready, ref, i)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
        self._listener = functools.partial(_pass_done, ref)
        self.counter.listeners.append(self._listener)

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._listener is not None and self._listener in self.counter.listeners:
            self.counter.listeners.remove(self._listener)
        self._listener = None

    def __del__(self) -> None:
        self.detach()

    # ---- state --------------------------------------------------------------------------------
    def new_step(self) -> None:
        """Forget the readiness of the step that ended (``step()`` took its round)."""
        self._ready = [0] * len(self.plan)
        self._fired = []
        self._launched_at = []

    def _on_grad_ready(self, index: int) -> None:
        self.counter.note_grad(self.plan.params[index])
        if self.counter.completed != self.passes_per_step - 1:
            return  # an accumulation pass (or one past the N-th): nothing to send now
        self._fired.append(index)
        self._ready[self.plan.bucket_of[index]] += 1
        rnd = self._round_for_launch()
        if rnd is None:
            return
        buckets = self.plan.buckets
        while rnd.next_bucket < rnd.launchable and self._ready[rnd.next_bucket] == len(
            buckets[rnd.next_bucket].members
        ):
            rnd.launch_next()
            self._launched_at.append(len(self._fired))

    def _on_pass_end(self) -> None:
        if self.counter.completed != self.passes_per_step:
            return
        rnd = self._round_for_launch()
        if rnd is not None:
            rnd.launch_launchable()  # buckets with a member that got no gradient this pass
        # overlapped = launched before the pass's last gradient was ready
        self._stats.overlapped += sum(1 for at in self._launched_at if at < len(self._fired))
        self.observed = self._fired
        self._fired, self._launched_at = [], []


def _grad_ready(ref: weakref.ref[BackwardOverlap], index: int, param: torch.Tensor) -> None:
    owner = ref()
    if owner is not None:
        owner._on_grad_ready(index)


def _pass_done(ref: weakref.ref[BackwardOverlap]) -> None:
    owner = ref()
    if owner is not None:
        owner._on_pass_end()
