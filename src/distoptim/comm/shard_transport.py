"""How weight-update sharding's two collectives travel: reduce-scatter and all-gather transports.

Owns the byte-moving part of sharding's collectives over one group of ``n`` ranks, for a flat
region of ``P = n s`` elements in which group rank ``r`` owns ``[r s, (r + 1) s)``
(:mod:`distoptim.comm.shard`):

* **reduce-scatter** -- rank ``r`` receives ``sum_q x_q[r s : (r + 1) s]`` (SUM, the region's
  dtype) in a tensor of ``s`` elements;
* **all-gather** -- every rank's own range of a flat buffer to every rank, *in place*: rank
  ``q``'s range lands at ``[q s, (q + 1) s)`` of every rank's buffer.

Three :class:`ShardTransport` strategies, chosen per backend (:func:`transport_for`):

* :class:`NativeTransport` -- the backend's own ``reduce_scatter`` / ``all_gather`` (NCCL and any
  backend other than gloo): bandwidth-optimal there.
* :class:`PairwiseExchange` -- gloo: built from point-to-point ``isend`` / ``irecv``. Rank
  ``r`` sends peer ``q`` the piece ``x_r[q s : (q + 1) s]`` straight from its input and
  receives the peers' pieces of its own range one after another (the first straight into the
  output, any further one into one temporary of ``s`` elements), adding them in the fixed order
  ``r - 1, r - 2, ..., r + 1`` and its own piece last; the all-gather sends its range to every
  peer and receives each peer's range straight into its place. Each rank sends ``(n - 1) s``
  elements per collective -- what a ring reduce-scatter or all-gather sends, half of an
  all-reduce -- reads its input only, and allocates nothing of the region's size. Gloo's own
  collectives do worse on both counts in torch 2.13: its reduce-scatter costs more than an
  all-reduce of the same bytes and both it and its all-gather allocate a temporary of the
  whole region (``benchmarks/zero.py`` measures the difference).
* :class:`AllReduceStandIn` -- the previous gloo method, kept for that comparison: an in-place
  SUM all-reduce of the whole region of which rank ``r`` keeps its range (twice the bytes of a
  reduce-scatter; it overwrites its input).

Every collective returns a :class:`Pending` whose ``wait()`` completes it (bounded by the
process group's timeout; ``RuntimeError`` from the backend if a peer left). Point-to-point
messages carry a tag per bucket (:data:`SCATTER_TAG` / :data:`GATHER_TAG` plus the bucket's
index), so buckets in flight together never pair with each other.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

__all__ = [
    "GATHER_TAG",
    "SCATTER_TAG",
    "AllReduceStandIn",
    "NativeTransport",
    "PairwiseExchange",
    "Pending",
    "ShardTransport",
    "transport_for",
]

SCATTER_TAG = 0x5D000
"""Tag of bucket ``b``'s reduce-scatter messages: ``SCATTER_TAG + b``."""
GATHER_TAG = 0x5E000
"""Tag of flat buffer ``b``'s all-gather messages: ``GATHER_TAG + b``."""

# newer torch releases name them *_single; older ones only have the *_tensor spelling
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending(Protocol):
    """A collective in flight: ``wait()`` completes it."""

    def wait(self) -> object: ...


class _Done:
    """A collective that completed when it was launched (nothing to wait for)."""

    def wait(self) -> None:
        return None


class ShardTransport(abc.ABC):
    """Reduce-scatter and in-place all-gather of flat regions over ``group`` (``size`` ranks).

    ``rank``: this rank's index in the group; ``ranks``: the global rank of each group index.
    """

    name: str = ""
    reads_input_only: bool = True
    """Whether the reduce-scatter leaves its input region unchanged."""
    scatter_factor: int = 1
    """Bytes a rank sends per reduce-scatter, in units of a ring reduce-scatter's."""

    def __init__(
        self, group: dist.ProcessGroup | None, size: int, rank: int, ranks: Sequence[int]
    ) -> None:
        self.group = group
        self.size = size
        self.rank = rank
        self.ranks = list(ranks)

    @abc.abstractmethod
    def reduce_scatter(
        self, region: torch.Tensor, out: torch.Tensor, tag: int
    ) -> tuple[torch.Tensor, Pending]:
        """Start summing ``region`` (``n s`` elements) over the group into this rank's range.

        Returns ``(result, pending)``: after ``pending.wait()``, ``result`` (``s`` elements:
        ``out`` itself, or a view of ``region``) holds the sum. ``tag``: the bucket's index.
        """

    @abc.abstractmethod
    def all_gather(self, flat: torch.Tensor, tag: int) -> Pending:
        """Start sending this rank's range of ``flat`` to every rank, in place."""

    def _range(self, flat: torch.Tensor, q: int) -> torch.Tensor:
        s = flat.numel() // self.size
        return flat[q * s : (q + 1) * s]


