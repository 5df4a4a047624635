"""Single-process references of the wire formats' math, written from their definitions.

No distoptim code: every function here follows the formulas of ``docs/compression.md`` with
plain loops over chunks, so the codecs and the averaging schemes can be checked against them
(bit for bit where the operations are the same). Spawned children import this module too.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

LEVELS = {"int8": 127, "int4": 7, "int2": 1}
CASTS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
DENSE_CHUNK = 256
TOPK_CHUNK = 4096


FORMATS = {  # significant bits, smallest normal exponent
    torch.float16: (11, -14),
    torch.bfloat16: (8, -126),
    torch.float32: (24, -126),
}
FLT_MAX = torch.finfo(torch.float32).max


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded once to nearest (ties to even) in ``dtype``, finite values saturating at
    its largest finite value, NaN and ±inf passing: computed exactly in float64 (returned as
    float64) from the format's bits -- no dtype conversion rounds here."""
    y = x.to(torch.float64)  # exact from every float dtype
    if dtype == torch.float64:
        return y
    bits, emin = FORMATS[dtype]
    big = torch.finfo(dtype).max
    y = torch.where(torch.isfinite(y), y.clamp(-big, big), y)
    _, e = torch.frexp(y)  # |y| in [2^(e-1), 2^e): spacing 2^(e - bits), 2^(emin+1-bits) below
    ulp = e.clamp(min=emin + 1) - bits
    return torch.ldexp(torch.ldexp(y, -ulp).round(), ulp)  # power-of-two scalings: exact


