"""The pseudo-gradient exchange of one fragment: ``Δ = θ_global - θ_local`` averaged over a channel.

Owns what travels at a sync and how: the fragment's parameters laid out in gradient buckets
(:class:`~distoptim.comm.bucket.BucketPlan`, registration order, one flat buffer per bucket,
allocated once), ``Δ`` written straight into those buffers, and their mean over the members of
a :class:`~distoptim.comm.channel.Channel` (a process group's ranks, or whichever members a
round runs over) by the averaging scheme the wire format declares (:mod:`distoptim.comm.wire`):

* ``fp32``: a plain SUM all-reduce of ``Δ / n`` in the parameters' own dtype (lossless, float64
  stays float64);
* ``fp16`` / ``bf16`` / ``int8`` / ``int4`` / ``int2``: the two-phase encoded mean
  (:mod:`distoptim.comm.quantize`);
* ``topk:d[+v]``: gather-and-sum of every replica's top-k (:mod:`distoptim.comm.gather`).

A parameter that is a ``DTensor`` (FSDP2, tensor parallelism) takes part through its local
tensor (:mod:`distoptim.outer.groups`): buckets, buffers, residuals and payload slots are laid
out from the local tensors, so every wire format averages this process's piece with its
counterparts' pieces in the other replica groups, chunks within that piece, and the bytes
counted are the bytes this process sends.

Each bucket has the scheme's buffers (:class:`~distoptim.comm.averaging.MeanBuffers`): the
per-rank error-feedback residuals of the lossy formats, by name, and a payload slot. On a group
of one replica nothing travels, whatever the wire: the mean is ``Δ`` itself.

A sync is *formed* (``Δ`` written into the bucket buffers, and whether every value is finite
reported, so the replicas can refuse a non-finite one before anything travels), *launched*
(collectives started, nothing waited for), possibly carried over inner steps, and *finished*
(waited for; the mean lands in the bucket buffers, which the caller reads as per-parameter
views). With ``keep_payload`` a sync can be *settled* in between
-- its launched collective waited for, locally, without starting another -- into fixed
per-bucket payload slots a checkpoint holds: the reduced mean itself for ``fp32`` and top-k
(the bucket buffers), this rank's phase-1 shard mean for the two-phase formats. A sync restored
from the slots finishes exactly as the original would have. The slots exist from construction,
so a checkpoint has the same structure at every step.

:meth:`FragmentExchange.rebind` moves the next syncs to another channel. The buckets never
change; the scheme and its buffers depend on the channel's ``size`` (a two-phase mean's shard
layout, a gather's rows) and ``rank`` (the shard a two-phase mean owns), so when either differs
they are rebuilt: the error-feedback residuals then restart from zero (what the old encoding
dropped is forgotten, a bounded one-time loss) and the payload slots are empty. A channel of the
same size and rank (e.g. fewer contributors) keeps them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distoptim.comm.averaging import Mean, MeanBuffers, Pending
from distoptim.comm.bucket import BucketPlan
from distoptim.comm.channel import Channel
from distoptim.comm.stats import CommStats
from distoptim.comm.wire import Format
from distoptim.outer.groups import local_view

__all__ = ["FragmentExchange", "InFlight"]


@dataclass
class InFlight:
    """A launched (or restored) sync of one fragment: one pending mean per bucket."""

    pending: list[Pending]


class FragmentExchange:
    """Averages ``Δ = global - local`` of one fragment over ``channel``.

    ``params`` are the model's parameters of the fragment (plain tensors or DTensors),
    ``global_`` the global copies of what this process holds of them (their local tensors: same
    shapes, dtypes and devices as :attr:`local`); ``wire`` the format; ``cap_bytes`` bounds
    one bucket's payload; ``keep_payload`` allocates the payload slots (needed only when syncs
    stay in flight across steps).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        global_: Sequence[torch.Tensor],
        wire: Format,
        channel: Channel,
        stats: CommStats,
        error_feedback: bool,
        cap_bytes: int,
        keep_payload: bool,
    ) -> None:
        self.params = list(params)
        self.global_ = list(global_)
        self.wire = wire
        # laid out by the global copies: the local tensors' shapes, dtypes and devices, and no
        # reference to a local tensor object a sharding wrapper may replace
        self.plan = BucketPlan(self.global_, cap_bytes=cap_bytes, order=range(len(self.global_)))
        self._stats = stats
        self._error_feedback = error_feedback
        self._keep_payload = keep_payload
        self._payloads = [b.persistent_buffer().zero_()[: b.numel] for b in self.plan.buckets]
        self.channel = channel
        self._mean, self._buffers = self._scheme(channel)

    @property
    def local(self) -> list[torch.Tensor]:
        """What this process holds of the fragment's parameters, aliasing them: a plain
        parameter itself, a ``DTensor``'s local tensor (see
        :func:`~distoptim.outer.groups.local_view`)."""
        return [local_view(p) for p in self.params]

    def _scheme(self, channel: Channel) -> tuple[Mean, list[MeanBuffers]]:
        """The averaging scheme over ``channel`` and its buffers for every bucket (zeroed)."""
        mean = self.wire.mean(channel, self._stats, self._error_feedback)
        return mean, [mean.buffers(p, self._keep_payload) for p in self._payloads]

    @property
    def group_size(self) -> int:
        """Members of the channel the next sync runs over."""
        return self.channel.size

    def rebind(self, channel: Channel) -> bool:
        """Run the next syncs over ``channel``; True when the scheme was rebuilt.

        Call it between syncs (a sync launched over the old channel must be finished first).
        With the same ``size`` and ``rank`` the scheme and its buffers (residuals, slots) are
        kept and only the channel changes; otherwise they are rebuilt for the new layout and
        the error-feedback residuals restart from zero (see the module).
        """
        old, self.channel = self.channel, channel
        if (channel.size, channel.rank) == (old.size, old.rank):
            self._mean.channel = channel
            return False
        self._mean, self._buffers = self._scheme(channel)
        return True

    @property
    def finishes_with_collective(self) -> bool:
        """Whether finishing a sync runs a collective (the two-phase mean's phase 2)."""
        return self._mean.finishes_with_collective

    @property
    def residuals(self) -> list[dict[str, torch.Tensor]]:
        """Per bucket, this rank's error-feedback residuals by name (``[]`` when none are kept)."""
        return [b.residuals for b in self._buffers if b.residuals]

    @property
    def slots(self) -> list[torch.Tensor]:
        """Per bucket, the payload slot of a settled sync (``[]`` without ``keep_payload``)."""
        return [b.slot for b in self._buffers if b.slot is not None]

    # ---- the sync --------------------------------------------------------------------------
    def form(self) -> bool:
        """Write ``Δ = global - local`` into the bucket buffers; True iff every value is finite.

        Nothing travels and no residual changes: :meth:`launch` sends what was formed.
        """
        local = self.local
        for bucket in self.plan.buckets:
            views = bucket.views(bucket.persistent_buffer())
            torch._foreach_copy_(views, [self.global_[i] for i in bucket.members])
            torch._foreach_sub_(views, [local[i].detach() for i in bucket.members])
        return all(_finite(payload) for payload in self._payloads)

    def zero(self) -> None:
        """Write ``Δ = 0`` (a replica that takes part in a sync without contributing)."""
        for payload in self._payloads:
            payload.zero_()

    def launch(self) -> InFlight:
        """Start each bucket's mean of the ``Δ`` :meth:`form` wrote (no wait)."""
        pending: list[Pending] = [
            self._mean.launch(payload, buffers)
            for payload, buffers in zip(self._payloads, self._buffers)
        ]
        return InFlight(pending)

    def settle(self, sync: InFlight) -> None:
        """Wait for what ``sync`` launched (no new collective) and fill the payload slots."""
        for p, buffers in zip(sync.pending, self._buffers):
            self._mean.settle(p, buffers)

    def finish(self, sync: InFlight) -> list[torch.Tensor]:
        """Complete ``sync``; the mean ``Δ̄`` of every parameter of the fragment (views)."""
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for bucket, p, payload, buffers in zip(
            self.plan.buckets, sync.pending, self._payloads, self._buffers
        ):
            self._mean.finish(p, payload, buffers)
            for i, view in zip(bucket.members, bucket.views(bucket.persistent_buffer())):
                grads[i] = view
        return grads  # type: ignore[return-value]  # every member of every bucket is set

    def restore(self) -> InFlight:
        """The sync whose settled payload the slots hold (loaded from a checkpoint)."""
        return InFlight([self._mean.restore(p, b) for p, b in zip(self._payloads, self._buffers)])


def _finite(t: torch.Tensor) -> bool:
    """Every value of ``t`` is finite: a sum is finite only if every term is (NaN and Inf
    propagate), and only when it is not (maybe an overflow of finite terms) is every value
    tested."""
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())
