"""Wire casts: the dtype a buffer travels in through a SUM all-reduce, separate from its own.

Owns the cast formats of the wire registry (:mod:`distoptim.comm.wire`: ``fp32``, ``fp16``,
``bf16``) as they ride a plain SUM all-reduce, and the encode/decode pair around it.
``None`` sends buckets as they are; ``"fp16"`` / ``"bf16"`` send real floating buckets that are
*wider* than 16 bits (float32, float64) as float16 / bfloat16 and write the reduced values back
into the bucket's own dtype, so everything after the wire (scaling, the optimizer update) runs
in the parameter dtype. Narrower or non-float buckets (float16, bfloat16, complex) go
uncompressed. The sum itself is computed in the wire dtype, so callers that average should
divide *before* encoding (keeps float16 sums away from overflow, as DDP's fp16 hook does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CASTS", "COMPRESSIONS", "WireFormat"]

COMPRESSIONS: dict[str | None, torch.dtype | None] = {
    None: None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
"""Accepted ``compression`` values of :meth:`WireFormat.parse` and the wire dtype of each."""


@dataclass(frozen=True)
class WireFormat:
    """How buckets are encoded for the wire; build it with :meth:`parse`."""

    name: str | None
    dtype: torch.dtype | None

    @classmethod
    def parse(cls, compression: object) -> WireFormat:
        """``None``, ``"fp16"`` or ``"bf16"`` (case-insensitive); anything else is an error.

        The registry's spelling, which also takes ``"fp32"``, is
        :func:`distoptim.comm.wire.parse_allreduce`.
        """
        if compression is not None and not isinstance(compression, str):
            raise TypeError(
                "compression must be None, 'fp16' or 'bf16', got "
                f"{type(compression).__name__} {compression!r}"
            )
        key = compression.lower() if isinstance(compression, str) else None
        if key not in COMPRESSIONS:
            raise ValueError(
                f"unknown compression {compression!r}: allowed values are None, 'fp16', 'bf16'"
            )
        return cls(key, COMPRESSIONS[key])

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``dtype`` travels in."""
        if (
            self.dtype is not None
            and dtype.is_floating_point
            and torch.finfo(dtype).bits > torch.finfo(self.dtype).bits
        ):
            return self.dtype
        return dtype

    def encode(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor to all-reduce: ``buffer`` itself, or a converted copy of it."""
        wire = self.wire_dtype(buffer.dtype)
        return buffer if wire == buffer.dtype else buffer.to(wire)

    @staticmethod
    def decode(wire: torch.Tensor, buffer: torch.Tensor) -> None:
        """Write the reduced ``wire`` values back into ``buffer`` (no-op if they are one)."""
        if wire is not buffer:
            buffer.copy_(wire)


CASTS: dict[str, WireFormat] = {
    "fp32": WireFormat("fp32", None),
    "fp16": WireFormat("fp16", torch.float16),
    "bf16": WireFormat("bf16", torch.bfloat16),
}
"""The registry's cast formats as they ride a SUM all-reduce (``fp32``: the buffer's dtype)."""