def cast(x: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``D(Q(x))`` of a cast decoded into ``dtype`` (``x``'s by default): rounded to the wire
    dtype (``fp32``: ``x``'s own), then into ``dtype`` (both saturating)."""
    dtype = x.dtype if dtype is None else dtype
    wire = CASTS[name] or x.dtype
    return round_to(round_to(x, wire), dtype).to(dtype)


def _next32(v: float, toward: float) -> float:
    t = torch.tensor(v, dtype=torch.float32)
    return float(torch.nextafter(t, torch.tensor(toward, dtype=torch.float32)))


def scale(a: float, levels: int) -> float:
    """The smallest float32 ``s`` with ``s·L >= a`` (exact rationals), at most FLT_MAX."""
    if not math.isfinite(a):
        return a
    target = Fraction(a) / levels
    if target >= FLT_MAX:
        return FLT_MAX
    s = float(torch.tensor(min(float(target), FLT_MAX), dtype=torch.float32))
    while Fraction(s) < target:
        s = _next32(s, math.inf)
    while s > 0 and Fraction(_next32(s, 0.0)) >= target:
        s = _next32(s, 0.0)
    return s


def codes(x: torch.Tensor, s: float, levels: int) -> torch.Tensor:
    """``q`` = the integer nearest the exact ``x / s`` (ties to even), clamped to ``[-L, L]``."""
    if s == 0:
        return torch.zeros(x.shape, dtype=torch.float64)
    x64 = x.to(torch.float64)
    q = (x64 / s).round()
    for i in ((x64 / s - q).abs() == 0.5).nonzero().flatten().tolist():
        q[i] = round(Fraction(float(x64[i])) / Fraction(s))  # float64 cannot decide: exactly
    return q.clamp(-levels, levels)


def absmax(x: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``D(Q(x))`` of one group decoded into ``dtype`` (``x``'s by default): ``q·s`` (exact in
    float64) rounded once into it, ``s`` = :func:`scale` of ``max |x|``, ``q`` = :func:`codes`."""
    dtype = x.dtype if dtype is None else dtype
    if x.numel() == 0:
        return torch.zeros(0, dtype=dtype)
    s = scale(float(x.to(torch.float64).abs().max()), LEVELS[name])
    return round_to(codes(x, s, LEVELS[name]) * s, dtype).to(dtype)


def values(x: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``D(Q(x))`` of a group of values in format ``name``, decoded into ``dtype``."""
    return cast(x, name, dtype) if name in CASTS else absmax(x, name, dtype)


def dense_chunk(numel: int, shards: int) -> int:
    """The absmax chunk of a buffer of ``numel`` values over ``shards`` (smaller when small)."""
    per_rank = -(-numel // shards)
    return min(DENSE_CHUNK, max(4, -(-per_rank // 4) * 4))


def dense(x: torch.Tensor, name: str, shards: int) -> torch.Tensor:
    """``D(Q(x))`` of a dense format over a buffer cut for ``shards`` ranks (chunk by chunk)."""
    if name in CASTS:
        return cast(x, name)
    chunk = dense_chunk(x.numel(), shards)
    out = torch.empty_like(x)
    for lo in range(0, x.numel(), chunk):
        out[lo : lo + chunk] = absmax(x[lo : lo + chunk], name)
    return out


def topk(x: torch.Tensor, density: float, name: str = "fp32") -> torch.Tensor:
    """``D(Q(x))`` of chunked top-k: per chunk the ``ceil(d·c)`` largest magnitudes, coded."""
    chunk = min(TOPK_CHUNK, x.numel())
    keep = min(chunk, max(1, math.ceil(round(density * chunk, 9))))
    out = torch.zeros_like(x)
    for lo in range(0, x.numel(), chunk):
        part = torch.zeros(chunk, dtype=x.dtype)  # the last chunk is padded with zeros
        piece = x[lo : lo + chunk]
        part[: piece.numel()] = piece
        idx = torch.argsort(part.abs(), descending=True, stable=True)[:keep]
        kept = torch.zeros_like(part)
        kept[idx] = values(part[idx], name)
        out[lo : lo + chunk] = kept[: piece.numel()]
    return out


def codec(wire: str, shards: int):
    """``D∘Q`` of ``wire`` (a registry name) as a function of a flat buffer."""
    wire = wire.lower()
    if wire.startswith("topk:"):
        density, _, name = wire[5:].partition("+")
        return lambda x: topk(x, float(density), name or "fp32")
    return lambda x: dense(x, wire, shards)


class Mean:
    """The mean of one buffer per rank in ``wire``, round after round, with error feedback.

    ``fp32``: ``Σ_r x_r / n``. Two-phase (dense lossy formats): ``m = Σ_r D(Q(x_r + e_r)) / n``,
    then ``D(Q(m + ε))``. Gather (top-k): ``Σ_r D(Q(x_r + e_r)) / n``. Residuals
    ``e ← y - D(Q(y))`` for every encoded ``y`` when ``error_feedback``.
    """

    def __init__(self, wire: str, n: int, error_feedback: bool = True) -> None:
        self.wire = wire.lower()
        self.n = n
        self.error_feedback = error_feedback
        self.qd = codec(self.wire, n)
        self.local: list[torch.Tensor] | None = None
        self.shard: torch.Tensor | None = None

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        n = self.n
        if n == 1:  # nothing travels, nothing is encoded
            return xs[0].clone()
        if self.wire == "fp32":
            return _sum_of_shares(xs, n)
        if self.local is None:
            self.local = [torch.zeros_like(x) for x in xs]
            self.shard = torch.zeros_like(xs[0])
        sent = []
        for r, x in enumerate(xs):
            y = self.local[r] + x
            d = self.qd(y)
            if self.error_feedback:
                self.local[r] = y - d
            sent.append(d)
        if self.wire.startswith("topk:"):
            return torch.zeros_like(xs[0]) + _sum_of_shares(sent, n)
        y = self.shard + _sum_of_shares(sent, n)
        d = self.qd(y)
        if self.error_feedback:
            self.shard = y - d
        return d


def _sum_of_shares(xs: list[torch.Tensor], n: int) -> torch.Tensor:
    """``x_0 / n + x_1 / n + ...`` in rank order."""
    acc = xs[0] / n
    for x in xs[1:]:
        acc = acc + x / n
    return acc