class NativeTransport(ShardTransport):
    """The backend's own collectives (NCCL, or any backend but gloo)."""

    name = "native"

    def reduce_scatter(
        self, region: torch.Tensor, out: torch.Tensor, tag: int
    ) -> tuple[torch.Tensor, Pending]:
        work = _reduce_scatter(out, region, group=self.group, async_op=True)
        return out, work

    def all_gather(self, flat: torch.Tensor, tag: int) -> Pending:
        # each rank's range is already at its place in the output: NCCL and gloo accept that
        return _all_gather(flat, self._range(flat, self.rank), group=self.group, async_op=True)


class AllReduceStandIn(ShardTransport):
    """An in-place all-reduce of the whole region stands in for the reduce-scatter."""

    name = "all_reduce"
    reads_input_only = False
    scatter_factor = 2

    def reduce_scatter(
        self, region: torch.Tensor, out: torch.Tensor, tag: int
    ) -> tuple[torch.Tensor, Pending]:
        work = dist.all_reduce(region, group=self.group, async_op=True)
        return self._range(region, self.rank), work

    def all_gather(self, flat: torch.Tensor, tag: int) -> Pending:
        return _all_gather(flat, self._range(flat, self.rank), group=self.group, async_op=True)


class _ExchangeSum:
    """A pairwise reduce-scatter in flight: the first receive is posted, the rest follow."""

    def __init__(
        self,
        transport: PairwiseExchange,
        region: torch.Tensor,
        out: torch.Tensor,
        tag: int,
        sends: list[dist.Work],
        first: dist.Work,
    ) -> None:
        self.transport = transport
        self.region = region
        self.out = out
        self.tag = tag
        self.sends = sends
        self.first = first

    def wait(self) -> None:
        t = self.transport
        n, r = t.size, t.rank
        self.first.wait()
        if n > 2:
            spare = torch.empty_like(self.out)
            for k in range(2, n):
                t._recv(spare, (r - k) % n, self.tag).wait()
                self.out.add_(spare)
        self.out.add_(t._range(self.region, r))
        for work in self.sends:
            work.wait()


class _AllOf:
    """Several point-to-point messages in flight: ``wait()`` waits for every one."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class PairwiseExchange(ShardTransport):
    """Gloo: reduce-scatter and all-gather from ``isend`` / ``irecv`` (see the module)."""

    name = "pairwise"

    def _global(self, q: int) -> int:
        return self.ranks[q]

    def _send(self, t: torch.Tensor, q: int, tag: int) -> dist.Work:
        work = dist.isend(t, dst=self._global(q), group=self.group, tag=tag)
        assert work is not None  # this rank is in the group
        return work

    def _recv(self, t: torch.Tensor, q: int, tag: int) -> dist.Work:
        work = dist.irecv(t, src=self._global(q), group=self.group, tag=tag)
        assert work is not None
        return work

    def reduce_scatter(
        self, region: torch.Tensor, out: torch.Tensor, tag: int
    ) -> tuple[torch.Tensor, Pending]:
        n, r = self.size, self.rank
        if n == 1:
            out.copy_(region)
            return out, _Done()
        tag += SCATTER_TAG
        sends = [self._send(self._range(region, q), q, tag) for q in _peers(r, n)]
        first = self._recv(out, (r - 1) % n, tag)
        return out, _ExchangeSum(self, region, out, tag, sends, first)

    def all_gather(self, flat: torch.Tensor, tag: int) -> Pending:
        n, r = self.size, self.rank
        tag += GATHER_TAG
        mine = self._range(flat, r)
        works = [self._send(mine, q, tag) for q in _peers(r, n)]
        works += [self._recv(self._range(flat, q), q, tag) for q in _peers(r, n)]
        return _AllOf(works)


def _peers(rank: int, n: int) -> list[int]:
    """The other ranks of a group of ``n``, starting after ``rank``."""
    return [(rank + k) % n for k in range(1, n)]


def transport_for(
    group: dist.ProcessGroup | None, size: int, rank: int, ranks: Sequence[int]
) -> ShardTransport:
    """The transport for ``group``'s backend: pairwise exchange on gloo, the native ones else."""
    if size > 1 and dist.get_backend(group) == "gloo":
        return PairwiseExchange(group, size, rank, ranks)
    return NativeTransport(group, size, rank, ranks)
