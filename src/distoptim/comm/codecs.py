"""Codecs of the lossy wire formats: how a block of values is encoded into wire elements.

Owns the encode ``Q`` / decode ``D`` pairs and the padding and chunk layout of a buffer cut
into shards (:class:`ShardLayout`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

__all__ = ["BF16Codec", "Codec", "Int8Codec", "ShardLayout"]

_INT8_MAX = 127
_INT8_CHUNK = 256


@dataclass(frozen=True)
class ShardLayout:
    """How a flat buffer of ``numel`` values is padded and cut for a group of ``shards`` ranks.

    The padded buffer has ``shards * shard`` values (zeros past ``numel``); each shard has
    ``shard`` values, a multiple of ``chunk``, and travels as ``width`` wire elements.
    """

    numel: int
    shards: int
    shard: int
    chunk: int
    width: int

    @property
    def padded(self) -> int:
        return self.shards * self.shard


class Codec(abc.ABC):
    """Encoding of ``(rows, shard)`` blocks of values into ``(rows, width)`` wire blocks."""

    name: str
    wire_dtype: torch.dtype

    @abc.abstractmethod
    def layout(self, numel: int, shards: int) -> ShardLayout:
        """The padding and shard sizes of a buffer of ``numel`` values over ``shards`` ranks."""

    @abc.abstractmethod
    def encode(self, x: torch.Tensor, out: torch.Tensor, layout: ShardLayout) -> None:
        """Write ``Q(x)`` of ``x`` (rows x ``shard`` values) into ``out`` (rows x ``width``)."""

    @abc.abstractmethod
    def decode(self, wire: torch.Tensor, dtype: torch.dtype, layout: ShardLayout) -> torch.Tensor:
        """``D(wire)`` as a new ``(rows, layout.shard)`` tensor of ``dtype``."""


class BF16Codec(Codec):
    """``Q(x)`` = ``x`` rounded to bfloat16 (round to nearest even)."""

    name = "bf16"
    wire_dtype = torch.bfloat16

    def layout(self, numel: int, shards: int) -> ShardLayout:
        shard = -(-numel // shards)
        return ShardLayout(numel, shards, shard, 1, shard)

    def encode(self, x: torch.Tensor, out: torch.Tensor, layout: ShardLayout) -> None:
        out.copy_(x)

    def decode(self, wire: torch.Tensor, dtype: torch.dtype, layout: ShardLayout) -> torch.Tensor:
        return wire.to(dtype)


class Int8Codec(Codec):
    """Per-chunk absmax int8: codes then the chunks' float32 scales, in one int8 block per row.

    Row layout (``S`` = ``layout.shard`` values, ``C`` = ``layout.chunk``)::

        [ q_0 ... q_{S-1} (int8) | s_0 ... s_{S/C-1} (float32, as 4 bytes each) ]
    """

    name = "int8"
    wire_dtype = torch.int8

    def __init__(self, chunk: int = _INT8_CHUNK) -> None:
        if chunk < 4 or chunk % 4:
            raise ValueError(f"chunk must be a multiple of 4, got {chunk}")
        self.chunk = chunk

    def layout(self, numel: int, shards: int) -> ShardLayout:
        per_rank = -(-numel // shards)
        chunk = min(self.chunk, max(4, -(-per_rank // 4) * 4))  # small buffers: smaller chunks
        shard = -(-per_rank // chunk) * chunk
        return ShardLayout(numel, shards, shard, chunk, shard + 4 * (shard // chunk))

    def _split(self, wire: torch.Tensor, layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
        codes = wire[:, : layout.shard]
        scales = wire[:, layout.shard :].view(torch.float32)  # rows x (S / C)
        return codes, scales

    def encode(self, x: torch.Tensor, out: torch.Tensor, layout: ShardLayout) -> None:
        rows = x.shape[0]
        chunks = x.reshape(rows, -1, layout.chunk)
        codes, scales = self._split(out, layout)
        # the scale that travels (float32) is the one the codes are computed with
        scales.copy_(chunks.abs().amax(dim=-1).div_(_INT8_MAX))
        scale = scales.to(x.dtype).unsqueeze(-1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = chunks.div(safe).round_().clamp_(-_INT8_MAX, _INT8_MAX)
        codes.copy_(q.reshape(rows, -1))

    def decode(self, wire: torch.Tensor, dtype: torch.dtype, layout: ShardLayout) -> torch.Tensor:
        codes, scales = self._split(wire, layout)
        rows = wire.shape[0]
        values = codes.to(dtype).reshape(rows, -1, layout.chunk)
        return values.mul_(scales.to(dtype).unsqueeze(-1)).reshape(rows, layout.shard)
