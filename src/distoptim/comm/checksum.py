"""A bitwise checksum of tensors, computed where they live: do replicas hold exactly the same state?

Owns :func:`state_checksum`, the 64-bit word replicas compare after a commit or a heal (with a
torchft manager) to show that the state they synchronise -- CrossShardOptimizer's parameters,
DiLoCo's global copy and outer-optimizer state -- is equal *bit for bit*, not merely close.

Definition. The tensors are read in order as one stream of 16-bit *limbs*: each tensor's
storage in row-major order (as it is: ``-0.0`` differs from ``0.0`` and NaN payloads count),
cut into 16-bit words read as signed integers ``v`` in ``[-2**15, 2**15)`` (the machine's byte
order); a tensor of 1-byte elements gives one limb per byte (``v`` in ``[0, 256)``). Limb ``n``
of the stream goes to accumulator ``c = n mod 2`` at index ``j = n // 2``, and

    S_c = sum_j  r_c**j * v_(2j + c)   (mod p),   p = 2**31 - 1,  r_0 = 16807,  r_1 = 48271

(a polynomial hash; ``r_0`` and ``r_1`` are primitive roots of ``p``, so the weights
``r_c**j`` are distinct and nonzero for ``j < p - 1``). The word is
``((S_0 << 31) | S_1) ^ (crc32(header) << 32)``, where ``header`` spells each tensor's dtype and
shape (and the slice, below). :func:`state_checksum` with ``parts=K`` hashes only slice
``part`` of the stream: rows of :data:`ROW` limbs ``[R part / K, R (part + 1) / K)`` of the ``R``
rows (the last row padded with zero limbs, which add nothing); the ``S_c`` of the ``K`` slices
sum, mod ``p``, to those of the whole stream.

What it guarantees. The sums are exact integer arithmetic: equal state gives equal words on
every device and process, whatever order a reduction runs in (each row's sum is a float64
matrix product of integers below ``2**51``, exact in any order; the rest is int64 arithmetic
below ``2**63``). A difference is *always* detected when it is one flipped bit (a limb moves by
``+-2**k``, and ``r**j 2**k`` is not 0 mod p) or a swap of two unequal elements of a dtype of at
most 4 bytes (their limbs of one parity move by ``(r**i - r**k)(v_k - v_i)``, not 0 mod p since
``|v_k - v_i| < 2**16 < p``) -- within the first ``2 (p - 1)`` limbs (8 GiB of state); for 8-byte
dtypes a swap is missed only if both parities' limb differences cancel (odds of about
``2**-31`` or less). Other differences are missed with odds of about ``2**-62``. It is a
checksum, not a cryptographic hash: it catches drift and corruption, not an adversary.

Cost. Only torch operations on the tensors' own device, in chunks of :func:`_chunk_limbs`
limbs (bounded scratch memory): a read of the bytes, one float64 product of the ``2 x 64``
weight matrix with the chunk's ``64 x rows`` limbs, and a few int64 operations per row of 64
limbs; one device-to-host copy of two integers at the end. On one CPU core it runs at about
the speed of zlib's CRC-32 (1 GB/s); it moves nothing off the device, and it can be amortized:
``parts=K`` costs ``1/K`` of the whole (:func:`state_slices` picks ``K`` for a round's
amortized check: CrossShardOptimizer's rounds, DiLoCo's syncs under a torchft manager).
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["MAX_SLICES", "ROW", "SLICE_LIMBS", "state_checksum", "state_slices"]

P = (1 << 31) - 1
"""The prime modulus of both accumulators."""
ROOTS = (16807, 48271)
"""The two accumulators' bases (primitive roots of :data:`P`)."""
ROW = 64
"""Limbs per row (32 per accumulator): ``32 * 2**15 * 2**31 = 2**51`` keeps a row exact."""
_HALF = ROW // 2
SLICE_LIMBS = 1 << 16
"""About this many 16-bit limbs of state (128 KiB) are checked per amortized round."""
MAX_SLICES = 64
"""A whole check at least every this many amortized rounds, whatever the state's size."""


