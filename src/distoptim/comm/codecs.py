"""Codecs of the wire formats: how values are written as bytes (``Q``) and read back (``D``).

Every encoded block travels as bytes: rows of ``torch.uint8`` whose width is exactly what one
row puts on the wire, so a byte count is a count of what is sent. Two layers:

**Value coders** write ``G`` groups of ``m`` values per row. Nothing is computed in a 16-bit
dtype: a codec works in float32, or float64 for float64 buffers (:func:`work_dtype`).

* :class:`Cast` -- ``Q(x)`` = ``x`` rounded once (to nearest, ties to even) to the wire dtype:
  ``fp32`` keeps the buffer's own dtype (lossless: float64 stays float64), ``fp16`` / ``bf16``
  round to 16 bits: ``|x - Q(x)| <= max(2^-p·|x|, u/2)`` with ``p`` = 11 / 8 significant bits
  and ``u`` the wire's smallest subnormal (``2^-24`` / ``2^-133``). A finite value beyond the
  wire dtype's range saturates to its largest finite value (65504 for fp16) instead of
  becoming ``inf``; NaN and ``±inf`` pass through. ``size(dtype)`` bytes per value.
* :class:`Absmax` -- ``b``-bit symmetric integers with one float32 absmax scale per group
  (``L = 2^(b-1) - 1``: 127 for int8, 7 for int4, 1 for int2). A group with largest magnitude
  ``a`` has the scale ``s`` = ``a / L`` rounded *up* to float32 (:func:`absmax_scales`: the
  smallest float32 with ``s·L >= a``, at most ``FLT_MAX``) and the codes ``q`` = the integer
  nearest the exact ``x / s`` (ties to even), clamped to ``[-L, L]``. While ``a <= L·FLT_MAX``
  (always for float16, bfloat16 and float32 buffers) no code is clamped and
  ``|x - q·s| <= s / 2`` exactly, ``s > 0`` unless the group is all zeros, and the largest
  value of a 16/32-bit group never decodes to 0. Beyond (float64 only) ``s = FLT_MAX`` and
  values saturate at ``±L·FLT_MAX``. A non-finite ``a`` gives a non-finite ``s``, so the
  group decodes to non-finite values. ``int2`` is therefore ternary (``q ∈ {-1, 0, 1}``; the
  fourth code is unused). Codes are stored offset (``q + L``), packed ``8 / b`` to a byte,
  little end first. Row: ``[codes: ceil(G·m·b/8) bytes | G scales: 4 bytes each]``.

``D`` decodes into any dtype, rounding once (``q·s`` is exact in float64) and saturating at the
dtype's largest finite value (:func:`narrow`): a bf16 wire of 65504 decoded into a float16
buffer is 65504, not ``inf``.

**Codecs** lay a flat buffer out and pick what travels:

* :class:`DenseCodec` -- every value: a buffer of ``numel`` values over ``n`` shards is padded
  with zeros to ``n`` equal shards, a whole number of chunks each (``C`` = 256 values for the
  integer coders, smaller for small buffers; one value per "chunk" for casts), and a shard
  travels as one row. Used by the two-phase mean (:mod:`distoptim.comm.quantize`).
* :class:`TopKCodec` -- chunked top-k (as in SparseLoCo): the buffer is cut into chunks of ``c``
  values (``C`` = 4096, or the whole buffer when smaller; the last chunk padded with zeros) and
  each chunk keeps its ``k = min(c, ceil(d·c))`` values of largest magnitude (``d`` the
  density). A row is ``[positions | values]``: each kept value's position inside its chunk,
  1 byte (uint8) when ``c <= 256`` and 2 bytes (little-endian int16) otherwise, then the ``k``
  values of every chunk written by a value coder (one absmax scale per chunk for the integer
  coders). ``D`` puts the values back at their positions, zeros elsewhere. Used by
  gather-and-sum (:mod:`distoptim.comm.gather`).

Every codec offers :meth:`Codec.subtract_decoded` (``x ← x - D(wire)``), the step error feedback
(:mod:`distoptim.comm.feedback`) needs. Zero-size buffers encode to rows of 0 bytes. What fails
inside a codec is raised as :class:`CodecError`, a local error (not a ``RuntimeError``, which
callers read as a failed collective).
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

__all__ = [
    "Absmax",
    "Cast",
    "Codec",
    "CodecError",
    "DenseCodec",
    "ShardLayout",
    "SparseLayout",
    "TopKCodec",
    "Values",
    "absmax_scales",
    "narrow",
    "work_dtype",
]

_BYTE = torch.uint8
_SCALE = torch.float32
_SCALE_MAX = torch.finfo(_SCALE).max
DENSE_CHUNK = 256
"""Values per absmax scale of the dense integer formats (smaller for small buffers)."""
TOPK_CHUNK = 4096
"""Values per top-k chunk (the whole buffer when it is smaller)."""


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _read(block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes ``block`` (``(R, B)`` uint8) read as ``(R, B / size)`` values of ``dtype``."""
    if block.shape[-1] == 0:  # no bytes (a zero-size buffer): a view would need aligned strides
        return torch.empty(block.shape[0], 0, dtype=dtype, device=block.device)
    size = _itemsize(dtype)
    aligned = block.storage_offset() % size == 0 and block.stride(0) % size == 0
    if not (block.is_contiguous() and aligned):  # a view needs dense, aligned rows
        block = block.clone(memory_format=torch.contiguous_format)
    return block.view(dtype)


