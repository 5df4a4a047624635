"""The pseudo-gradient exchange of one fragment: ``Δ = θ_global - θ_local`` averaged over a group.

Owns what travels at a sync and how: the fragment's parameters laid out in gradient buckets
(:class:`~distoptim.comm.bucket.BucketPlan`, registration order, one flat buffer per bucket,
allocated once), ``Δ`` written straight into those buffers, and their mean over the group in
the chosen wire format:

* ``fp32``: a plain SUM all-reduce of ``Δ / n`` in the parameters' own dtype
  (:class:`~distoptim.comm.reducer.BucketAllReduce`; lossless, float64 stays float64);
* ``bf16`` / ``int8``: the two-phase quantized mean of :mod:`distoptim.comm.quantize`, with
  per-rank error-feedback residuals kept here, one pair per bucket.

On a group of one replica nothing travels, whatever the wire: the mean is ``Δ`` itself.

A sync is *launched* (``Δ`` formed, collectives started, nothing waited for), possibly carried
over inner steps, and *finished* (waited for; the mean lands in the bucket buffers, which the
caller reads as per-parameter views). With ``keep_payload`` a sync can be *settled* in between
-- its launched collective waited for, locally, without starting another -- into fixed
per-bucket payload slots a checkpoint holds: the reduced mean itself for ``fp32`` (the bucket
buffers), this rank's phase-1 shard mean for the quantized wires. A sync restored from the
slots finishes exactly as the original would have. The slots exist from construction, so a
checkpoint has the same structure at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.quantize import PendingMean, QuantizedMean, Residuals, codec_for
from distoptim.comm.reducer import BucketAllReduce, PendingReduce
from distoptim.comm.stats import CommStats

__all__ = ["FragmentExchange", "InFlight"]


@dataclass
class InFlight:
    """A launched (or restored) sync of one fragment: one pending mean per bucket."""

    pending: list[PendingReduce | PendingMean]


class FragmentExchange:
    """Averages ``Δ = global - local`` of one fragment over ``group`` (``group_size`` ranks).

    ``local`` are the model's parameters of the fragment, ``global_`` the global copies (same
    shapes, dtypes and devices); ``cap_bytes`` bounds one bucket's payload; ``keep_payload``
    allocates the payload slots (needed only when syncs stay in flight across steps).
    """

    def __init__(
        self,
        local: Sequence[torch.Tensor],
        global_: Sequence[torch.Tensor],
        wire: str,
        group: dist.ProcessGroup | None,
        group_size: int,
        stats: CommStats,
        error_feedback: bool,
        cap_bytes: int,
        keep_payload: bool,
    ) -> None:
        self.local = list(local)
        self.global_ = list(global_)
        self.wire = wire
        self.group_size = group_size
        self.plan = BucketPlan(self.local, cap_bytes=cap_bytes, order=range(len(self.local)))
        codec = codec_for(wire)
        self._allreduce: BucketAllReduce | None = None
        self._quantized: QuantizedMean | None = None
        self.residuals: list[Residuals] = []
        self.slots: list[torch.Tensor] = []
        self._scratch: list[torch.Tensor] = []
        buffers = [b.persistent_buffer().zero_() for b in self.plan.buckets]
        if codec is None or group_size == 1:
            self._allreduce = BucketAllReduce(group, group_size, WireFormat.parse(None), stats)
            if keep_payload:
                self.slots = [buf[: b.numel] for b, buf in zip(self.plan.buckets, buffers)]
            return
        self._quantized = QuantizedMean(codec, group, group_size, stats, error_feedback)
        for bucket, buffer in zip(self.plan.buckets, buffers):
            layout = self._quantized.layout(bucket.numel)
            if error_feedback:
                self.residuals.append(self._quantized.new_residuals(layout, buffer))
            else:
                self._scratch.append(buffer.new_zeros(layout.padded))
            if keep_payload:
                self.slots.append(buffer.new_zeros(layout.shard))

    @property
    def quantized(self) -> bool:
        """Whether this fragment's pseudo-gradients travel in a lossy wire format."""
        return self._quantized is not None

    # ---- the sync --------------------------------------------------------------------------
    def launch(self) -> InFlight:
        """Form ``Δ`` bucket by bucket and start each bucket's mean (no wait)."""
        pending: list[PendingReduce | PendingMean] = []
        for k, bucket in enumerate(self.plan.buckets):
            buffer = bucket.persistent_buffer()
            views = bucket.views(buffer)
            torch._foreach_copy_(views, [self.global_[i] for i in bucket.members])
            torch._foreach_sub_(views, [self.local[i].detach() for i in bucket.members])
            payload = buffer[: bucket.numel]
            if self._quantized is None:
                assert self._allreduce is not None
                pending.append(self._allreduce.launch(bucket, payload, self.group_size))
            else:
                residuals = self.residuals[k] if self.residuals else None
                scratch = self._scratch[k] if self._scratch else None
                pending.append(self._quantized.launch(payload, residuals, scratch))
        return InFlight(pending)

    def settle(self, sync: InFlight) -> None:
        """Wait for what ``sync`` launched (no new collective) and fill the payload slots."""
        for k, p in enumerate(sync.pending):
            if isinstance(p, PendingReduce):
                assert self._allreduce is not None
                self._allreduce.finish(p)  # the mean is in the bucket buffer: slot k
            else:
                assert self._quantized is not None
                self._quantized.settle(p, self.slots[k])

    def finish(self, sync: InFlight) -> list[torch.Tensor]:
        """Complete ``sync``; the mean ``Δ̄`` of every parameter of the fragment (views)."""
        grads: list[torch.Tensor | None] = [None] * len(self.local)
        for k, (bucket, p) in enumerate(zip(self.plan.buckets, sync.pending)):
            buffer = bucket.persistent_buffer()
            if isinstance(p, PendingReduce):
                assert self._allreduce is not None
                self._allreduce.finish(p)
            else:
                assert self._quantized is not None
                residuals = self.residuals[k] if self.residuals else None
                self._quantized.finish(p, buffer[: bucket.numel], residuals)
            for i, view in zip(bucket.members, bucket.views(buffer)):
                grads[i] = view
        return grads  # type: ignore[return-value]  # every member of every bucket is set

    def restore(self) -> InFlight:
        """The sync whose settled payload the slots hold (loaded from a checkpoint)."""
        pending: list[PendingReduce | PendingMean] = []
        for bucket, slot in zip(self.plan.buckets, self.slots):
            if self._quantized is None:
                pending.append(PendingReduce(bucket, slot, slot, None))
            else:
                layout = self._quantized.layout(bucket.numel)
                pending.append(PendingMean(layout, slot.dtype, None, None, shard_mean=slot))
        return InFlight(pending)
