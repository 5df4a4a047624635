"""The collectives of weight-update sharding: reduce-scatter rounds and the parameter all-gather.

Owns the communication of ``CrossShardOptimizer(shard_optimizer_state=True)`` (Xu et al. 2020,
ZeRO stage 1), over the flat layout of :mod:`distoptim.comm.shard`:

* :class:`ShardRound` -- one round: each bucket's gradient region is reduce-scattered (SUM)
  into this rank's shard, launched strictly in bucket order (from backward hooks with overlap,
  as :class:`~distoptim.comm.reducer.ReduceRound` does), then one small :class:`ControlReduce`
  all-reduce carries every bucket's presence flags and the round's sequence words. A
  reduce-scatter delivers each element to one rank only, so the flags and words cannot ride in
  the buckets as they do in an all-reduce round; the control message is the last collective of
  the round, so its words can say what became known last (an edit of ``.grad`` after launch).
  Nothing is applied before every rank has read every rank's words.
* :func:`all_gather_shards` -- after the update, every rank's updated parameter range goes to
  every rank, in place in the flat parameter buffers.

How the bytes travel is the :class:`~distoptim.comm.shard_transport.ShardTransport`'s (the
backend's own collectives, or gloo's pairwise exchange). Each round allocates the shards it
reduces into (``1/n`` of its buckets), so nothing of the gradients' size outlives the step.

Math: after :meth:`ShardRound.wait_all` rank ``r``'s shard of bucket ``b`` holds
``sum_q x_q[r s : (r + 1) s] / divisor`` (``x_q`` = rank ``q``'s packed gradient region). The
division happens on the shard, after the sum (``1/n`` of the elements), except with a 16-bit
wire, where it happens before encoding so float16 sums stay in range. The reduce-scatter reads
its input buffers only, except where an all-reduce stands in for it
(:class:`~distoptim.comm.shard_transport.AllReduceStandIn`, kept for comparison): that one sums
them in place, so callers whose ``.grad`` lives in the buckets then reduce a copy
(:attr:`ShardRound.reduces_in_place`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.reducer import ReduceRound
from distoptim.comm.shard import ShardLayout
from distoptim.comm.shard_transport import Pending, ShardTransport
from distoptim.comm.stats import CommStats, ring_allreduce_bytes, ring_half_bytes

__all__ = [
    "BucketReduceScatter",
    "ControlReduce",
    "PendingShard",
    "ShardRound",
    "all_gather_shards",
]


@dataclass
class PendingShard:
    """One launched reduce-scatter: where the shard goes, the wire tensors, the work handle."""

    bucket: Bucket
    out: torch.Tensor
    wire_out: torch.Tensor
    divisor: float  # still to apply to the shard (1 when applied before the wire)
    work: Pending | None


class BucketReduceScatter:
    """SUM reduce-scatters of bucket gradient regions into per-rank shards, over ``transport``.

    With ``group_size == 1`` nothing is sent: the shard is the whole region. The input buffer is
    only read, unless the transport's reduce-scatter sums in place
    (``transport.reads_input_only`` False: the all-reduce stand-in).
    """

    def __init__(
        self, transport: ShardTransport, group_size: int, wire: WireFormat, stats: CommStats
    ) -> None:
        self.transport = transport
        self.group_size = group_size
        self.wire = wire
        self.stats = stats

    @property
    def reads_input_only(self) -> bool:
        """Does a reduce-scatter leave its input buffer unchanged?"""
        return self.group_size == 1 or self.transport.reads_input_only

    def launch(
        self, bucket: Bucket, buffer: torch.Tensor, out: torch.Tensor, divisor: float
    ) -> PendingShard:
        """Start reducing ``buffer``'s gradient region into ``out`` (this rank's shard)."""
        region = buffer[: bucket.padded]
        wire_dtype = self.wire.wire_dtype(region.dtype)
        if wire_dtype != region.dtype:  # divide and encode in one pass, before the sum
            wire = torch.empty(region.shape, dtype=wire_dtype, device=region.device)
            if divisor != 1:
                torch.div(region, divisor, out=wire)
            else:
                wire.copy_(region)
            divisor = 1
        else:
            wire = region
        work = None
        n = self.group_size
        if n == 1:
            wire_out = wire
        else:
            wire_out = (
                out if wire_dtype == out.dtype else out.new_empty(out.shape, dtype=wire_dtype)
            )
            nbytes = ring_half_bytes(wire.numel() * wire.element_size(), n)
            self.stats.send(nbytes * self.transport.scatter_factor)
            wire_out, work = self.transport.reduce_scatter(wire, wire_out, bucket.index)
        return PendingShard(bucket, out, wire_out, divisor, work)

    @staticmethod
    def finish(pending: PendingShard) -> torch.Tensor:
        """Wait for ``pending`` (bounded by the group's timeout); return the divided shard."""
        if pending.work is not None:
            pending.work.wait()
        out = pending.out
        if pending.divisor != 1:
            torch.div(pending.wire_out, pending.divisor, out=out)
        elif pending.wire_out is not out:
            out.copy_(pending.wire_out)
        return out


class ControlReduce:
    """The round's last collective: every bucket's presence flags, then the sequence words.

    Layout (float32, on ``device``): ``[flags of bucket 0 | flags of bucket 1 | ... | words]``.
    Flags are 0/1 per member and rank, words are bytes: exact in float32 after the SUM.
    """

    def __init__(
        self,
        plan: BucketPlan,
        words: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        group_size: int,
        stats: CommStats,
    ) -> None:
        self.plan = plan
        self.starts: list[int] = []
        total = 0
        for bucket in plan.buckets:
            self.starts.append(total)
            total += len(bucket.members)
        self.nflags = total
        self.buffer = torch.zeros(total + words, dtype=torch.float32, device=device)
        self.group = group
        self.group_size = group_size
        self.stats = stats

    def flags_of(self, bucket: Bucket) -> torch.Tensor:
        start = self.starts[bucket.index]
        return self.buffer[start : start + len(bucket.members)]

    @property
    def trailer(self) -> torch.Tensor:
        return self.buffer[self.nflags :]

    def reduce(self) -> None:
        """SUM all-reduce the flags and words (blocking; bounded by the group's timeout)."""
        if self.group_size > 1:
            nbytes = self.buffer.numel() * self.buffer.element_size()
            self.stats.send(ring_allreduce_bytes(nbytes, self.group_size))
            dist.all_reduce(self.buffer, group=self.group)

    def present(self) -> list[bool]:
        """Per parameter of the plan: did any rank have a gradient for it?"""
        flags = (self.buffer[: self.nflags] != 0).tolist()
        present = [False] * len(self.plan.params)
        for bucket in self.plan.buckets:
            start = self.starts[bucket.index]
            for k, i in enumerate(bucket.members):
                present[i] = flags[start + k]
        return present


class ShardRound(ReduceRound):
    """All buckets of ``plan`` reduce-scattered once, in bucket order, then the control message.

    Each bucket's shard (``layout.shard_size[b]`` elements) is allocated when the bucket is
    launched and belongs to the round; ``grads_of`` / ``buffer_of`` /
    ``divisor`` / ``what`` are :class:`~distoptim.comm.reducer.ReduceRound`'s. The plan has no
    flag regions and no trailer (``flags=False``): :attr:`control` carries both, so no bucket
    is held back -- backward hooks may launch every one of them.
    """

    def __init__(
        self,
        plan: BucketPlan,
        reducer: BucketReduceScatter,
        layout: ShardLayout,
        control: ControlReduce,
        grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
        buffer_of: Callable[[Bucket], torch.Tensor],
        divisor: float,
        what: str = "a gradient reduce-scatter",
    ) -> None:
        super().__init__(plan, reducer, grads_of, buffer_of, divisor, what)  # type: ignore[arg-type]
        self.layout = layout
        self.control = control

    @property  # type: ignore[override]
    def reduces_in_place(self) -> bool:
        """A reduce-scatter only reads the packed buffers; its all-reduce stand-in does not."""
        return not self.reducer.reads_input_only  # type: ignore[attr-defined]

    @property
    def launchable(self) -> int:
        return len(self.plan)

    def trailer(self, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.control.trailer

    def present(self, buffers: Sequence[torch.Tensor]) -> list[bool]:
        return self.control.present()

    def _pack(
        self, bucket: Bucket, buffer: torch.Tensor, grads: Sequence[torch.Tensor | None]
    ) -> None:
        source = None if self.source_of is None else self.source_of(bucket)
        bucket.pack(buffer, grads, flags=self.control.flags_of(bucket), source=source)

    def _launch(self, bucket: Bucket, buffer: torch.Tensor) -> PendingShard:
        reducer: BucketReduceScatter = self.reducer  # type: ignore[assignment]
        size = self.layout.shard_size[bucket.index]
        out = torch.empty(size, dtype=bucket.dtype, device=bucket.device)
        return reducer.launch(bucket, buffer, out, self.divisor)

    def wait_all(
        self, write_trailer: Callable[[torch.Tensor], None] | None = None
    ) -> list[torch.Tensor]:
        """Launch what is left, wait for every shard, then reduce the control message.

        ``write_trailer(view)`` writes this rank's words into the control message. Returns
        the shards in bucket order. Raises ``DesyncError`` if a collective fails.
        """
        while self.next_bucket < len(self.plan):
            self.launch_next()
        out = []
        for k, p in enumerate(self.pending):
            try:
                out.append(BucketReduceScatter.finish(p))
            except RuntimeError as exc:
                raise self.peer_lost(f"bucket {k + 1} of {len(self.pending)}", exc) from exc
        trailer = self.control.trailer
        if write_trailer is None:
            trailer.zero_()
        else:
            write_trailer(trailer)
        try:
            self.control.reduce()
        except RuntimeError as exc:
            raise self.peer_lost("its flags and sequence words", exc) from exc
        return out


def all_gather_shards(
    flats: Sequence[torch.Tensor], transport: ShardTransport, stats: CommStats
) -> None:
    """Every rank's range of each flat buffer to every rank, in place (blocking).

    ``flats[b]`` holds ``n s`` elements; group rank ``r``'s range ``[r s, (r + 1) s)`` is its
    input, the whole buffer the output. All buffers are launched before the first wait.
    Raises ``RuntimeError`` (from the backend) if a peer left.
    """
    n = transport.size
    if n == 1:
        return
    works = []
    for b, flat in enumerate(flats):
        stats.send(ring_half_bytes(flat.numel() * flat.element_size(), n))
        works.append(transport.all_gather(flat, b))
    for work in works:
        work.wait()