def state_slices(tensors: Sequence[torch.Tensor]) -> int:
    """``K``: how many slices an amortized state check of ``tensors`` cycles through (>= 1):
    about :data:`SLICE_LIMBS` limbs each, at most :data:`MAX_SLICES`."""
    limbs = sum(t.numel() * max(t.element_size() // 2, 1) for t in tensors)
    return max(1, min(MAX_SLICES, -(-limbs // SLICE_LIMBS)))


def _powers(r: int, n: int, start: int = 0) -> list[int]:
    out, x = [], pow(r, start, P)
    for _ in range(n):
        out.append(x)
        x = x * r % P
    return out


_weights: dict[torch.device, torch.Tensor] = {}  # (2, ROW) float64 per device
_row_powers: dict[tuple[torch.device, int], torch.Tensor] = {}  # (rows, 2) int64


def _weight_matrix(device: torch.device) -> torch.Tensor:
    """``W[c, n] = r_c**(n // 2)`` if ``n mod 2 == c`` else 0: a row's limbs -> its 2 sums."""
    w = _weights.get(device)
    if w is None:
        w = torch.zeros(2, ROW, dtype=torch.float64)
        for c, r in enumerate(ROOTS):
            w[c, c::2] = torch.tensor(_powers(r, _HALF), dtype=torch.float64)
        w = _weights[device] = w.to(device)
    return w


def _row_weights(device: torch.device, rows: int) -> torch.Tensor:
    """``V[a, c] = r_c**(32 a)`` for ``a < rows``: the weight of row ``a``'s sum."""
    v = _row_powers.get((device, rows))
    if v is None:
        cols = [_powers(pow(r, _HALF, P), rows) for r in ROOTS]
        v = torch.tensor(list(zip(*cols)), dtype=torch.int64).to(device)
        _row_powers[(device, rows)] = v
    return v


_at_rows: dict[tuple[torch.device, int, int], torch.Tensor] = {}  # (2, count) int64
_AT_ROWS_BYTES = 1 << 24
"""The cached row weights of recent chunks (a clean round's slices) take at most this much."""


def _weights_at(device: torch.device, row: int, count: int, chunk_rows: int) -> torch.Tensor:
    """``U[c, a] = r_c**(32 (row + a))`` for ``a < count``: the weights of the row sums of a
    chunk starting at ``row``, kept for the next round that checks the same slice (a few
    torch operations less per call: a slice's cost is mostly such fixed costs)."""
    key = (device, row, count)
    u = _at_rows.get(key)
    if u is None:
        step = [pow(pow(r, _HALF, P), row, P) for r in ROOTS]
        shift = torch.tensor(step, dtype=torch.int64).to(device)
        u = _row_weights(device, chunk_rows)[:count].t().mul(shift[:, None]).remainder_(P)
        if count * 16 <= _AT_ROWS_BYTES:  # drop the oldest until the new one fits
            while _at_rows and 16 * (count + sum(v.shape[1] for v in _at_rows.values())) > (
                _AT_ROWS_BYTES
            ):
                _at_rows.pop(next(iter(_at_rows)))
            _at_rows[key] = u
    return u


def _chunk_limbs(device: torch.device) -> int:
    """Limbs hashed per chunk: cache-sized on a CPU, large on an accelerator."""
    return ROW * (1 << 12 if device.type == "cpu" else 1 << 18)


def _limbs(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as a flat tensor of limbs (int16, or uint8 for 1-byte dtypes)."""
    flat = t.detach().reshape(-1).contiguous().view(torch.uint8)
    return flat if t.element_size() == 1 else flat.view(torch.int16)


_views: dict[tuple[int, ...], tuple[list[tuple], list[torch.Tensor], list[Any]]] = {}
_MAX_VIEWS = 8


def _layout(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset())


def _all_limbs(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The limb views of ``tensors`` with elements; for contiguous tensors, reused between
    calls while every tensor keeps its storage, dtype, shape and strides (a state checked
    every round is the same parameters: the views then cost no torch call)."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not all(t.is_contiguous() for t in tensors):  # a copy is a snapshot: never reused
        return [_limbs(t) for t in tensors]
    key = tuple(id(t) for t in tensors)
    layout = [_layout(t) for t in tensors]
    hit = _views.get(key)
    if hit is not None and hit[0] == layout:
        return hit[1]
    limbs = [_limbs(t) for t in tensors]
    if len(_views) >= _MAX_VIEWS:
        _views.pop(next(iter(_views)))
    # the views hold the storages: drop them as soon as one of the tensors is collected
    refs = [weakref.ref(t, lambda _, key=key: _views.pop(key, None)) for t in tensors]
    _views[key] = (layout, limbs, refs)
    return limbs


def _chunks(limbs: Sequence[torch.Tensor], begin: int, end: int, size: int) -> Iterator[tuple]:
    """The stream's limbs ``[begin, end)`` in pieces of at most ``size`` (a multiple of
    :data:`ROW`): ``(first row index, int16-or-uint8 pieces to concatenate)``."""
    at = begin
    starts, offset = [], 0
    for x in limbs:
        starts.append(offset)
        offset += x.numel()
    index = 0
    while at < end:
        stop = min(at + size, end)
        pieces = []
        while index < len(limbs) and starts[index] + limbs[index].numel() <= at:
            index += 1
        i, pos = index, at
        while pos < stop and i < len(limbs):
            x, s = limbs[i], starts[i]
            lo, hi = pos - s, min(stop - s, x.numel())
            if hi > lo:
                pieces.append(x[lo:hi])
                pos = s + hi
            i += 1
        yield at // ROW, pieces
        at = stop


def _device_sums(
    tensors: Sequence[torch.Tensor], part: int = 0, parts: int = 1
) -> torch.Tensor | None:
    """``[S_0, S_1]`` of slice ``part`` of ``parts`` as an int64 tensor on the tensors' device
    (None for no elements): nothing here reads a value back to the host."""
    limbs = _all_limbs(tensors)
    if not limbs:
        return None
    device = limbs[0].device
    total = sum(x.numel() for x in limbs)
    rows = -(-total // ROW)
    begin = rows * part // parts * ROW
    end = min(rows * (part + 1) // parts * ROW, total)
    size = _chunk_limbs(device)
    w = _weight_matrix(device)
    partial = []
    for row, pieces in _chunks(limbs, begin, end, size):
        pieces = [p if p.dtype == torch.int16 else p.to(torch.int16) for p in pieces]
        n = sum(p.numel() for p in pieces)
        pad = -n % ROW
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.int16, device=device))
        x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        # (2, ROW) @ (ROW, rows): the wide product is the fast one; exact in any order
        sums = (w @ x.to(torch.float64).view(-1, ROW).t()).to(torch.int64).remainder_(P)
        weights = _weights_at(device, row, sums.shape[1], size // ROW)
        partial.append(sums.mul_(weights).remainder_(P).sum(1))
    if not partial:  # an empty slice (more slices than rows)
        return torch.zeros(2, dtype=torch.int64, device=device)
    acc = partial[0] if len(partial) == 1 else torch.stack(partial).sum(0)
    return acc.remainder_(P)


def _sums(tensors: Sequence[torch.Tensor], part: int = 0, parts: int = 1) -> tuple[int, int]:
    """``(S_0, S_1)`` of slice ``part`` of ``parts``: the one device-to-host read."""
    acc = _device_sums(tensors, part, parts)
    if acc is None:
        return 0, 0
    s0, s1 = acc.tolist()
    return s0, s1


def state_checksum(tensors: Iterable[torch.Tensor], part: int = 0, parts: int = 1) -> int:
    """The 64-bit checksum of ``tensors`` in order (see the module docstring), in
    ``[0, 2**64)``; with ``parts=K``, of slice ``part`` (``0 <= part < K``) of their limbs.

    Every tensor must be on one device; the work runs there, and only the two sums come back.
    """
    tensors = list(tensors)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"state_checksum: parts must be an int >= 1, got {parts!r}")
    if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < parts:
        raise ValueError(f"state_checksum: part must be an int in [0, {parts}), got {part!r}")
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_checksum: expected tensors, got {type(t).__name__}")
    devices = {t.device for t in tensors if t.numel() > 0}
    if len(devices) > 1:
        raise ValueError(
            f"state_checksum: every tensor must be on one device, got {sorted(map(str, devices))}"
        )
    header = "".join(f"{t.dtype}{tuple(t.shape)};" for t in tensors)
    if parts > 1:
        header += f"part {part}/{parts};"
    s0, s1 = _sums(tensors, part, parts)
    return ((s0 << 31) | s1) ^ (zlib.crc32(header.encode()) << 32)
