"""Single-process references of the wire formats' math, written from their definitions.

No distoptim code: every function here follows the formulas of ``docs/compression.md`` with
plain loops over chunks, so the codecs and the averaging schemes can be checked against them
(bit for bit where the operations are the same). Spawned children import this module too.
"""

from __future__ import annotations

import math

import torch

LEVELS = {"int8": 127, "int4": 7, "int2": 1}
CASTS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
DENSE_CHUNK = 256
TOPK_CHUNK = 4096


def cast(x: torch.Tensor, name: str) -> torch.Tensor:
    """``D(Q(x))`` of a cast: rounded to the wire dtype, finite values saturating."""
    dtype = CASTS[name]
    if dtype is None:
        return x.clone()
    big = torch.finfo(dtype).max
    y = x.clone()
    finite = torch.isfinite(y)
    y[finite] = y[finite].clamp(-big, big)
    return y.to(dtype).to(x.dtype)


def absmax(x: torch.Tensor, name: str) -> torch.Tensor:
    """``D(Q(x))`` of one group: scale ``s = max|x| / L`` (float32), ``q = round(x / s)``."""
    levels = LEVELS[name]
    s = (x.abs().max() / levels).to(torch.float32).to(x.dtype)
    if s == 0:
        return torch.zeros_like(x)
    return torch.clamp(torch.round(x / s), -levels, levels) * s


def values(x: torch.Tensor, name: str) -> torch.Tensor:
    """``D(Q(x))`` of a group of values in format ``name``."""
    return cast(x, name) if name in CASTS else absmax(x, name)


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
