"""A managed CrossShardOptimizer over full copies: each process sends only 1/k across groups.

Owns :class:`GroupSlices`, what a replica group of ``k`` processes that each hold the whole
model (CrossShard's own round inside the group, every process with the same reduced buckets
after it) does with the buckets across the groups. Sending the whole buckets from every
process moves ``k`` times what one process of a group would (torchft connects equal group
ranks, so each process all-reduces with its counterpart in every other group). Instead,
process ``r`` of the group takes slice ``r`` of each bucket (``ceil(B / k)`` elements; the last
slices may be shorter or empty), averages only that with its counterparts through the manager,
and the group then all-gathers the slices over its own processes, so every process holds the
whole averaged bucket again -- HSDP's shape for full copies: across groups (the slow links)
each process sends ``1/k`` of the bytes; inside the group one all-gather of the buckets more.

Why every process of every group still ends with the same update: inside a group the
processes hold bitwise-equal buckets after the group's round (one all-reduce, whose result
every rank receives alike); slice ``r`` is all-reduced once over the processes of rank ``r``
of every group, and the all-gather hands each process the same slices. A healing process
contributes zeros to its slice (torchft's ``allreduce``) and receives the mean like the others.
The all-gather is issued on every process of the group in every round that has buckets,
whatever the quorum did, so the group's collectives never differ between its processes (a
failed round's slices are garbage and the round does not commit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from distoptim.comm.stats import CommStats

__all__ = ["GroupSlices"]


class GroupSlices:
    """Process ``rank`` of a replica group of ``size`` full copies (``group``: the group's own
    process group): which slice of a bucket it sends across groups, and the all-gather that
    puts the slices back together."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        if size < 2 or not 0 <= rank < size:
            raise ValueError(f"GroupSlices: rank {rank} of a group of {size} (needs size >= 2)")
        self.group, self.rank, self.size = group, rank, size

    def _bounds(self, numel: int) -> tuple[int, int, int]:
        """``(start, stop, chunk)``: this process's slice of ``numel`` elements, chunk length."""
        chunk = -(-numel // self.size)
        start = min(self.rank * chunk, numel)
        return start, min(start + chunk, numel), chunk

    def part(self, head: torch.Tensor) -> torch.Tensor:
        """This process's slice of a 1-D bucket (a view: reducing it reduces the bucket)."""
        start, stop, _ = self._bounds(head.numel())
        return head[start:stop]

    def gather(self, heads: Sequence[torch.Tensor], stats: CommStats) -> None:
        """Every slice of every bucket from the process that reduced it, into ``heads`` in
        place: one all-gather over the group per dtype among the buckets (a collective of its
        processes, each with the same buckets)."""
        for dtype in sorted({h.dtype for h in heads}, key=str):
            self._gather([h for h in heads if h.dtype == dtype], stats)

    def _gather(self, heads: Sequence[torch.Tensor], stats: CommStats) -> None:
        bounds = [self._bounds(h.numel()) for h in heads]
        width = sum(chunk for _, _, chunk in bounds)
        mine = heads[0].new_zeros(width)
        at = 0
        for head, (start, stop, chunk) in zip(heads, bounds):
            mine[at : at + stop - start].copy_(head[start:stop])
            at += chunk
        everyone = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(everyone, mine, group=self.group)
        stats.send((self.size - 1) * mine.numel() * mine.element_size())
        for r, theirs in enumerate(everyone):
            at = 0
            for head, (_, _, chunk) in zip(heads, bounds):
                start = min(r * chunk, head.numel())
                stop = min(start + chunk, head.numel())
                head[start:stop].copy_(theirs[at : at + stop - start])
                at += chunk
