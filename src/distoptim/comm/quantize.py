"""The two-phase quantized mean: averaging dense buffers whose values travel encoded.

Owns the averaging scheme of the dense lossy formats (``fp16``, ``bf16``, ``int8``, ``int4``,
``int2``; codecs in :mod:`distoptim.comm.codecs`). An encoded buffer cannot simply be
all-reduced with SUM (integer codes overflow, every rank encodes with its own scales, and a
16-bit sum rounds at every hop), so the mean is computed in two encoded phases, the way a ring
all-reduce is a reduce-scatter followed by an all-gather:

1. *scatter*: every rank encodes its whole buffer ``x_r`` (padded to ``n`` equal shards) and an
   ``all_to_all`` hands shard ``j`` of every rank to rank ``j``;
2. rank ``j`` decodes the ``n`` copies of its shard, averages them in full precision (at least
   float32) -- ``m_j = Σ_r (D(Q(x_r))_j / c)``, each copy divided by ``c`` before the sum, so
   finite copies give a finite mean, rounded once into the buffer's dtype (saturating: a
   16-bit buffer's mean is never ``inf``) -- and encodes ``m_j`` once more (``c`` is the channel's
   ``contributors``: ``n`` on a plain group; :mod:`~distoptim.comm.channel`);
3. *gather*: an ``all_gather`` gives every rank every encoded ``m_j``; all decode the same codes,
   so the result is bit-identical on every rank.

Each rank sends ``(n - 1)`` encoded shards per phase, ``2 (n - 1) W`` bytes in all for a shard of
``W`` wire bytes -- the ring all-reduce's ``2 (n - 1) / n`` of the buffer, in the wire format.
Both phases are counted (and the emulated link paid) as they are launched, in
:meth:`QuantizedMean._collective`, the scheme's one place for collectives (issued through the
:class:`~distoptim.comm.channel.Channel`). The shard layout depends on ``n``.

Error feedback (:mod:`distoptim.comm.feedback`) applies at both encodings: rank ``r`` keeps
``e_r ← (x_r + e_r) - D(Q(x_r + e_r))`` over its padded buffer (residual ``"local"``) and the
owner of shard ``j`` keeps ``ε_j ← (m_j + ε_j) - D(Q(m_j + ε_j))`` (residual ``"shard"``). Over
``K`` rounds the applied means then sum to the exact means' sum minus only the current
residuals (``mean_r e_r + ε``). Residuals are per rank.

A group of one rank has nothing to average: its callers use the plain scheme (nothing is sent
or quantized).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distoptim.comm.averaging import Mean, MeanBuffers, Pending
from distoptim.comm.channel import Channel, Handle
from distoptim.comm.codecs import DenseCodec, ShardLayout, narrow, work_dtype
from distoptim.comm.feedback import feedback_for
from distoptim.comm.stats import CommStats

__all__ = ["PendingMean", "QuantizedMean"]


@dataclass
class PendingMean(Pending):
    """One launched two-phase mean: phase 1's work and buffers, then its settled shard mean.

    ``shard_mean`` is set once phase 1 has been waited for (:meth:`QuantizedMean.settle`); a
    pending mean restored from a checkpoint starts there, with no work.
    """

    layout: ShardLayout
    received: torch.Tensor | None
    work: Handle | None
    shard_mean: torch.Tensor | None = None


class QuantizedMean(Mean):
    """Two-phase encoded mean of flat buffers over ``channel`` (see the module docstring).

    ``launch`` encodes and starts phase 1 (asynchronously); ``settle`` waits for it and forms
    this rank's shard mean (local, no collective); ``finish`` runs phase 2 and writes the mean
    into the payload. ``error_feedback=False`` keeps no residuals. ``channel.size >= 2``.
    """

    finishes_with_collective = True

    def __init__(
        self,
        codec: DenseCodec,
        channel: Channel,
        stats: CommStats,
        error_feedback: bool = True,
    ) -> None:
        if channel.size < 2:
            raise ValueError(f"a quantized mean needs a group of >= 2 ranks, got {channel.size}")
        super().__init__(channel, stats)
        self.codec = codec
        self.feedback = feedback_for(error_feedback)

    def layout(self, numel: int, dtype: torch.dtype) -> ShardLayout:
        return self.codec.layout(numel, self.group_size, dtype)

    def buffers(self, payload: torch.Tensor, keep_payload: bool) -> MeanBuffers:
        """``"local"`` (padded buffer) and ``"shard"`` residuals, or a padded scratch buffer."""
        layout = self.layout(payload.numel(), payload.dtype)
        out = MeanBuffers()
        if self.feedback.keeps_residuals:
            out.residuals = {
                "local": payload.new_zeros(layout.padded),
                "shard": payload.new_zeros(layout.shard),
            }
        else:
            out.scratch = payload.new_zeros(layout.padded)
        if keep_payload:
            out.slot = payload.new_zeros(layout.shard)
        return out

    def launch(self, payload: torch.Tensor, buffers: MeanBuffers) -> PendingMean:
        """Encode ``payload`` (1-D, read only) with the ``"local"`` residual; start phase 1."""
        layout = self.layout(payload.numel(), payload.dtype)
        into = buffers.residuals.get("local", buffers.scratch)
        assert into is not None, "buffers() made either a residual or a scratch buffer"
        rows = self.feedback.combine(payload, into).view(layout.shards, layout.shard)
        sent = torch.empty(layout.shards, layout.width, dtype=torch.uint8, device=rows.device)
        self.feedback.encode(self.codec, rows, sent, layout)
        received = torch.empty_like(sent)
        return PendingMean(layout, received, self._collective(1, sent, received))

    def settle(self, pending: Pending, buffers: MeanBuffers) -> None:
        """Wait for phase 1 and keep this rank's shard mean in ``buffers.slot``."""
        assert isinstance(pending, PendingMean)
        self._shard_mean(pending, buffers.slot)

    def _shard_mean(self, pending: PendingMean, out: torch.Tensor | None) -> torch.Tensor:
        """This rank's shard mean ``Σ_r (D(Q(x_r))_j / c)``, written into ``out`` if given."""
        if pending.shard_mean is None:
            if pending.received is None or pending.work is None:
                raise ValueError("this pending mean has neither a launched phase 1 nor a result")
            pending.work.wait()
            layout = pending.layout
            copies = self.codec.decode(pending.received, work_dtype(layout.dtype), layout)
            # divide before summing: n finite copies of at most FLT_MAX / n each cannot
            # overflow, while their sum (divided afterwards) could
            mean = copies.div_(self.channel.contributors).sum(dim=0)
            if out is None:
                out = torch.empty(layout.shard, dtype=layout.dtype, device=mean.device)
            out.copy_(narrow(mean, layout.dtype))  # a 16-bit buffer's mean saturates
            pending.shard_mean = out
            pending.work = None
            pending.received = None
        elif out is not None and out is not pending.shard_mean:
            out.copy_(pending.shard_mean)
        return pending.shard_mean

    def finish(self, pending: Pending, payload: torch.Tensor, buffers: MeanBuffers) -> None:
        """Run phase 2 (encode the shard mean with the ``"shard"`` residual, all-gather) and
        write the group mean into ``payload`` (1-D)."""
        assert isinstance(pending, PendingMean)
        layout = pending.layout
        mean = self._shard_mean(pending, buffers.slot)
        x = self.feedback.combine(mean, buffers.residuals.get("shard", mean))
        row = x.view(1, layout.shard)
        mine = torch.empty(1, layout.width, dtype=torch.uint8, device=row.device)
        self.feedback.encode(self.codec, row, mine, layout)
        gathered = torch.empty(layout.shards, layout.width, dtype=torch.uint8, device=row.device)
        self._collective(2, mine, gathered).wait()
        full = self.codec.decode(gathered, payload.dtype, layout).reshape(-1)
        payload.copy_(full[: layout.numel])

    def restore(self, payload: torch.Tensor, buffers: MeanBuffers) -> PendingMean:
        """Phase 1 settled: its shard mean is in ``buffers.slot`` (loaded from a checkpoint)."""
        if buffers.slot is None:
            raise ValueError("restoring a settled mean needs its payload slot")
        layout = self.layout(payload.numel(), payload.dtype)
        return PendingMean(layout, None, None, shard_mean=buffers.slot)

    def _collective(self, phase: int, sent: torch.Tensor, received: torch.Tensor) -> Handle:
        """The scheme's collectives: phase 1's all-to-all, phase 2's all-gather (both async).

        This rank sends ``(n - 1)`` of its rows, each ``layout.width`` bytes, in either phase.
        """
        self.stats.send((self.group_size - 1) * sent[0].numel() * sent.element_size())
        if phase == 1:
            return self.channel.all_to_all_single(received, sent)
        return self.channel.all_gather_single(received, sent)


def __getattr__(name: str) -> Any:
    """0.2.0's ``WIRES`` (the fixed wire names), now the registry's (:mod:`~.wire`)."""
    if name == "WIRES":
        from distoptim.comm.wire import NAMES

        return NAMES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
