"""Gather-and-sum: the exact mean of sparse (top-k) buffers over a group.

Owns the averaging scheme of the top-k formats (:class:`~distoptim.comm.codecs.TopKCodec`).
Why not an all-reduce: every rank keeps *its own* top-k positions, so the sum of ``n`` sparse
vectors has the union of their supports (up to ``n·k`` values per chunk). A SUM all-reduce
adds fixed-size buffers position by position, so it could carry them only densely (no saving
at all), and a sparse reduce-scatter would have to re-select (lose values again) after every
hop. Instead every rank all-gathers every rank's encoded ``(positions, values)`` and sums them
densely, in rank order:

    mean = Σ_{r = 0}^{n-1} (D(Q(x_r)) / c)        on every rank, from the same bytes

(``c`` the channel's ``contributors``, ``n`` on a plain group; :mod:`~distoptim.comm.channel`)
which is exact (no second encoding, no second residual) and bit-identical on every rank. With
density 1 and ``fp32`` values every value travels as it is: on two ranks the result is bit for
bit the lossless SUM all-reduce of ``x_r / n`` (one addition, which commutes); on more, equal
up to the order of the additions.

Cost: one all-gather, in which this rank sends its ``W`` bytes to ``n - 1`` peers
(``(n - 1)·W``, counted in :meth:`GatheredMean._gather`, the scheme's one collective, issued
through the channel). Unlike
an all-reduce, that grows with ``n``: gather-and-sum beats a dense ring all-reduce of ``B``
bytes per value while ``n · W / numel < 2·B`` roughly. Memory: the ``n`` received rows and one
dense padded accumulator per mean in flight; with error feedback one padded residual
(``"local"``) per payload, otherwise one padded scratch buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distoptim.comm.averaging import Mean, MeanBuffers, Pending
from distoptim.comm.channel import Channel, Handle
from distoptim.comm.codecs import SparseLayout, TopKCodec, narrow, work_dtype
from distoptim.comm.feedback import feedback_for
from distoptim.comm.stats import CommStats

__all__ = ["GatheredMean", "PendingGather"]


@dataclass
class PendingGather(Pending):
    """A launched all-gather of encoded rows, then (once summed) where the mean lies."""

    layout: SparseLayout
    received: torch.Tensor | None
    work: Handle | None
    result: torch.Tensor | None = None


class GatheredMean(Mean):
    """All-gather every rank's top-k rows and sum them densely (see the module docstring).

    ``launch`` encodes (with the ``"local"`` residual under error feedback) and starts the
    all-gather; ``settle`` waits and sums into the slot; ``finish`` needs no collective.
    """

    finishes_with_collective = False

    def __init__(
        self,
        codec: TopKCodec,
        channel: Channel,
        stats: CommStats,
        error_feedback: bool = True,
    ) -> None:
        if channel.size < 2:
            raise ValueError(f"gather-and-sum needs a group of >= 2 ranks, got {channel.size}")
        super().__init__(channel, stats)
        self.codec = codec
        self.feedback = feedback_for(error_feedback)

    def layout(self, numel: int, dtype: torch.dtype) -> SparseLayout:
        return self.codec.layout(numel, dtype)

    def buffers(self, payload: torch.Tensor, keep_payload: bool) -> MeanBuffers:
        """A padded ``"local"`` residual (or scratch); the slot is the payload itself."""
        padded = self.layout(payload.numel(), payload.dtype).padded
        out = MeanBuffers(slot=payload if keep_payload else None)
        if self.feedback.keeps_residuals:
            out.residuals = {"local": payload.new_zeros(padded)}
        else:
            out.scratch = payload.new_zeros(padded)
        return out

    def launch(self, payload: torch.Tensor, buffers: MeanBuffers) -> PendingGather:
        layout = self.layout(payload.numel(), payload.dtype)
        into = buffers.residuals.get("local", buffers.scratch)
        assert into is not None, "buffers() made either a residual or a scratch buffer"
        row = self.feedback.combine(payload, into).view(1, layout.padded)
        sent = torch.empty(1, layout.width, dtype=torch.uint8, device=row.device)
        self.feedback.encode(self.codec, row, sent, layout)
        received = sent.new_empty(self.group_size, layout.width)
        return PendingGather(layout, received, self._gather(sent, received))

    def settle(self, pending: Pending, buffers: MeanBuffers) -> None:
        assert isinstance(pending, PendingGather)
        if buffers.slot is None:
            raise ValueError("settling a gathered mean needs its payload slot")
        self._sum(pending, buffers.slot)

    def _sum(self, pending: PendingGather, out: torch.Tensor) -> torch.Tensor:
        """Wait, then ``out = Σ_r (D(Q(x_r)) / c)`` in rank order (idempotent)."""
        if pending.result is None:
            if pending.received is None or pending.work is None:
                raise ValueError("this pending mean has neither a launched gather nor a result")
            pending.work.wait()
            layout = pending.layout
            acc = work_dtype(layout.dtype)
            positions, values = self.codec.decode(pending.received, acc, layout)
            values.div_(self.channel.contributors)  # each copy divided before the sum
            dense = torch.zeros(layout.padded, dtype=acc, device=values.device)
            for r in range(self.group_size):  # rank order: the same sum on every rank
                dense.index_add_(0, positions[r], values[r])
            out.copy_(narrow(dense[: layout.numel], out.dtype))  # 16-bit sums saturate
            pending.result = out
            pending.work = None
            pending.received = None
        return pending.result

    def finish(self, pending: Pending, payload: torch.Tensor, buffers: MeanBuffers) -> None:
        assert isinstance(pending, PendingGather)
        result = self._sum(pending, payload)
        if result is not payload:
            payload.copy_(result)

    def restore(self, payload: torch.Tensor, buffers: MeanBuffers) -> PendingGather:
        """The summed mean is in ``buffers.slot`` (loaded from a checkpoint)."""
        if buffers.slot is None:
            raise ValueError("restoring a gathered mean needs its payload slot")
        layout = self.layout(payload.numel(), payload.dtype)
        return PendingGather(layout, None, None, result=buffers.slot)

    def _gather(self, sent: torch.Tensor, received: torch.Tensor) -> Handle:
        """The scheme's one collective: every rank's row to every rank (async).

        This rank sends its ``layout.width`` bytes to each of the ``n - 1`` others.
        """
        self.stats.send((self.group_size - 1) * sent.numel() * sent.element_size())
        return self.channel.all_gather_single(received, sent)
