"""Gradients as bucket views: ``.grad`` that lives in the bucket buffers, and its bookkeeping.

Owns what ``CrossShardOptimizer(gradient_as_bucket_view=True)`` does to ``.grad`` (DDP's
``gradient_as_bucket_view``): every trainable parameter of the agreed plan gets, as its
``.grad``, an *alias* of its slot in the bucket's persistent buffer
(:meth:`~distoptim.comm.bucket.Bucket.grad_aliases`), so backward accumulates straight into
the bucket and a reduction packs nothing.

Invariants
----------
* **Zeroing keeps the views.** :meth:`GradViews.zero` zeroes each bucket's gradient region in
  one pass and points every member's ``.grad`` at its alias again (whatever the user put there),
  for ``set_to_none=True`` and ``False`` alike: in view mode ``.grad`` of a planned parameter
  is never None after ``zero_grad()``.
* **Presence is still exact.** A member counts as having a gradient (its presence flag, which
  decides whether the inner optimizer sees it at all) when its alias was written since the last
  zeroing -- each alias has a version counter of its own, bumped by backward's in-place
  accumulation and by any in-place edit -- or when it was present before a
  ``zero_grad(set_to_none=False)`` (torch keeps such a gradient as zeros), or when it holds a
  reduced gradient (:meth:`settle`). A member whose ``.grad`` is None is absent; one whose
  ``.grad`` is some other tensor (the user assigned it, or ``model.zero_grad()`` set it to None
  and backward allocated a fresh one) is present and is *copied* into its slot by the next pack
  (:meth:`~distoptim.comm.bucket.Bucket.pack`), then :meth:`adopt` points ``.grad`` back at the
  alias -- correct in every case, copy-free when ``.grad`` stayed the alias.
* **A moved alias is put back.** ``p.grad.data = t`` re-points the alias object itself to
  other memory; the next pack (:meth:`GradViews.grads`) notices it (its data pointer is not its
  slot's), copies ``t`` into the slot -- or raises ``ValueError`` naming the parameter when
  ``t`` has another shape -- and points the alias at its slot again.
* **In-place rounds leave the replica mean.** A round reduced *in place* (the unsharded view
  mode) overwrites the local gradients ``L_r`` with ``R = sum_r L_r / d`` (``d`` the round's
  divisor: ``n N`` for MEAN, 1 for SUM). :meth:`settle` then rescales the slots to
  ``S = sum_r L_r / n = R d / n`` -- the mean over the ``n`` replicas of their accumulated
  local gradients, identical on every rank. Accumulating onto ``S`` without ``zero_grad`` is
  exact by linearity: the next round reduces ``sum_r (S + L'_r) / d = R + sum_r L'_r / d``, the
  same as accumulating onto each replica's local gradient. (``d = n`` -- MEAN with one backward
  pass per step -- needs no rescale at all.)

No communication happens here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distoptim.comm.bucket import Bucket, BucketPlan

__all__ = ["GradViews"]


class GradViews:
    """The ``.grad`` aliases of one bucket plan and the presence bookkeeping around them."""

    def __init__(self, plan: BucketPlan) -> None:
        self.plan = plan
        self.aliases: list[torch.Tensor] = [torch.empty(0)] * len(plan.params)
        for bucket in plan.buckets:
            for i, alias in zip(bucket.members, bucket.grad_aliases()):
                self.aliases[i] = alias
        self.ids = frozenset(id(p) for p in plan.params)
        self._ptrs = [alias.data_ptr() for alias in self.aliases]  # where each slot is
        n = len(plan.params)
        self._clean = [-1] * n  # alias version right after the last zeroing (-1: never zeroed)
        self._sticky = [False] * n  # present whatever the version says

    # ---- presence ------------------------------------------------------------------------
    def _present(self, i: int) -> bool:
        g = self.plan.params[i].grad
        if g is None:
            return False
        alias = self.aliases[i]
        return g is not alias or self._sticky[i] or g._version != self._clean[i]

    def present_grads(self) -> list[torch.Tensor | None]:
        """Per member (plan order): ``.grad`` if present, None if absent."""
        params = self.plan.params
        return [p.grad if self._present(i) else None for i, p in enumerate(params)]

    def grads(self, bucket: Bucket) -> list[torch.Tensor | None]:
        """What to pack for ``bucket``'s members: ``.grad`` if present, None if absent."""
        params, aliases, sticky, clean = self.plan.params, self.aliases, self._sticky, self._clean
        ptrs = self._ptrs
        out: list[torch.Tensor | None] = []
        for i in bucket.members:
            g = params[i].grad
            if g is None or (g is aliases[i] and not sticky[i] and g._version == clean[i]):
                out.append(None)
            else:
                if g is aliases[i] and g.data_ptr() != ptrs[i]:
                    self._put_back(bucket, i)
                out.append(g)
        return out

    def _put_back(self, bucket: Bucket, i: int) -> None:
        """Member ``i``'s alias was re-pointed (``.grad.data = t``): ``t`` into the slot, the
        alias back onto it; ``ValueError`` naming the parameter if ``t``'s shape is wrong."""
        k = bucket.members.index(i)
        alias = self.aliases[i]
        shape = bucket.shapes[k]
        if alias.shape != shape:
            raise bucket.wrong_shape(k, alias)
        slot = bucket.views(bucket.persistent_buffer())[k]
        with torch.no_grad():
            slot.copy_(alias)
        alias.set_(slot.untyped_storage(), slot.storage_offset(), shape, slot.stride())

    # ---- zero_grad -----------------------------------------------------------------------
    def zero(self, set_to_none: bool) -> None:
        """Zero every bucket's gradient region (one pass each); ``.grad`` = the aliases.

        ``set_to_none=True``: every member is absent until written again. ``False``: members
        present before stay present (torch keeps their gradient as zeros).
        """
        params = self.plan.params
        n = len(params)
        sticky = [False] * n if set_to_none else [self._present(i) for i in range(n)]
        for bucket in self.plan.buckets:
            if bucket.numel:
                bucket.persistent_buffer()[: bucket.numel].zero_()
        for p, alias in zip(params, self.aliases):
            if p.grad is not alias:
                p.grad = alias
        self._clean = [alias._version for alias in self.aliases]
        self._sticky = sticky

    # ---- after a round -------------------------------------------------------------------
    def adopt(self, members: Sequence[int]) -> None:
        """Point ``.grad`` of ``members`` (packed into their slots this round) at the aliases.

        Their slots hold what was packed (or, after an in-place round, its reduction); they
        count as present until the next zeroing.
        """
        params = self.plan.params
        for i in members:
            alias = self.aliases[i]
            if params[i].grad is not alias:
                params[i].grad = alias
            self._sticky[i] = True

    def foreign(self) -> list[int]:
        """Members whose ``.grad`` is a tensor other than their alias (copied when packed)."""
        params = self.plan.params
        return [
            i
            for i, (p, a) in enumerate(zip(params, self.aliases))
            if p.grad is not None and p.grad is not a
        ]

    def hold_reduced(self, present: Sequence[bool]) -> None:
        """After an in-place round: ``.grad`` of the members is their slot, which holds a
        reduced gradient where ``present`` (per member, agreed by every rank) -- those count as
        present until the next zeroing -- and zeros elsewhere."""
        params, sticky, clean = self.plan.params, self._sticky, self._clean
        for i, (p, alias, here) in enumerate(zip(params, self.aliases, present)):
            if p.grad is not alias:
                p.grad = alias
            sticky[i] = bool(here)
            if not here:
                clean[i] = alias._version

    def rescale(self, factor: float) -> None:
        """Slots holding ``R`` become the replica mean ``R * factor`` (``factor = d / n``)."""
        if factor != 1:
            for bucket in self.plan.buckets:
                if bucket.numel:
                    bucket.persistent_buffer()[: bucket.numel].mul_(factor)

    def settle(self, present: Sequence[bool], factor: float) -> None:
        """After an in-place round: :meth:`hold_reduced`, then :meth:`rescale`."""
        self.hold_reduced(present)
        self.rescale(factor)

    def take_over(self, old: GradViews) -> None:
        """Become the views of a new plan: move gradients that sit in ``old``'s slots here.

        A parameter in both plans whose ``.grad`` is its old alias gets its value copied into
        its new slot and its presence carried over; anything else is left for the next pack.
        """
        where = {id(p): i for i, p in enumerate(old.plan.params)}
        for i, p in enumerate(self.plan.params):
            j = where.get(id(p))
            if j is None or p.grad is not old.aliases[j]:
                continue
            present = old._present(j)
            alias = self.aliases[i]
            alias.copy_(old.aliases[j])
            p.grad = alias
            self._clean[i] = alias._version
            self._sticky[i] = present
