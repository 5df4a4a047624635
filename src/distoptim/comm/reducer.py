"""Asynchronous bucket all-reduces: launching them in order, and waiting for them.

Owns the collective calls for gradient buckets. :class:`BucketAllReduce` turns one packed bucket
buffer into an in-flight ``dist.all_reduce(async_op=True)`` (dividing first when averaging,
encoding to the wire dtype, counting the collective and paying the emulated link via
:meth:`CommStats.send`) and finishes it (wait, decode back into the buffer). :class:`ReduceRound`
is one step's worth of those, launched strictly in bucket order -- the invariant that keeps
every rank's collectives paired even when some ranks launch a bucket from a backward hook and
others only at ``step()``.

Math: after :meth:`ReduceRound.wait_all` every buffer holds ``sum_r (x_r / divisor)`` over the
ranks ``r`` of the group (``x_r`` = rank ``r``'s packed bucket, zeros where it had no gradient),
computed in the wire dtype and stored in the bucket dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.stats import CommStats, ring_allreduce_bytes

__all__ = ["BucketAllReduce", "PendingReduce", "ReduceRound"]


@dataclass
class PendingReduce:
    """One launched bucket all-reduce: the bucket buffer, its wire tensor and the work handle."""

    bucket: Bucket
    buffer: torch.Tensor
    wire: torch.Tensor
    work: dist.Work | None


class BucketAllReduce:
    """SUM all-reduces of bucket buffers over ``group`` (``None``: the default group).

    With ``group_size == 1`` nothing is sent: the buffer is its own sum.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        group_size: int,
        wire: WireFormat,
        stats: CommStats,
    ) -> None:
        self.group = group
        self.group_size = group_size
        self.wire = wire
        self.stats = stats

    def launch(self, bucket: Bucket, buffer: torch.Tensor, divisor: float) -> PendingReduce:
        """Start reducing the packed ``buffer`` of ``bucket`` (``buffer /= divisor`` first)."""
        if divisor != 1:
            buffer.div_(divisor)  # before encoding: a float16 sum then stays in range
        wire = self.wire.encode(buffer)
        work = None
        if self.group_size > 1:
            nbytes = ring_allreduce_bytes(wire.numel() * wire.element_size(), self.group_size)
            self.stats.send(nbytes)
            work = dist.all_reduce(wire, group=self.group, async_op=True)
        return PendingReduce(bucket, buffer, wire, work)

    def finish(self, pending: PendingReduce) -> torch.Tensor:
        """Wait for ``pending`` (bounded by the group's timeout) and return its decoded buffer."""
        if pending.work is not None:
            pending.work.wait()
        self.wire.decode(pending.wire, pending.buffer)
        return pending.buffer


class ReduceRound:
    """All buckets of ``plan`` reduced once, launched in bucket order.

    ``grads_of(bucket)`` gives the member gradients (None allowed) to pack when a bucket is
    launched; ``buffer_of(bucket)`` the buffer to pack them into (the bucket's persistent buffer
    for ``.grad``, a fresh one where results must not alias anything).
    """

    def __init__(
        self,
        plan: BucketPlan,
        reducer: BucketAllReduce,
        grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
        buffer_of: Callable[[Bucket], torch.Tensor],
        divisor: float,
    ) -> None:
        self.plan = plan
        self.reducer = reducer
        self.grads_of = grads_of
        self.buffer_of = buffer_of
        self.divisor = divisor
        self.pending: list[PendingReduce] = []
        self._inputs: list[list[tuple[torch.Tensor | None, int]]] = []

    @property
    def next_bucket(self) -> int:
        """Index of the next bucket to launch (``len(plan)`` once all are in flight)."""
        return len(self.pending)

    def launch_next(self) -> None:
        bucket = self.plan.buckets[self.next_bucket]
        buffer = self.buffer_of(bucket)
        grads = self.grads_of(bucket)
        bucket.pack(buffer, grads)
        self._inputs.append([(g, -1 if g is None else g._version) for g in grads])
        pending = self.reducer.launch(bucket, buffer, self.divisor)
        self.pending.append(pending)

    def launch_remaining(self) -> None:
        while self.next_bucket < len(self.plan):
            self.launch_next()

    def wait_all(self) -> list[torch.Tensor]:
        """Launch what is left, wait for everything; the reduced buffers in bucket order."""
        self.launch_remaining()
        return [self.reducer.finish(p) for p in self.pending]

    def inputs_unchanged(self) -> bool:
        """Are the gradients the launched buckets read still the same tensors, unmodified?

        ``Tensor._version`` counts in-place writes, so an edit after packing (clipping,
        another accumulation, ``zero_grad``) or a replaced/removed gradient is detected.
        """
        for bucket, before in zip(self.plan.buckets, self._inputs):
            for g, (old, version) in zip(self.grads_of(bucket), before):
                if g is not old or (g is not None and g._version != version):
                    return False
        return True

    def drain(self) -> None:
        """Wait for what is in flight and drop the results (keeps collectives paired)."""
        for p in self.pending:
            if p.work is not None:
                p.work.wait()
        self.pending = []
        self._inputs = []
