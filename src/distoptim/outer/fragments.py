"""Streaming DiLoCo's fragments: which parameters sync together, and at which inner steps.

Owns the split of an ordered parameter list into ``F`` contiguous fragments balanced by bytes,
and the schedule that staggers their syncs over the outer period ``H`` (Douillard et al. 2025,
"Streaming DiLoCo with overlapping communication", arXiv 2501.18512, section 2.2).

Partition
---------
Parameters keep their order (the wrapped optimizer's param groups, flattened); fragment ``p``
is the run ``params[start_p:stop_p]``, the runs are consecutive, non-empty and cover the list.
Among all such splits into exactly ``F`` runs the one chosen has the smallest possible largest
fragment in bytes (the classic linear-partition problem, solved exactly by a binary search
over the cap with a greedy fill); ties are broken by filling earlier fragments first. The
result depends only on the sizes, so every replica computes the same fragments.

Schedule
--------
Inner steps are counted from 1 (``t`` is the step that has just completed). Fragment ``p``
(``0 <= p < F``) *launches* its sync at the steps ``t`` with ``t ≡ (p + 1)·H/F (mod H)`` and
``t >= (p + 1)·H/F``: fragment 0 first at ``H/F``, the last fragment at ``H, 2H, ...``. With
``F = 1`` this is plain DiLoCo: a sync at every ``k·H``. A sync launched at ``t`` is *applied*
at ``t + τ`` (``τ`` = ``fragment_sync_delay``, ``0 <= τ < H/F``), so at most one fragment is
in flight at any time and a fragment is always applied before it launches again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Fragment", "FragmentSchedule", "partition"]


@dataclass(frozen=True)
class Fragment:
    """One fragment: parameters ``start:stop`` (``nbytes`` bytes), first synced at ``offset``."""

    index: int
    start: int
    stop: int
    nbytes: int
    offset: int


def partition(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Split ``range(len(sizes))`` into ``parts`` consecutive non-empty runs, balanced by size.

    Returns ``[(start, stop), ...]``. The largest run's total size is the minimum over all
    splits into ``parts`` consecutive non-empty runs. Requires ``1 <= parts <= len(sizes)`` and
    sizes ``>= 0``.
    """
    n = len(sizes)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} items into {parts} non-empty parts")
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # smallest cap with which a greedy fill needs at most `parts` runs
        mid = (lo + hi) // 2
        if _runs_needed(sizes, mid) <= parts:
            hi = mid
        else:
            lo = mid + 1
    cap = lo
    bounds: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        runs_left = parts - len(bounds)  # including the open run
        items_left = n - i  # including item i
        # close the open run before item i when i would overflow it, or when every remaining
        # item is needed to give each remaining run one item
        if i > start and (total + size > cap or items_left < runs_left):
            bounds.append((start, i))
            start, total = i, 0
        total += size
    bounds.append((start, n))
    return bounds


def _runs_needed(sizes: Sequence[int], cap: int) -> int:
    runs, total = 1, 0
    for size in sizes:
        if total + size > cap and total > 0:
            runs, total = runs + 1, 0
        total += size
    return runs


class FragmentSchedule:
    """The fragments of a parameter list and the steps at which each one syncs.

    ``nbytes[i]`` is parameter ``i``'s size in bytes. Arguments are checked by the caller
    (``1 <= fragments <= len(nbytes)``, ``sync_every % fragments == 0``,
    ``0 <= delay < sync_every // fragments``).
    """

    def __init__(self, nbytes: Sequence[int], fragments: int, sync_every: int, delay: int) -> None:
        self.sync_every = sync_every
        self.delay = delay
        self.period = sync_every // fragments  # H / F: steps between two fragment launches
        self.fragments: list[Fragment] = [
            Fragment(p, start, stop, sum(nbytes[start:stop]), (p + 1) * self.period)
            for p, (start, stop) in enumerate(partition(nbytes, fragments))
        ]

    def __len__(self) -> int:
        return len(self.fragments)

    def launching_at(self, t: int) -> Fragment | None:
        """The fragment whose sync launches when inner step ``t`` completes, if any."""
        if t < self.period or t % self.period:
            return None
        return self.fragments[(t // self.period - 1) % len(self.fragments)]

    def in_flight_after(self, t: int) -> tuple[Fragment, int] | None:
        """``(fragment, launch step)`` of the sync still in flight once step ``t`` is done.

        A sync launched at ``s`` is in flight after steps ``s .. s + τ - 1`` (never with
        ``τ = 0``).
        """
        for s in range(t - self.delay + 1, t + 1):
            fragment = self.launching_at(s)
            if fragment is not None:
                return fragment, s
        return None

    def __repr__(self) -> str:
        runs = ", ".join(f"[{f.start}:{f.stop}] {f.nbytes} B @ {f.offset}" for f in self.fragments)
        return f"FragmentSchedule(H={self.sync_every}, τ={self.delay}: {runs})"
