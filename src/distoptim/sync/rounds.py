"""The reduction rounds of a ``CrossShardOptimizer``: the plan they use, launch, agree, settle.

Owns :class:`RoundDriver`: the bucket plan of this rank's parameter list and the one every rank
of the group agreed on, the backward hooks that launch a round early (overlap) or count
backward passes (the sequence guard), and the life of every round:

* **plan** -- :meth:`RoundDriver.refresh` rebuilds this rank's plan when its parameter list
  changes (locally); rounds go on using the *agreed* plan until every rank moved to the new one.
  Before the first round, one all-gather checks that every rank has the same parameter list and
  options (:meth:`RoundDriver.agree`). After an overlapped step the bucket order follows the
  order the group's first rank saw gradients become ready, once per agreed plan (DDP's bucket
  rebuild).
* **launch** -- a round's buckets are launched in bucket order, from backward hooks (overlap)
  or all at once when the round is closed; the apply strategy (:mod:`distoptim.sync.apply`)
  builds the round -- all-reduces, or reduce-scatters with weight-update sharding -- and says
  where its gradients are packed from and into.
* **agree** -- the round's last collective carries every rank's sequence words
  (:mod:`distoptim.comm.guard`); every rank decodes the same table before anything is applied.
  Ranks then either all use the round, all reduce again (some rank edited ``.grad`` after
  backward launched its buckets, or its parameter list changed -- the new list is adopted by
  every rank at once), or all raise :class:`~distoptim.comm.guard.DesyncError` /
  ``ParameterMismatchError``. A rank issues exactly the agreed plan's bucket collectives per
  round, whatever it does locally, so a divergence never mispairs collectives of different sizes
  and leaves the group usable after the error.
* **settle** -- a round that reduced ``.grad`` in place (gradients as bucket views) leaves the
  replica mean of the local gradients there, also when its result is not used.

Besides the step counter, the pass count and the plan, every round's words carry a digest of the
wrapped optimizer's type and hyperparameters (:mod:`distoptim.comm.hyperparameters`, 32 bits
of its fingerprint: an LR scheduler stepped on some ranks only is a ``DesyncError`` in the next
round, whose ranks then exchange their descriptions to name each difference) and three
informative marks of a ``.grad`` round: *uncounted* (no pass counted, yet the gradients changed
since the last round: a backward that reached none of the pass counter's sentinels, which agrees
with any count >= 1 instead of raising a false alarm), *local edit* (``.grad`` changed after
backward ended: every rank warns once that such edits act on local gradients, and how to edit
the averaged one) and *foreign* (``.grad`` rewritten during backward: every rank warns once that
the model looks wrapped in ``DistributedDataParallel``, which reduces every gradient a second
time).

Calls that must be made on every rank although they are no step -- ``finish()``, and the
gathers of sharded state (``consolidate_state_dict()``, ``get_slot()``, ...) -- first run a
round of zeros over the agreed plan whose words name the call (:meth:`RoundDriver.announce`):
peers in a ``step()`` (or another call) raise ``DesyncError`` together with the caller, and a
caller whose peers left gets one at once, instead of a collective that pairs with nothing.

The round's result (the reduced buffers) goes back to the caller, who hands it to the apply
strategy. Every collective goes through :class:`~distoptim.sync.collectives.Collectives`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.fingerprint import digest
from distoptim.comm.guard import GuardWords, RoundKind, Verdict, check_round, plan_word
from distoptim.comm.hyperparameters import (
    describe_optimizer,
    differences,
    fingerprint,
    group_members,
)
from distoptim.comm.overlap import BackwardOverlap, PassCounter, sentinels
from distoptim.comm.reducer import ReduceRound, grads_changed
from distoptim.sync.apply import ApplyStrategy
from distoptim.sync.collectives import Collectives
from distoptim.sync.notices import Notices
from distoptim.sync.options import SyncOptions

__all__ = ["FIRST_BUCKET_BYTES", "Reduced", "RoundDriver"]

FIRST_BUCKET_BYTES = 1 << 20
"""Payload cap of the first bucket with overlap (DDP's ``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""

Reduced = tuple[ReduceRound, list[torch.Tensor]]
"""A closed round and its reduced buffers (shards with weight-update sharding), agreed."""


class RoundDriver:
    """The rounds of one synchronous optimizer over ``comm``'s replicas.

    ``params()``: the optimizer's parameters (every param group, in order); ``steps()``: its
    step counter (the words and the messages name it); ``apply``: the strategy that builds
    rounds and follows the agreed plan; ``inner``: the wrapped optimizer (its type and
    hyperparameters are digested into every round; None: not checked). Construction builds
    this rank's plan (no collective).
    """

    def __init__(
        self,
        params: Callable[[], list[torch.Tensor]],
        steps: Callable[[], int],
        options: SyncOptions,
        comm: Collectives,
        apply: ApplyStrategy,
        inner: torch.optim.Optimizer | None = None,
    ) -> None:
        self.params = params
        self.steps = steps
        self.inner = inner
        self.members: list[str] | None = None  # the inner optimizer's grouping, per plan
        self.options = options
        self.comm = comm
        self.apply = apply
        self.stats = comm.stats
        self.fingerprint: Mapping[str, object] = options.fingerprint(comm.replicas.size)
        self.overlapping = options.overlap  # until remove_hooks()
        self.warned_edit = False
        self.notices = Notices()
        # what the last .grad round read (weakly): a later round with no counted pass compares
        self.baseline: list[list[Any]] | None = None
        self.hooks_on = comm.replicas.size > 1
        self.counter = PassCounter()
        # the plan of this rank's current parameter list ("proposed"), and the one every rank
        # of the group agreed on (None before the first agreement): rounds use the agreed one
        self.plan_key: tuple[tuple[int, bool], ...] | None = None
        self.plan: BucketPlan = BucketPlan([], 1)
        self.plan_word = 0
        self.agreed: BucketPlan | None = None
        self.inflight: ReduceRound | None = None
        self.overlap_hooks: BackwardOverlap | None = None
        self.order_synced = False
        # whether zero_grad() ran while a round launched in place during backward was in flight
        self.zeroed_inflight = False
        self.refresh()

    @property
    def size(self) -> int:
        """Replicas in the group (``n``)."""
        return self.comm.replicas.size

    @property
    def divisor(self) -> int:
        """What a ``.grad`` round divides the replicas' sum by (see :class:`SyncOptions`)."""
        return self.options.divisor(self.size)

    # ---- the plan follows the parameter list ----------------------------------------------
    def refresh(self) -> None:
        """Rebuild this rank's plan (and hooks) if parameters were added or requires_grad changed.

        Local only: rounds go on using the agreed plan until every rank agrees on the new one.
        """
        key = tuple((id(p), p.requires_grad) for p in self.params())
        if key == self.plan_key:
            return
        params = [p for p in self.params() if p.requires_grad]
        self.plan_key = key
        self.members = None
        self.plan_word = plan_word(digest(params, self.fingerprint))
        self._install(params, order=None)
        if self.size == 1:
            self.apply.grads.follow(self.plan)

    def _install(self, params: list[torch.Tensor], order: list[int] | None) -> None:
        """Make ``params`` (in ready ``order``) this rank's plan, with its hooks."""
        self._detach()
        overlap = self.options.overlap
        shape = self.apply.plan_shape(self.comm.words)
        self.plan = BucketPlan(
            params,
            cap_bytes=max(1, self.options.cap_bytes),
            first_cap_bytes=FIRST_BUCKET_BYTES if overlap else None,
            order=order,
            trailer=shape.trailer,
            trailer_device=self.comm.device if shape.trailer else "cpu",
            pad_to=shape.pad_to,
            flags=shape.flags,
        )
        if not self.hooks_on:
            return
        if overlap:
            self.overlap_hooks = BackwardOverlap(
                self.plan,
                self.options.backward_passes_per_step,
                self.counter,
                self._round_for_launch,
                self.stats,
            )
            self.overlap_hooks.attach()
            self.counter.track(sentinels(params))  # stamped (edits, DDP) through its hooks
        elif self.options.sequence_guard:
            self.counter.watch(sentinels(params))

    def _detach(self) -> None:
        if self.overlap_hooks is not None:
            self.overlap_hooks.detach()
            self.overlap_hooks = None
        self.counter.unwatch()

    def remove_hooks(self) -> None:
        """Close a round backward launched (a collective round), then detach every hook."""
        self.close_inflight(RoundKind.ABANDON)
        self._detach()
        self.hooks_on = False
        self.overlapping = False

    def agree(self) -> None:
        """Before the first round: every rank of the group has the same parameters and options."""
        if self.agreed is not None:
            return
        self.comm.agree(self.plan.params, self.fingerprint)
        self._set_agreed(self.plan)
        self.order_synced = False

    def adopt(self) -> None:
        """Every rank of the group switches to its current plan (their fingerprints agree)."""
        if self.agreed is not self.plan:
            self._set_agreed(self.plan)
            self.order_synced = False

    def _set_agreed(self, plan: BucketPlan) -> None:
        """``plan`` is what every rank's rounds use from now on (every rank calls this)."""
        self.agreed = plan
        self.baseline = None
        self.apply.follow(plan)

    def solo_plan(self) -> BucketPlan:
        """One shard agrees with itself: the apply strategy follows this rank's plan."""
        self.apply.follow(self.plan)
        return self.plan

    def sync_ready_order(self) -> None:
        """DDP's bucket rebuild: after an overlapped step, follow the observed order.

        Gradients may become ready in another order than reverse registration (modules
        defined in one order, called in another); a bucket then waits for a late member and
        holds back every bucket after it. The order seen by the group's first rank (observed
        parameters first, the rest as before) is broadcast, so every rank rebuilds the same
        buckets, once per agreed parameter list. Every rank calls this at the end of the same
        ``step()`` (the decision depends only on agreed state); if the first rank has not
        observed a backward pass of the agreed plan yet, nothing changes and the next step
        tries again.
        """
        plan = self.agreed
        assert plan is not None
        hooks = self.overlap_hooks
        observed = hooks.observed if hooks is not None and hooks.plan is plan else []
        seen = set(observed)
        order = [1 if observed else 0, *observed, *(i for i in plan.order if i not in seen)]
        valid, *agreed = self.comm.broadcast_order(order)
        if not valid:
            return
        self.order_synced = True
        if agreed != plan.order:
            self._install(plan.params, agreed)
            self._set_agreed(self.plan)

    # ---- building rounds ------------------------------------------------------------------
    def _round(
        self,
        plan: BucketPlan,
        grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
        buffer_of: Callable[[Bucket], torch.Tensor],
        divisor: float,
        what: str,
    ) -> ReduceRound:
        return self.apply.new_round(plan, grads_of, buffer_of, divisor, what)

    def grad_round(self, plan: BucketPlan, fresh: bool = False) -> ReduceRound:
        """A round over ``.grad`` (the PyTorch path) into the buffers the gradients choose.

        See :meth:`~distoptim.sync.apply.GradSource.buffers`; ``fresh``: new buffers.
        """
        grads = self.apply.grads
        copy = self.apply.reduces_copy(self.overlapping)
        buffer_of, source_of = grads.buffers(plan, fresh, copy)
        rnd = self._round(
            plan,
            grads.grads_of(plan),
            buffer_of,
            self.divisor,
            f"the reduction of step {self.steps()}",
        )
        if source_of is not None:
            rnd.source_of = source_of  # the slots .grad lives in: copied whole
        return rnd

    def _round_for_launch(self) -> ReduceRound | None:
        """The round backward hooks launch into: None until every rank agreed on this plan."""
        if self.agreed is not self.plan:
            return None
        if self.inflight is None:
            self.inflight = self.grad_round(self.plan)
        return self.inflight

    def note_zeroed(self) -> None:
        """``.grad`` was zeroed in its buckets: a round launched in place read other values."""
        if self.inflight is not None and self.inflight.next_bucket:
            self.zeroed_inflight = True

    # ---- closing rounds: every rank's words, one verdict ------------------------------------
    def _close(
        self, rnd: ReduceRound, kind: RoundKind, edited: bool = False, **marks: bool
    ) -> tuple[Verdict, list[torch.Tensor]]:
        """Launch ``rnd``'s last bucket with this rank's words, wait, check every rank's words.

        ``marks``: the informative flags of a ``.grad`` round (``uncounted``, ``local_edit``,
        ``foreign``, see :class:`~distoptim.comm.guard.GuardWords`). Raises ``DesyncError`` /
        ``ParameterMismatchError`` on every rank of the group alike.
        """
        codec = self.comm.codec
        assert codec is not None
        guard = self.options.sequence_guard
        described = self._describe() if guard else None
        words = GuardWords(
            kind,
            step=self.steps() if guard else 0,
            passes=self.counter.completed if guard else 0,
            plan=self.plan_word,
            params=len(self.plan.params),
            edited=edited,
            replanned=self.plan is not self.agreed,
            hyper=0 if described is None else fingerprint(described) & 0xFFFFFFFF,
            **marks,
        )
        buffers = rnd.wait_all(lambda trailer: codec.write(trailer, words))
        table = codec.read(rnd.trailer(buffers))

        def explain() -> str:  # every rank gets here alike: a collective on the error path
            gathered = self.comm.gather_objects(described, "the hyperparameters' exchange")
            return "\n".join(differences(gathered, [f"rank {r}" for r in codec.ranks]))

        return check_round(table, codec.ranks, explain_hyperparameters=explain), buffers

    def _describe(self) -> dict[str, Any] | None:
        """The wrapped optimizer's type and hyperparameters as plain data (None: unchecked)."""
        if self.inner is None:
            return None
        params = self.params()
        if self.members is None:
            self.members = group_members(self.inner, params)
        return describe_optimizer(self.inner, params, self.members)

    def _settle(self, rnd: ReduceRound, buffers: list[torch.Tensor]) -> None:
        """After an in-place round: ``.grad`` = the replica mean (see the gradient source)."""
        self.apply.grads.settle(rnd, buffers, self.divisor / self.size)

    def close_inflight(self, kind: RoundKind) -> None:
        """Close a round backward launched without a ``step()`` to use it (on every rank).

        ``kind`` names the operation that closes it (``finish()``, ``apply_gradients``, or
        ``ABANDON`` for ``remove_hooks()``), so a peer in ``step()`` learns what this rank did.
        """
        rnd, self.inflight = self.inflight, None
        self.zeroed_inflight = False
        if rnd is None:
            return
        verdict, buffers = self._close(rnd, kind)
        if self.apply.grads.in_place(rnd):
            self._settle(rnd, buffers)
        if verdict.repeat:
            self.adopt()

    def _agreed_round(
        self,
        kind: RoundKind,
        make: Callable[[BucketPlan], ReduceRound],
        rnd: ReduceRound | None = None,
        edited: bool = False,
        **marks: bool,
    ) -> Reduced:
        """Close ``rnd`` (or ``make(agreed plan)``); if any rank asks, reduce again, together.

        ``marks`` (see :meth:`_close`) go into both rounds' words: the repeat is the same
        operation, so it must agree exactly where the first round did.
        """
        if rnd is None:
            assert self.agreed is not None
            rnd = make(self.agreed)
        verdict, buffers = self._close(rnd, kind, edited, **marks)
        self.notices.inform(verdict)
        if verdict.repeat:
            if self.apply.grads.in_place(rnd):  # the local gradients are gone: mean again
                self._settle(rnd, buffers)  # (in-place rounds are never in flight: no edits)
            self.adopt()
            if verdict.edited and not self.warned_edit:
                self.warned_edit = True
                warnings.warn(
                    "CrossShardOptimizer(overlap=True): .grad changed after backward had "
                    "launched its reduction on some rank (clipping, unscaling, zero_grad, or an "
                    "extra backward before step()); every rank reduces .grad again, so this "
                    "step gets no overlap. Use overlap=False when gradients are edited between "
                    "backward() and step().",
                    UserWarning,
                    stacklevel=4,
                )
            self.stats.repeated_rounds += 1
            rnd = make(self.agreed)  # type: ignore[arg-type]
            _, buffers = self._close(rnd, RoundKind.REPAIR, **marks)
        return rnd, buffers

    # ---- the rounds the optimizer asks for --------------------------------------------------
    def reduce_grads(self, kind: RoundKind = RoundKind.STEP) -> Reduced:
        """The agreed reduction of ``.grad`` for ``step()`` or ``synchronize()`` (``kind``):
        the round backward launched, if it still holds; the step's backward-pass bookkeeping
        starts afresh either way."""
        try:
            self.refresh()
            self.agree()
            rnd, self.inflight = self.inflight, None
            edited = rnd is not None and (self.zeroed_inflight or not rnd.inputs_unchanged())
            self.zeroed_inflight = False
            marks = self._marks()
            rnd, buffers = self._agreed_round(kind, self.grad_round, rnd, edited, **marks)
            if self._counts_sentinels:
                self.baseline = rnd.snapshot()
            return rnd, buffers
        finally:
            self.counter.reset()
            if self.overlap_hooks is not None:
                self.overlap_hooks.new_step()

    @property
    def _counts_sentinels(self) -> bool:
        """Does the pass count come from a few sentinels only (not from every parameter)?"""
        return self.options.sequence_guard and self.hooks_on and not self.overlapping

    def _marks(self) -> dict[str, bool]:
        """This rank's informative flags for a ``.grad`` round (see :meth:`_close`)."""
        counter = self.counter
        uncounted = False
        if self._counts_sentinels and counter.completed == 0 and self.agreed is not None:
            grads_of = self.apply.grads.grads_of(self.agreed)
            uncounted = grads_changed(self.agreed, grads_of, self.baseline)
        return {
            "uncounted": uncounted,
            "local_edit": counter.completed > 0 and counter.edited_since_pass(),
            "foreign": counter.foreign,
        }

    def passes_since_reduce(self) -> bool:
        """Did a backward pass run (or launch a round) since the last ``reduce_grads``?"""
        return self.counter.completed > 0 or self.inflight is not None

    def end_step(self) -> None:
        """After an applied ``step()``: with overlap, the bucket rebuild (once per plan)."""
        if self.options.overlap and not self.order_synced:
            self.sync_ready_order()

    def reduce_pairs(self, grads: Mapping[int, torch.Tensor]) -> Reduced:
        """The agreed SUM of given gradients (``id(param) -> grad``) into fresh buffers.

        The ``apply_gradients`` round; on one shard, a local round over this rank's plan.
        """

        def given(plan: BucketPlan) -> ReduceRound:
            params = plan.params
            return self._round(
                plan,
                lambda b: [grads.get(id(params[i])) for i in b.members],
                # fresh buffers: the results must not alias the .grad rounds' buffers
                Bucket.new_buffer,
                1,
                f"apply_gradients at step {self.steps()}",
            )

        if self.size == 1:
            rnd = given(self.solo_plan())
            return rnd, rnd.wait_all()
        self.agree()
        self.close_inflight(RoundKind.PAIRS)
        return self._agreed_round(RoundKind.PAIRS, given)

    def finish(self) -> None:
        """One round of zeros whose words say ``finish()`` (see the optimizer's ``finish``)."""
        self.announce(RoundKind.FINISH)

    def announce(self, kind: RoundKind) -> None:
        """One round of zeros whose words say ``kind``: a call every rank must make.

        Every rank of the group passes it together, or raises together: peers in another
        operation (a ``step()``) get ``DesyncError`` naming the call and the ranks that made
        it, and a caller whose peers left gets one at once (the round's collectives fail).
        """
        self.refresh()
        self.agree()
        self.close_inflight(kind)

        def zeros(plan: BucketPlan) -> ReduceRound:
            return self._round(
                plan,
                lambda b: [None] * len(b.members),
                self.apply.grads.scratch_buffer(),  # leave the buffers .grad lives in alone
                1,
                f"{kind.describe()} -- a collective: every rank of the group must call it --",
            )

        verdict, _ = self._close(zeros(self.agreed), kind)  # type: ignore[arg-type]
        if verdict.repeat:
            self.adopt()
