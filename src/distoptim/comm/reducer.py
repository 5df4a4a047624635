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
computed in the wire dtype and stored in the bucket dtype; a bucket's trailer (the round's
sequence words, :mod:`distoptim.comm.guard`) is summed but never divided.

A round whose plan has a trailer *holds* its last bucket: backward hooks may launch every other
bucket early, the last one is launched by :meth:`ReduceRound.wait_all` together with the words
the caller writes into its trailer then. A collective that fails while being waited for (a peer
left the group) raises :class:`~distoptim.comm.guard.DesyncError` naming the round and bucket.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.guard import DesyncError
from distoptim.comm.stats import CommStats, ring_allreduce_bytes

__all__ = ["BucketAllReduce", "PendingReduce", "ReduceRound", "grads_changed"]


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
        """Start reducing the packed ``buffer`` of ``bucket`` (``buffer /= divisor`` first).

        The division spares the bucket's trailer (the last ``bucket.trailer`` elements).
        """
        if divisor != 1:  # before encoding: a float16 sum then stays in range
            (buffer[: buffer.numel() - bucket.trailer] if bucket.trailer else buffer).div_(divisor)
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
    for ``.grad``, a fresh one where results must not alias anything); ``source_of(bucket)``,
    if given, the buffer the gradients may already sit in (see :meth:`Bucket.pack`). ``what``
    names the round in errors (e.g. ``"step 3's reduction"``).
    """

    def __init__(
        self,
        plan: BucketPlan,
        reducer: BucketAllReduce,
        grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
        buffer_of: Callable[[Bucket], torch.Tensor],
        divisor: float,
        what: str = "a gradient reduction",
        source_of: Callable[[Bucket], torch.Tensor] | None = None,
    ) -> None:
        self.plan = plan
        self.reducer = reducer
        self.grads_of = grads_of
        self.buffer_of = buffer_of
        self.source_of = source_of
        self.divisor = divisor
        self.what = what
        self.pending: list[Any] = []  # one launched collective per bucket, in bucket order
        self._inputs: list[list[tuple[torch.Tensor | None, int]]] = []

    @property
    def next_bucket(self) -> int:
        """Index of the next bucket to launch (``len(plan)`` once all are in flight)."""
        return len(self.pending)

    @property
    def launchable(self) -> int:
        """Buckets that may be launched before :meth:`wait_all`: all but a held last one."""
        n = len(self.plan)
        return n - 1 if n and self.plan.buckets[-1].trailer else n

    def launch_next(self, write_trailer: Callable[[torch.Tensor], None] | None = None) -> None:
        """Pack and launch the next bucket; ``write_trailer(view)`` fills its trailer, if any."""
        bucket = self.plan.buckets[self.next_bucket]
        buffer = self.buffer_of(bucket)
        grads = self.grads_of(bucket)
        self._pack(bucket, buffer, grads)
        if bucket.trailer:
            trailer = bucket.trailer_of(buffer)
            if write_trailer is None:
                trailer.zero_()
            else:
                write_trailer(trailer)
        self._inputs.append([(g, -1 if g is None else g._version) for g in grads])
        self.pending.append(self._launch(bucket, buffer))

    def _pack(
        self, bucket: Bucket, buffer: torch.Tensor, grads: Sequence[torch.Tensor | None]
    ) -> None:
        bucket.pack(
            buffer, grads, source=None if self.source_of is None else self.source_of(bucket)
        )

    def _launch(self, bucket: Bucket, buffer: torch.Tensor) -> Any:
        return self.reducer.launch(bucket, buffer, self.divisor)

    def launch_launchable(self) -> None:
        """Launch every bucket not yet in flight except a held last one."""
        while self.next_bucket < self.launchable:
            self.launch_next()

    def wait_all(
        self, write_trailer: Callable[[torch.Tensor], None] | None = None
    ) -> list[torch.Tensor]:
        """Launch what is left (the held bucket with ``write_trailer``), wait for everything.

        Returns the reduced buffers in bucket order. Raises
        :class:`~distoptim.comm.guard.DesyncError` if a collective fails while waited for.
        """
        while self.next_bucket < len(self.plan):
            self.launch_next(write_trailer)
        out = []
        for k, p in enumerate(self.pending):
            try:
                out.append(self.reducer.finish(p))
            except RuntimeError as exc:
                raise self.peer_lost(f"bucket {k + 1} of {len(self.pending)}", exc) from exc
        return out

    def peer_lost(self, where: str, exc: BaseException) -> DesyncError:
        """The error of a collective of this round that failed while waited for."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return DesyncError(
            f"CrossShardOptimizer: rank {rank}: {self.what} failed while waiting for {where}: "
            f"{exc}\nA peer stopped taking part in this group's collectives: it raised (its "
            "own error is the real cause), returned, crashed, or entered a different collective."
        )

    reduces_in_place = True
    """The collective writes its result into the packed buffers (an all-reduce does)."""

    def trailer(self, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        """The reduced sequence words of this round (the last bucket's trailer)."""
        return self.plan.buckets[-1].trailer_of(buffers[-1])

    def present(self, buffers: Sequence[torch.Tensor]) -> list[bool]:
        """Per parameter of the plan: did any rank have a gradient for it (after the SUM)?"""
        present = [False] * len(self.plan.params)
        for bucket, buffer in zip(self.plan.buckets, buffers):
            for i, here in zip(bucket.members, bucket.present(buffer)):
                present[i] = here
        return present

    def snapshot(self) -> list[list[tuple[weakref.ref[torch.Tensor] | None, int]]]:
        """Per bucket and member: the gradient its launch read (weakly) and its ``_version``.

        Compared later with :func:`grads_changed` without keeping old gradients alive.
        """
        return [
            [(None if g is None else weakref.ref(g), version) for g, version in inputs]
            for inputs in self._inputs
        ]

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


def grads_changed(
    plan: BucketPlan,
    grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
    snapshot: Sequence[Sequence[tuple[weakref.ref[torch.Tensor] | None, int]]] | None,
) -> bool:
    """Does some member of ``plan`` now have a gradient that a round's launch did not read?

    ``snapshot``: :meth:`ReduceRound.snapshot` of an earlier round over ``plan`` (None: no such
    round, so any gradient is new). A gradient counts as new when it is another tensor or was
    written in place since (its ``_version``); gradients that became None do not count.
    """
    for k, bucket in enumerate(plan.buckets):
        before = snapshot[k] if snapshot is not None and k < len(snapshot) else None
        for j, g in enumerate(grads_of(bucket)):
            if g is None:
                continue
            if before is None or j >= len(before):
                return True
            ref, version = before[j]
            if ref is None or ref() is not g or g._version != version:
                return True
    return False
