"""Averaging schemes: the mean of one flat buffer per rank over a group, launched and finished.

Owns the interface every averaging scheme of the wire formats (:mod:`distoptim.comm.wire`)
implements, and the plain one. A scheme computes, on every rank ``r`` of a group of ``n``,

    mean = Σ_r (D(Q(x_r)) / n)           (the same values on every rank)

of the payloads ``x_r`` (1-D, the same size on every rank), in four moves:

* :meth:`Mean.launch` -- encode ``x_r`` and start the first collective (no wait);
* :meth:`Mean.settle` -- wait for what was launched, locally, without starting another
  collective, and keep the result in the buffers' payload slot (so a checkpoint can hold it);
* :meth:`Mean.finish` -- complete the mean (a scheme may run one more collective here:
  :attr:`Mean.finishes_with_collective`) and write it into the payload;
* :meth:`Mean.restore` -- a launched mean rebuilt from a payload slot loaded from a checkpoint,
  which finishes exactly as the original would have.

Each scheme runs over a :class:`~distoptim.comm.channel.Channel` (the members of the round:
``n`` = ``channel.size`` take part in every collective, ``channel.contributors`` of them count,
the divisor of the mean -- ``n`` on a plain group), issues its collectives through it from one
method, counts the bytes this rank puts on the wire there
(:meth:`~distoptim.comm.stats.CommStats.send`) and keeps its per-payload state
(error-feedback residuals by name, scratch, slot) in a :class:`MeanBuffers` made once per
payload. Every copy is divided by the divisor before the sum, so finite inputs never overflow
into ``inf`` where their mean is finite (up to the last ``n`` units in the last place below the
dtype's largest value, as for the plain all-reduce).

:class:`SumMean` is the plain scheme: ``x_r / n`` in a cast :class:`WireFormat`, one SUM
all-reduce (lossless for ``fp32``; with ``n = 1`` nothing is sent and nothing divided).
The two-phase quantized mean is :mod:`distoptim.comm.quantize`, gather-and-sum
:mod:`distoptim.comm.gather`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from distoptim.comm.channel import Channel, Handle
from distoptim.comm.compression import WireFormat
from distoptim.comm.stats import CommStats, ring_allreduce_bytes

__all__ = ["Mean", "MeanBuffers", "Pending", "PendingSum", "SumMean"]


@dataclass
class MeanBuffers:
    """A scheme's state for one payload, allocated once.

    ``residuals``: error-feedback residuals by name (empty without error feedback; per rank,
    part of a checkpoint); ``scratch``: a padded input buffer when no residual holds it;
    ``slot``: where :meth:`Mean.settle` keeps the settled result (``None`` unless asked for).
    """

    residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    scratch: torch.Tensor | None = None
    slot: torch.Tensor | None = None


class Pending:
    """A launched (or restored) mean of one payload; each scheme has its own."""


class Mean(abc.ABC):
    """An averaging scheme over ``channel``; see the module."""

    finishes_with_collective: bool = False
    """Whether :meth:`finish` runs a collective (then every rank must reach it in step)."""

    def __init__(self, channel: Channel, stats: CommStats) -> None:
        self.channel = channel
        self.stats = stats

    @property
    def group_size(self) -> int:
        """Members taking part in every collective (``channel.size``)."""
        return self.channel.size

    @abc.abstractmethod
    def buffers(self, payload: torch.Tensor, keep_payload: bool) -> MeanBuffers:
        """The state for ``payload`` (1-D); with ``keep_payload`` a slot for :meth:`settle`."""

    @abc.abstractmethod
    def launch(self, payload: torch.Tensor, buffers: MeanBuffers) -> Pending:
        """Encode ``payload`` and start the first collective (no wait)."""

    @abc.abstractmethod
    def settle(self, pending: Pending, buffers: MeanBuffers) -> None:
        """Wait for what ``pending`` launched (no new collective); keep it in ``buffers.slot``."""

    @abc.abstractmethod
    def finish(self, pending: Pending, payload: torch.Tensor, buffers: MeanBuffers) -> None:
        """Complete ``pending`` and write the mean into ``payload``."""

    @abc.abstractmethod
    def restore(self, payload: torch.Tensor, buffers: MeanBuffers) -> Pending:
        """The settled mean whose result ``buffers.slot`` holds (loaded from a checkpoint)."""


@dataclass
class PendingSum(Pending):
    """A launched SUM all-reduce: the payload, the tensor on the wire, the work handle."""

    payload: torch.Tensor
    wire: torch.Tensor
    work: Handle | None


class SumMean(Mean):
    """``Σ_r (x_r / c)`` by one SUM all-reduce in ``wire``'s dtype, in place in the payload.

    ``c`` is ``channel.contributors`` (``n`` on a plain group). The division comes first (a
    float16 sum then stays in range); with ``wire`` ``fp32`` the buffer travels in its own dtype
    and the mean is exact up to the sum's rounding. The result is written into the payload,
    which is therefore also the settled slot.
    """

    def __init__(self, wire: WireFormat, channel: Channel, stats: CommStats) -> None:
        super().__init__(channel, stats)
        self.wire = wire

    def buffers(self, payload: torch.Tensor, keep_payload: bool) -> MeanBuffers:
        return MeanBuffers(slot=payload if keep_payload else None)

    def launch(self, payload: torch.Tensor, buffers: MeanBuffers) -> PendingSum:
        divisor = self.channel.contributors
        if divisor != 1:
            payload.div_(divisor)
        wire = self.wire.encode(payload)
        return PendingSum(payload, wire, self._all_reduce(wire))

    def _all_reduce(self, wire: torch.Tensor) -> Handle | None:
        """The scheme's one collective (none in a group of one)."""
        if self.group_size == 1:
            return None
        self.stats.send(ring_allreduce_bytes(wire.numel() * wire.element_size(), self.group_size))
        return self.channel.all_reduce_sum(wire)

    def settle(self, pending: Pending, buffers: MeanBuffers) -> None:
        assert isinstance(pending, PendingSum)
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        self.wire.decode(pending.wire, pending.payload)
        pending.wire = pending.payload

    def finish(self, pending: Pending, payload: torch.Tensor, buffers: MeanBuffers) -> None:
        assert isinstance(pending, PendingSum)
        self.settle(pending, buffers)
        if payload is not pending.payload:
            payload.copy_(pending.payload)

    def restore(self, payload: torch.Tensor, buffers: MeanBuffers) -> PendingSum:
        slot = payload if buffers.slot is None else buffers.slot
        return PendingSum(slot, slot, None)
