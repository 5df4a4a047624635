"""The flat shard layout of weight-update sharding: which elements of each bucket a rank owns.

Owns the element-wise partition of Xu et al. (2020) / ZeRO stage 1 over *flat buckets* (no
communication). A bucket plan built with ``pad_to=n`` (:class:`~distoptim.comm.bucket.
BucketPlan`) has, per bucket, a gradient region of ``P = n s`` elements (the members'
gradients back to back, then zeros); group rank ``r`` owns the elements ``[r s, (r + 1) s)`` of
every bucket -- exactly what a reduce-scatter of the region delivers to it. Ownership ignores
parameter boundaries: a parameter may be split between ranks, and a rank's range of one bucket
may hold pieces of many parameters.

A :class:`Piece` is one parameter's part of one rank's range (``[start, stop)`` in bucket
coordinates); the pieces of a range are in member order, so consecutive pieces are adjacent in
memory. Every element of every parameter of the plan belongs to exactly one piece of one rank
(the invariant :func:`ShardLayout.check` verifies), so updating each rank's pieces element-wise
updates every parameter exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from distoptim.comm.bucket import BucketPlan

__all__ = ["Piece", "ShardLayout"]


@dataclass(frozen=True)
class Piece:
    """Member ``member`` (index into ``plan.params``) at ``[start, stop)`` of bucket ``bucket``.

    ``first`` is the offset of ``start`` within the member's own flat elements.
    """

    member: int
    bucket: int
    start: int
    stop: int
    first: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


class ShardLayout:
    """Rank ``rank``'s ranges of every bucket of ``plan`` (built with ``pad_to=num_shards``)."""

    def __init__(self, plan: BucketPlan, num_shards: int, rank: int) -> None:
        if not 0 <= rank < num_shards:
            raise ValueError(f"rank {rank} outside range(num_shards={num_shards})")
        self.plan = plan
        self.num_shards = num_shards
        self.rank = rank
        self.shard_size: list[int] = []
        self.pieces: list[list[Piece]] = []
        for bucket in plan.buckets:
            if bucket.padded % num_shards:
                raise ValueError(
                    f"bucket {bucket.index} holds {bucket.padded} elements, not a multiple of "
                    f"{num_shards}: build the plan with pad_to={num_shards}"
                )
            size = bucket.padded // num_shards
            lo, hi = rank * size, (rank + 1) * size
            pieces = []
            for member, offset, shape in zip(bucket.members, bucket.offsets, bucket.shapes):
                start, stop = max(lo, offset), min(hi, offset + shape.numel())
                if start < stop:
                    pieces.append(Piece(member, bucket.index, start, stop, start - offset))
            self.shard_size.append(size)
            self.pieces.append(pieces)

    def start_of(self, bucket: int) -> int:
        """First element of this rank's range of ``bucket``."""
        return self.rank * self.shard_size[bucket]

    def owned(self) -> int:
        """Parameter elements this rank owns (its pieces, padding excluded)."""
        return sum(p.numel for pieces in self.pieces for p in pieces)

    @staticmethod
    def check(plan: BucketPlan, num_shards: int) -> None:
        """Every element of every member belongs to exactly one rank's piece (raise if not)."""
        covered = [0] * len(plan.params)
        for rank in range(num_shards):
            for pieces in ShardLayout(plan, num_shards, rank).pieces:
                for piece in pieces:
                    covered[piece.member] += piece.numel
        want = [p.numel() for p in plan.params]
        if covered != want:
            raise AssertionError(f"pieces cover {covered} elements per member, not {want}")
