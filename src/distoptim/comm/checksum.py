"""A bitwise checksum of tensors: do replicas hold exactly the same state?

Owns :func:`state_checksum`, the 64-bit word replicas compare after a commit or a heal (with a
torchft manager) to show that the state they synchronise -- CrossShardOptimizer's parameters,
DiLoCo's global copy and outer-optimizer state -- is equal *bit for bit*, not merely close.

Definition. The tensors are read in order as one byte stream: for each, a header (its dtype and
shape as text) and then its elements' bytes in row-major order (the storage as it is, so
``-0.0`` differs from ``0.0`` and NaN payloads count). The checksum is
``crc32(stream) << 32 | adler32(stream)`` (zlib's, with their standard initial values).

What it guarantees: equal state gives equal words on every process (no floating-point sum, no
thread-order dependence). A difference is detected unless both 32-bit checks collide at once
(any single-bit to 32-bit burst error is always caught by CRC-32; beyond that the chance of a
miss is about ``2**-32``). It is a checksum, not a cryptographic hash: it catches drift and
corruption, not an adversary. Cost: one read of the bytes (zlib's CRC-32 runs at gigabytes per
second), plus a device-to-host copy for tensors off the CPU.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

__all__ = ["state_checksum"]


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu()
    return memoryview(flat.numpy())


def state_checksum(tensors: Iterable[torch.Tensor]) -> int:
    """The 64-bit checksum of ``tensors`` in order (see the module docstring), in
    ``[0, 2**64)``."""
    crc, adler = 0, 1
    for t in tensors:
        header = f"{t.dtype}{tuple(t.shape)};".encode()
        crc, adler = zlib.crc32(header, crc), zlib.adler32(header, adler)
        data = _bytes(t)
        crc, adler = zlib.crc32(data, crc), zlib.adler32(data, adler)
    return crc << 32 | adler
