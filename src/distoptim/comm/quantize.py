"""Low-precision wire formats for averaging flat buffers, with error feedback.

Owns the lossy wires of the outer-optimizer family (``"bf16"``, ``"int8"``), how values are
encoded for them, and the collective scheme that averages quantized buffers over a group
honestly: a quantized value cannot simply be all-reduced with SUM (int8 codes overflow, and
every rank quantizes with its own scales), so the mean is computed in two quantized phases,
the way a ring all-reduce is a reduce-scatter followed by an all-gather:

1. *scatter*: every rank encodes its whole buffer ``x_r`` (padded to ``n`` equal shards) and an
   ``all_to_all`` hands shard ``j`` of every rank to rank ``j``;
2. rank ``j`` decodes the ``n`` copies of its shard, averages them in full precision
   (``m_j = Σ_r D(Q(x_r))_j / n``, each copy divided by ``n`` before the sum, so finite copies
   give a finite mean) and encodes ``m_j`` once more;
3. *gather*: an ``all_gather`` gives every rank every encoded ``m_j``; all decode the same codes,
   so the result is bit-identical on every rank.

Each rank sends ``(n - 1)`` encoded shards per phase, ``2 (n - 1) W`` bytes in all for a shard of
``W`` wire bytes -- the ring all-reduce's ``2 (n - 1) / n`` of the buffer, in the wire format.
Both phases are counted (and the emulated link paid) through :meth:`CommStats.send`.

Formats (``Q`` encode, ``D`` decode):

* ``bf16``: ``Q(x)`` = ``x`` rounded to bfloat16 (8 significant bits, so a relative error of at
  most ``2^-8``): 2 bytes per value.
* ``int8``: per-chunk absmax scaling. A shard is cut into chunks of ``C`` values (``C`` = 256,
  smaller for small buffers); a chunk with largest magnitude ``a`` has the scale
  ``s = a / 127`` (stored as float32) and codes ``q = round(x / s)`` in ``[-127, 127]``, so
  ``|x - q s| <= s / 2``: 1 byte per value plus 4 bytes per chunk.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "EF-SGD"): what a quantization
dropped is added to the next buffer quantized at the same place. Rank ``r`` keeps
``e_r ← (x_r + e_r) - D(Q(x_r + e_r))`` for phase 1 and the owner of shard ``j`` keeps
``ε_j ← (m_j + ε_j) - D(Q(m_j + ε_j))`` for phase 2. Over ``K`` rounds the applied means then sum
to the exact means' sum minus only the current residuals (``mean_r e_r + ε``): the quantization
error stays bounded instead of accumulating. Residuals are per rank (they differ across ranks).

A group of one rank has nothing to average; callers skip the wire then (nothing is sent or
quantized).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from distoptim.comm.codecs import BF16Codec, Codec, Int8Codec, ShardLayout
from distoptim.comm.stats import CommStats

__all__ = [
    "WIRES",
    "BF16Codec",
    "Codec",
    "Int8Codec",
    "PendingMean",
    "QuantizedMean",
    "Residuals",
    "ShardLayout",
    "codec_for",
    "parse_wire",
]

WIRES = ("fp32", "bf16", "int8")
"""Accepted wire formats: ``fp32`` (lossless, the buffer's own dtype), ``bf16``, ``int8``."""


def parse_wire(wire: object) -> str:
    """``wire`` (lower-cased) if it is one of :data:`WIRES`; else ``TypeError``/``ValueError``."""
    if not isinstance(wire, str):
        raise TypeError(f"wire must be one of {', '.join(map(repr, WIRES))}, got {wire!r}")
    key = wire.lower()
    if key not in WIRES:
        raise ValueError(f"unknown wire {wire!r}: allowed values are {', '.join(map(repr, WIRES))}")
    return key


def codec_for(wire: str) -> Codec | None:
    """The codec of a lossy wire, ``None`` for ``fp32`` (sent as it is)."""
    wire = parse_wire(wire)
    if wire == "bf16":
        return BF16Codec()
    if wire == "int8":
        return Int8Codec()
    return None


@dataclass
class Residuals:
    """Error-feedback state of one buffer on one rank.

    ``local``: phase 1's residual over the whole padded buffer (``layout.padded`` values);
    ``shard``: phase 2's residual of the shard this rank owns (``layout.shard`` values).
    """

    local: torch.Tensor
    shard: torch.Tensor


@dataclass
class PendingMean:
    """One launched two-phase mean: phase 1's work and buffers, then its settled shard mean.

    ``shard_mean`` is set once phase 1 has been waited for (:meth:`QuantizedMean.settle`); a
    pending mean restored from a checkpoint starts there, with no work.
    """

    layout: ShardLayout
    dtype: torch.dtype
    received: torch.Tensor | None
    work: dist.Work | None
    shard_mean: torch.Tensor | None = None


class QuantizedMean:
    """Two-phase quantized mean of flat buffers over ``group`` (see the module docstring).

    ``launch`` encodes and starts phase 1 (asynchronously); ``settle`` waits for it and forms
    this rank's shard mean (local, no collective); ``finish`` runs phase 2 and writes the mean
    into the caller's buffer. ``error_feedback=False`` keeps no residuals. A group of one rank
    has nothing to average: ``group_size`` must be at least 2.
    """

    def __init__(
        self,
        codec: Codec,
        group: dist.ProcessGroup | None,
        group_size: int,
        stats: CommStats,
        error_feedback: bool = True,
    ) -> None:
        if group_size < 2:
            raise ValueError(f"a quantized mean needs a group of >= 2 ranks, got {group_size}")
        self.codec = codec
        self.group = group
        self.group_size = group_size
        self.stats = stats
        self.error_feedback = error_feedback

    def layout(self, numel: int) -> ShardLayout:
        return self.codec.layout(numel, self.group_size)

    def new_residuals(self, layout: ShardLayout, like: torch.Tensor) -> Residuals:
        """Zero residuals for a buffer of ``layout`` with ``like``'s dtype and device."""
        return Residuals(local=like.new_zeros(layout.padded), shard=like.new_zeros(layout.shard))

    def wire_bytes(self, layout: ShardLayout) -> int:
        """Bytes this rank sends for one mean of a buffer of ``layout`` (both phases)."""
        item = torch.empty((), dtype=self.codec.wire_dtype).element_size()
        return 2 * (self.group_size - 1) * layout.width * item

    def launch(
        self, values: torch.Tensor, residuals: Residuals | None, scratch: torch.Tensor | None
    ) -> PendingMean:
        """Encode ``values`` (1-D, read only) plus the phase-1 residual and start phase 1.

        With error feedback ``residuals`` is required (updated in place); without it
        ``scratch`` (``layout.padded`` values, zero past ``values``) holds the padded input.
        """
        layout = self.layout(values.numel())
        if self.error_feedback:
            if residuals is None:
                raise ValueError("error feedback needs the buffer's residuals")
            x = residuals.local
            x[: layout.numel].add_(values)
        else:
            if scratch is None:
                raise ValueError("without error feedback a padded scratch buffer is needed")
            x = scratch
            x[: layout.numel].copy_(values)
        rows = x.view(layout.shards, layout.shard)
        wire = self.codec.wire_dtype
        sent = torch.empty(layout.shards, layout.width, dtype=wire, device=x.device)
        self.codec.encode(rows, sent, layout)
        if self.error_feedback:
            rows.sub_(
                self.codec.decode(sent, x.dtype, layout)
            )  # what Q dropped, kept for next time
        received = torch.empty_like(sent)
        self.stats.send((self.group_size - 1) * sent[0].numel() * sent.element_size())
        work = dist.all_to_all_single(received, sent, group=self.group, async_op=True)
        return PendingMean(layout, values.dtype, received, work)

    def settle(self, pending: PendingMean, out: torch.Tensor | None = None) -> torch.Tensor:
        """Wait for phase 1; this rank's shard mean ``Σ_r (D(Q(x_r))_j / n)`` (idempotent).

        The mean is written into ``out`` (``layout.shard`` values) when given.
        """
        if pending.shard_mean is None:
            if pending.received is None or pending.work is None:
                raise ValueError("this pending mean has neither a launched phase 1 nor a result")
            pending.work.wait()
            acc = torch.promote_types(pending.dtype, torch.float32)
            copies = self.codec.decode(pending.received, acc, pending.layout)
            # divide before summing: n finite copies of at most FLT_MAX / n each cannot
            # overflow, while their sum (divided afterwards) could
            mean = copies.div_(self.group_size).sum(dim=0)
            if out is None:
                out = torch.empty(pending.layout.shard, dtype=pending.dtype, device=mean.device)
            out.copy_(mean)
            pending.shard_mean = out
            pending.work = None
            pending.received = None
        elif out is not None and out is not pending.shard_mean:
            out.copy_(pending.shard_mean)
        return pending.shard_mean

    def finish(self, pending: PendingMean, out: torch.Tensor, residuals: Residuals | None) -> None:
        """Run phase 2 (a blocking all-gather) and write the group mean into ``out`` (1-D)."""
        layout = pending.layout
        mean = self.settle(pending)
        if self.error_feedback:
            if residuals is None:
                raise ValueError("error feedback needs the buffer's residuals")
            mean = residuals.shard.add_(mean)
        row = mean.view(1, layout.shard)
        wire = self.codec.wire_dtype
        mine = torch.empty(1, layout.width, dtype=wire, device=mean.device)
        self.codec.encode(row, mine, layout)
        if self.error_feedback:
            row.sub_(self.codec.decode(mine, mean.dtype, layout))
        gathered = torch.empty(layout.shards, layout.width, dtype=wire, device=mean.device)
        self.stats.send((self.group_size - 1) * mine.numel() * mine.element_size())
        _all_gather_single(gathered, mine, group=self.group)
        full = self.codec.decode(gathered, out.dtype, layout).reshape(-1)
        out.copy_(full[: layout.numel])


# torch >= 2.13 names it all_gather_single; all_gather_into_tensor before (deprecated after)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