def _write(block: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values`` (``(R, m)``, any dtype) as bytes into ``block`` (``(R, m·size)`` uint8)."""
    block.copy_(values.contiguous().view(_BYTE))


# ---------------------------------------------------------------------------------------------
# rounding between float dtypes
# ---------------------------------------------------------------------------------------------
_WIDENING = {
    (torch.float16, torch.float32),
    (torch.float16, torch.float64),
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float32, torch.float64),
}
"""Conversions that are exact (every value of the first dtype is one of the second)."""
_HALVES = (torch.float16, torch.bfloat16)


def _saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` with finite values clamped to ``dtype``'s finite range (NaN and ±inf untouched)."""
    if not (x.dtype.is_floating_point and dtype.is_floating_point):
        return x
    big = torch.finfo(dtype).max
    if torch.finfo(x.dtype).max <= big:
        return x
    return torch.where(torch.isfinite(x), x.clamp(-big, big), x)


def _to_odd_float32(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` rounded to float32 *to odd*: toward zero, with the last bit set when
    inexact. Rounding that to a format of at most 22 significant bits is then the correct
    rounding of ``x`` itself (no double rounding), which a plain float64 -> float32 ->
    16-bit conversion is not."""
    near = x.to(torch.float32)
    wide = near.to(torch.float64)
    toward_zero = torch.where(wide.abs() > x.abs(), torch.nextafter(near, near.new_zeros(())), near)
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where((wide != x) & torch.isfinite(x), odd, near)


def narrow(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``: rounded once to nearest (ties to even), finite values saturating at
    ``dtype``'s largest finite value; NaN and ±inf pass. ``x`` itself when it is of ``dtype``.

    torch converts float64 to float16/bfloat16 through float32, rounding twice (``1 + 2^-8 +
    2^-30`` becomes 1 in bfloat16 instead of ``1 + 2^-7``); here the float32 step rounds to odd,
    which makes the pair one correct rounding.
    """
    if x.dtype == dtype:
        return x
    if (x.dtype, dtype) in _WIDENING or not dtype.is_floating_point:
        return x.to(dtype)
    if x.dtype in _HALVES:  # float16 <-> bfloat16: clamp where 65504 is a value (float32)
        x = x.to(torch.float32)
    x = _saturate(x, dtype)
    if x.dtype == torch.float64 and dtype in _HALVES:
        x = _to_odd_float32(x)
    return x.to(dtype)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where a codec computes for buffers of ``dtype``: float64 for float64, float32 for the
    narrower floats (``torch.promote_types(dtype, float32)``)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------
# value coders
# ---------------------------------------------------------------------------------------------
class Values(abc.ABC):
    """How ``(R, G, m)`` values (``G`` groups of ``m`` per row) become ``(R, width)`` bytes."""

    name: str
    lossy: bool

    @abc.abstractmethod
    def width(self, groups: int, size: int, source: torch.dtype) -> int:
        """Bytes of one row of ``groups`` groups of ``size`` values of dtype ``source``."""

    @abc.abstractmethod
    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``Q(values)`` (``(R, G, m)``) into ``out`` (``(R, width)`` uint8)."""

    @abc.abstractmethod
    def decode(
        self, wire: torch.Tensor, groups: int, size: int, source: torch.dtype, dtype: torch.dtype
    ) -> torch.Tensor:
        """``D(wire)`` as a new ``(R, groups, size)`` tensor of ``dtype`` (``source``: the
        dtype the values were encoded from), rounded once into ``dtype`` (:func:`narrow`)."""


class Cast(Values):
    """Values rounded to ``dtype`` (``None``: the source's own dtype, lossless); see module."""

    def __init__(self, name: str, dtype: torch.dtype | None) -> None:
        self.name = name
        self.dtype = dtype
        self.lossy = dtype is not None

    def wire_dtype(self, source: torch.dtype) -> torch.dtype:
        return source if self.dtype is None else self.dtype

    def width(self, groups: int, size: int, source: torch.dtype) -> int:
        return groups * size * _itemsize(self.wire_dtype(source))

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        rows, groups, size = values.shape
        _write(out, narrow(values.reshape(rows, groups * size), self.wire_dtype(values.dtype)))

    def decode(
        self, wire: torch.Tensor, groups: int, size: int, source: torch.dtype, dtype: torch.dtype
    ) -> torch.Tensor:
        values = _read(wire, self.wire_dtype(source))
        values = narrow(values, dtype) if values.dtype != dtype else values.clone()
        return values.view(wire.shape[0], groups, size)


def absmax_scales(absmax: torch.Tensor, levels: int) -> torch.Tensor:
    """The float32 scales of groups whose largest magnitudes are ``absmax``: ``s = a / L``
    rounded *up* to float32 (the smallest float32 with ``s·L >= a``, so ``|x / s| <= L`` and
    ``s > 0`` for every ``a > 0``), at most float32's largest finite value; ``s`` is
    non-finite when ``a`` is."""
    a = absmax.to(torch.float64)
    s = a / levels  # finite a: finite in float64, whatever the buffer's dtype
    s = torch.where(torch.isfinite(s), s.clamp(max=_SCALE_MAX), s).to(_SCALE)
    low = (s.to(torch.float64) * levels < a) & (s < _SCALE_MAX)  # exact: 24 + 7 bits
    return torch.where(low, torch.nextafter(s, s.new_full((), math.inf)), s)


class Absmax(Values):
    """``bits``-bit symmetric integers with one float32 absmax scale per group; see module."""

    def __init__(self, name: str, bits: int) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, got {bits!r}")
        self.name = name
        self.bits = bits
        self.levels = 2 ** (bits - 1) - 1
        self.lossy = True

    def _code_bytes(self, count: int) -> int:
        return -(-count * self.bits // 8)

    def width(self, groups: int, size: int, source: torch.dtype) -> int:
        return self._code_bytes(groups * size) + 4 * groups

    def encode(self, values: torch.Tensor, out: torch.Tensor) -> None:
        rows, groups, size = values.shape
        code_bytes = self._code_bytes(groups * size)
        x = values.to(work_dtype(values.dtype))  # a copy only for 16-bit buffers
        scratch = x.abs()
        scales = absmax_scales(scratch.amax(dim=-1), self.levels)
        # the scale that travels (float32) is the one the codes are computed with
        scale = scales.to(x.dtype).unsqueeze(-1)
        quotient = x.div(torch.where(scale > 0, scale, torch.ones_like(scale)))
        q = self._nearest(quotient, x, scale, out=scratch)  # no new buffer-sized allocation
        if bool((scales == _SCALE_MAX).any()):  # a saturated scale: codes past ±L (float64)
            q.clamp_(-self.levels, self.levels)
        # |q| <= L < 128: an int8, offset by L in its byte (cheaper than in float)
        codes = q.to(torch.int8).view(_BYTE).add_(self.levels)
        out[:, :code_bytes].copy_(self._pack(codes.reshape(rows, groups * size)))
        _write(out[:, code_bytes:], scales)

    @staticmethod
    def _nearest(
        quotient: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """The integer nearest the exact ``x / s`` (ties to even), from its rounded ``quotient``.

        Rounding the quotient moves it across no half-integer (they are representable), but it
        may land on one the exact quotient is not: only there (rare) is the choice redone from
        ``r = x - q·s`` in float64, exact for float32 scales (``q·s`` has at most 31 bits and
        ``x`` is within ``s`` of it). ``q`` is written into ``out``; ``quotient`` is consumed.
        """
        q = torch.round(quotient, out=out)
        if quotient.numel() == 0:
            return q
        off = quotient.sub_(q).abs_()  # exact, <= 1/2: 1/2 only where the quotient is a tie
        tied = off.amax(dim=-1) == 0.5  # per group: one pass, no buffer-sized index
        if bool(tied.any()):
            rows, groups = tied.nonzero(as_tuple=True)
            s = scale[rows, groups].to(torch.float64)
            qs = q[rows, groups].to(torch.float64)
            r = x[rows, groups].to(torch.float64) - qs * s
            step = torch.sign(r) * ((r.abs() > s / 2) & (off[rows, groups] == 0.5))
            q[rows, groups] = (qs + step).to(q.dtype)
        return q

    def decode(
        self, wire: torch.Tensor, groups: int, size: int, source: torch.dtype, dtype: torch.dtype
    ) -> torch.Tensor:
        rows = wire.shape[0]
        code_bytes = self._code_bytes(groups * size)
        codes = self._unpack(wire[:, :code_bytes], groups * size).view(rows, groups, size)
        scales = _read(wire[:, code_bytes:], _SCALE)
        # q·s is exact in float64 (at most 31 bits) and correctly rounded in float32
        work = torch.float32 if dtype == torch.float32 else torch.float64
        values = codes.to(work).sub_(self.levels).mul_(scales.to(work).unsqueeze(-1))
        if work == torch.float32:  # L·s can pass FLT_MAX: saturate those chunks, not inf
            over = torch.isfinite(scales) & (scales.to(torch.float64) * self.levels > _SCALE_MAX)
            if bool(over.any()):
                clamped = values.clamp(-_SCALE_MAX, _SCALE_MAX)
                values = torch.where(over.unsqueeze(-1), clamped, values)
        return narrow(values, dtype)

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """``(R, n)`` codes below ``2^bits`` -> ``(R, ceil(n·bits/8))`` bytes, low bits first."""
        if self.bits == 8:
            return codes
        per = 8 // self.bits
        rows, n = codes.shape
        if n % per:
            codes = torch.cat([codes, codes.new_zeros(rows, per - n % per)], dim=1)
        codes = codes.view(rows, codes.shape[1] // per, per)
        packed = codes[..., 0].clone()
        for i in range(1, per):
            packed.bitwise_or_(codes[..., i] << (i * self.bits))
        return packed

    def _unpack(self, packed: torch.Tensor, n: int) -> torch.Tensor:
        """The inverse of :meth:`_pack`: ``(R, n)`` codes."""
        if self.bits == 8:
            return packed
        per = 8 // self.bits
        mask = (1 << self.bits) - 1
        parts = [(packed >> (i * self.bits)) & mask for i in range(per)]
        rows, count = packed.shape
        return torch.stack(parts, dim=-1).reshape(rows, count * per)[:, :n]


# ---------------------------------------------------------------------------------------------
# codecs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardLayout:
    """How a flat buffer of ``numel`` values of ``dtype`` is padded and cut into ``shards``.

    The padded buffer has ``shards * shard`` values (zeros past ``numel``); each shard has
    ``shard`` values, a multiple of ``chunk``, and travels as one row of ``width`` bytes.
    """

    numel: int
    shards: int
    shard: int
    chunk: int
    width: int
    dtype: torch.dtype

    @property
    def padded(self) -> int:
        return self.shards * self.shard


@dataclass(frozen=True)
class SparseLayout:
    """Top-k of ``numel`` values of ``dtype``: ``chunks`` chunks of ``chunk`` values (zeros past
    ``numel``), ``keep`` kept per chunk, positions of ``index_bytes`` each; ``width`` bytes."""

    numel: int
    chunk: int
    chunks: int
    keep: int
    index_bytes: int
    width: int
    dtype: torch.dtype

    @property
    def padded(self) -> int:
        return self.chunks * self.chunk

    @property
    def index_width(self) -> int:
        """Bytes of the positions in a row (they come first)."""
        return self.chunks * self.keep * self.index_bytes


LayoutT = TypeVar("LayoutT", ShardLayout, SparseLayout)
MethodT = TypeVar("MethodT", bound=Callable[..., Any])


class CodecError(Exception):
    """A codec failed on this rank's own buffer: a local error, never a peer's failure.

    Not a ``RuntimeError`` on purpose: the callers that turn a failed collective into "a peer
    stopped taking part" catch those, and this error must reach the user as what it is.
    """


def _local(method: MethodT) -> MethodT:
    """``method`` of a codec, with torch's errors raised as :class:`CodecError` (out of memory
    excepted) naming the codec, the step and the buffer."""

    @functools.wraps(method)
    def run(self: Codec[Any], data: torch.Tensor, *args: Any) -> Any:
        try:
            return method(self, data, *args)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            raise CodecError(
                f"wire {self.name!r}: {method.__name__} of a {tuple(data.shape)} {data.dtype} "
                f"buffer failed on this rank (a local error of the codec; no peer is "
                f"involved): {exc}"
            ) from exc

    return run  # type: ignore[return-value]


class Codec(abc.ABC, Generic[LayoutT]):
    """A layout of flat buffers into byte rows, with ``Q`` and what error feedback needs."""

    name: str

    @abc.abstractmethod
    def encode(self, x: torch.Tensor, out: torch.Tensor, layout: LayoutT) -> None:
        """Write ``Q(x)`` of ``x`` (rows of the layout's padded values) into ``out`` (bytes)."""

    @abc.abstractmethod
    def subtract_decoded(self, x: torch.Tensor, wire: torch.Tensor, layout: LayoutT) -> None:
        """``x ← x - D(wire)`` in place (``x`` the rows ``wire`` was encoded from)."""


class DenseCodec(Codec[ShardLayout]):
    """Every value travels, coded by ``values`` in groups of ``chunk`` (see module)."""

    def __init__(self, values: Values, chunk: int = DENSE_CHUNK) -> None:
        if chunk < 1 or (isinstance(values, Absmax) and chunk % 4):
            raise ValueError(f"chunk must be >= 1 (a multiple of 4 for integers), got {chunk}")
        self.values = values
        self.name = values.name
        self.chunk = 1 if isinstance(values, Cast) else chunk

    def layout(self, numel: int, shards: int, dtype: torch.dtype) -> ShardLayout:
        """The padding, shard and chunk sizes of ``numel`` values of ``dtype`` over ``shards``."""
        per_rank = -(-numel // shards)
        chunk = self.chunk
        if chunk > 1:  # small buffers: smaller chunks (a multiple of 4 values)
            chunk = min(chunk, max(4, -(-per_rank // 4) * 4))
        shard = -(-per_rank // chunk) * chunk
        width = self.values.width(shard // chunk, chunk, dtype)
        return ShardLayout(numel, shards, shard, chunk, width, dtype)

    @_local
    def encode(self, x: torch.Tensor, out: torch.Tensor, layout: ShardLayout) -> None:
        self.values.encode(x.view(x.shape[0], layout.shard // layout.chunk, layout.chunk), out)

    @_local
    def decode(self, wire: torch.Tensor, dtype: torch.dtype, layout: ShardLayout) -> torch.Tensor:
        """``D(wire)`` as a new ``(rows, layout.shard)`` tensor of ``dtype``."""
        groups = layout.shard // layout.chunk
        values = self.values.decode(wire, groups, layout.chunk, layout.dtype, dtype)
        return values.view(wire.shape[0], layout.shard)

    @_local
    def subtract_decoded(self, x: torch.Tensor, wire: torch.Tensor, layout: ShardLayout) -> None:
        x.sub_(self.decode(wire, x.dtype, layout))


class TopKCodec(Codec[SparseLayout]):
    """Per chunk, the ``ceil(density·c)`` values of largest magnitude and their positions."""

    def __init__(self, density: float, values: Values, chunk: int = TOPK_CHUNK) -> None:
        if not 0 < density <= 1:
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if not 1 <= chunk <= 1 << 15:
            raise ValueError(f"chunk must be in [1, 32768] (int16 positions), got {chunk}")
        self.density = density
        self.values = values
        self.chunk = chunk
        self.name = f"topk:{density!r}" + ("" if values.name == "fp32" else f"+{values.name}")

    def layout(self, numel: int, dtype: torch.dtype) -> SparseLayout:
        """The chunks of ``numel`` values of ``dtype`` and what each row carries."""
        chunk = min(self.chunk, max(1, numel))
        chunks = -(-numel // chunk)
        # round() first: 0.07 * 100 is 7.000000000000001 in binary floating point
        keep = min(chunk, max(1, math.ceil(round(self.density * chunk, 9))))
        index_bytes = 1 if chunk <= 256 else 2
        width = chunks * keep * index_bytes + self.values.width(chunks, keep, dtype)
        return SparseLayout(numel, chunk, chunks, keep, index_bytes, width, dtype)

    @_local
    def encode(self, x: torch.Tensor, out: torch.Tensor, layout: SparseLayout) -> None:
        rows = x.shape[0]
        chunks = x.view(rows, layout.chunks, layout.chunk)
        positions = chunks.abs().topk(layout.keep, dim=-1, sorted=False).indices
        index = torch.uint8 if layout.index_bytes == 1 else torch.int16
        flat = positions.to(index).reshape(rows, layout.chunks * layout.keep)
        _write(out[:, : layout.index_width], flat)
        self.values.encode(chunks.gather(-1, positions), out[:, layout.index_width :])

    @_local
    def decode(
        self, wire: torch.Tensor, dtype: torch.dtype, layout: SparseLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, values)``, each ``(rows, chunks·keep)``: flat positions in the padded
        buffer (int64) and the decoded values (``dtype``); ``D(wire)`` is zero elsewhere."""
        rows = wire.shape[0]
        index = torch.uint8 if layout.index_bytes == 1 else torch.int16
        local = _read(wire[:, : layout.index_width], index).to(torch.int64)
        base = torch.arange(layout.chunks, device=wire.device).mul_(layout.chunk)
        positions = local.view(rows, layout.chunks, layout.keep).add_(base.unsqueeze(-1))
        values = self.values.decode(
            wire[:, layout.index_width :], layout.chunks, layout.keep, layout.dtype, dtype
        )
        kept = layout.chunks * layout.keep
        return positions.view(rows, kept), values.reshape(rows, kept)

    @_local
    def dense(self, wire: torch.Tensor, dtype: torch.dtype, layout: SparseLayout) -> torch.Tensor:
        """``D(wire)`` as a new dense ``(rows, layout.padded)`` tensor of ``dtype``."""
        out = torch.zeros(wire.shape[0], layout.padded, dtype=dtype, device=wire.device)
        positions, values = self.decode(wire, dtype, layout)
        return out.scatter_(1, positions, values)

    @_local
    def subtract_decoded(self, x: torch.Tensor, wire: torch.Tensor, layout: SparseLayout) -> None:
        positions, values = self.decode(wire, x.dtype, layout)
        x.scatter_add_(1, positions, values.neg_())
