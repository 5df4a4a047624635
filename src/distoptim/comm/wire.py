"""The wire formats: one registry and one spelling for every buffer averaged over a group.

Owns the names, their parsing, and which averaging scheme each format declares. Grammar
(case-insensitive)::

    wire   := "fp32" | "fp16" | "bf16" | "int8" | "int4" | "int2"
            | "topk:" density [ "+" values ]
    values := "fp32" | "fp16" | "bf16" | "int8" | "int4" | "int2"     (default fp32)

``density`` is a number in ``(0, 1]`` (``topk:0.02`` keeps 2 % of the values). The canonical
name of a top-k format is ``topk:<repr(density)>`` plus ``+values`` unless they are fp32.

Formats (math and byte layouts in :mod:`distoptim.comm.codecs`; bytes each rank sends per
value of the buffer, ``n`` ranks, ``B`` bytes per value of the buffer's dtype)::

    format        Q: what travels                             averaging       bytes per value
    fp32          the buffer as it is (lossless)              SUM all-reduce  2(n-1)/n · B
    fp16, bf16    rounded to 16 bits, finite values saturate  two-phase mean  2(n-1)/n · 2
    int8/int4/2   absmax integers, a float32 scale per chunk  two-phase mean  2(n-1)/n·(b/8 + 4/C)
    topk:d[+v]    per chunk the ceil(d·c) largest magnitudes  gather-and-sum  (n-1) · d · (i + v)

(``b`` bits, ``C`` = 256 values per scale; ``i`` = 1 or 2 bytes per position, ``v`` the value
format's bytes per kept value, scales included.) Averaging schemes:

* **SUM all-reduce** (:class:`~distoptim.comm.averaging.SumMean`): ``x / n`` all-reduced in its
  own dtype; lossless formats need nothing else.
* **two-phase mean** (:class:`~distoptim.comm.quantize.QuantizedMean`): encoded values cannot be
  summed by a SUM all-reduce (integer codes overflow, every rank has its own scales, a 16-bit
  sum rounds at every hop), so shards are exchanged encoded, averaged in full precision by
  their owner, encoded again and all-gathered.
* **gather-and-sum** (:class:`~distoptim.comm.gather.GatheredMean`): sparse vectors with
  different supports do not add position by position, so every rank's top-k travels to every
  rank and is summed densely -- exact, one encoding.

Every lossy format is used with the same error feedback (:mod:`distoptim.comm.feedback`), on
or off. In a group of one nothing travels, whatever the format: the mean is the buffer itself.

The cast formats ``fp32``, ``fp16`` and ``bf16`` can also ride a plain SUM all-reduce with the
sum computed in their dtype (:class:`~distoptim.comm.compression.WireFormat`, no error
feedback): what a synchronous gradient all-reduce needs. :func:`parse_allreduce` accepts
exactly those (and ``None`` for ``fp32``). The outer-optimizer family averages fp16/bf16 with
the two-phase mean instead, which sums in full precision and keeps residuals.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from distoptim.checks import check_real, check_str, type_name
from distoptim.comm.averaging import Mean, SumMean
from distoptim.comm.channel import Channel
from distoptim.comm.codecs import Absmax, Cast, DenseCodec, TopKCodec, Values
from distoptim.comm.compression import CASTS, WireFormat
from distoptim.comm.gather import GatheredMean
from distoptim.comm.quantize import QuantizedMean
from distoptim.comm.stats import CommStats

__all__ = [
    "GRAMMAR",
    "NAMES",
    "Format",
    "Lossless",
    "Quantized",
    "Sparse",
    "parse_allreduce",
    "parse_wire",
]

NAMES = ("fp32", "fp16", "bf16", "int8", "int4", "int2")
"""The formats spelled by a name alone (top-k takes a density: ``topk:0.02``)."""

GRAMMAR = (
    "a wire format is 'fp32', 'fp16', 'bf16', 'int8', 'int4', 'int2', 'topk:D' or 'topk:D+V' "
    "(D a density in (0, 1], e.g. 'topk:0.02'; V the values' format, one of fp32, fp16, bf16, "
    "int8, int4, int2; case-insensitive)"
)


class Format(abc.ABC):
    """One wire format: its canonical name and the averaging scheme it declares."""

    name: str
    lossy: bool
    scheme: str
    """``"all-reduce"``, ``"two-phase"`` or ``"gather"`` (see the module)."""

    def mean(self, channel: Channel, stats: CommStats, error_feedback: bool) -> Mean:
        """The averaging scheme over ``channel`` (:mod:`~distoptim.comm.channel`); on a channel
        of one member the plain one (nothing travels)."""
        if channel.size == 1:
            return SumMean(CASTS["fp32"], channel, stats)
        return self._mean(channel, stats, error_feedback)

    @abc.abstractmethod
    def _mean(self, channel: Channel, stats: CommStats, error_feedback: bool) -> Mean: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclass(frozen=True, repr=False)
class Lossless(Format):
    """``fp32``: the buffer's own dtype, one SUM all-reduce of ``x / n``."""

    name: str = "fp32"
    lossy: bool = False
    scheme: str = "all-reduce"

    @property
    def allreduce(self) -> WireFormat:
        return CASTS[self.name]

    def _mean(self, channel: Channel, stats: CommStats, error_feedback: bool) -> Mean:
        return SumMean(self.allreduce, channel, stats)


@dataclass(frozen=True, repr=False)
class Quantized(Format):
    """A dense lossy format (fp16, bf16, int8, int4, int2): the two-phase mean."""

    name: str
    codec: DenseCodec
    lossy: bool = True
    scheme: str = "two-phase"

    @property
    def allreduce(self) -> WireFormat | None:
        """The cast that can ride a plain SUM all-reduce (fp16, bf16), else ``None``."""
        return CASTS.get(self.name)

    def _mean(self, channel: Channel, stats: CommStats, error_feedback: bool) -> Mean:
        return QuantizedMean(self.codec, channel, stats, error_feedback)


@dataclass(frozen=True, repr=False)
class Sparse(Format):
    """Chunked top-k, values in a value format: gather-and-sum."""

    name: str
    codec: TopKCodec
    lossy: bool = True
    scheme: str = "gather"

    def _mean(self, channel: Channel, stats: CommStats, error_feedback: bool) -> Mean:
        return GatheredMean(self.codec, channel, stats, error_feedback)


def _values(name: str) -> Values:
    if name in ("fp32", "fp16", "bf16"):
        return Cast(name, CASTS[name].dtype)
    return Absmax(name, {"int8": 8, "int4": 4, "int2": 2}[name])


def _format(name: str) -> Format:
    if name == "fp32":
        return Lossless()
    return Quantized(name, DenseCodec(_values(name)))


def parse_wire(spec: object) -> Format:
    """The format ``spec`` spells (see the module's grammar); ``TypeError``/``ValueError``."""
    text = check_str("wire", spec)
    key = text.lower()
    if key in NAMES:
        return _format(key)
    if not key.startswith("topk:"):
        raise ValueError(f"unknown wire {text!r}: {GRAMMAR}")
    density_text, plus, values = key[len("topk:") :].partition("+")
    if plus and values not in NAMES:
        raise ValueError(
            f"unknown wire {text!r}: the values' format {values!r} is not one of "
            f"{', '.join(NAMES)}; {GRAMMAR}"
        )
    try:
        density = check_real("density", float(density_text), 0.0, 1.0, low_open=True)
    except ValueError:
        raise ValueError(
            f"unknown wire {text!r}: the density {density_text!r} is not a number in (0, 1]; "
            f"{GRAMMAR}"
        ) from None
    codec = TopKCodec(density, _values(values or "fp32"))
    return Sparse(codec.name, codec)


def parse_allreduce(spec: object) -> WireFormat:
    """The cast of a plain SUM all-reduce: ``None`` or ``"fp32"`` (lossless), ``"fp16"`` or
    ``"bf16"`` (case-insensitive). Formats that cannot be summed by an all-reduce (int8, int4,
    int2, top-k) raise ``ValueError`` saying why."""
    if spec is None:
        return CASTS["fp32"]
    if not isinstance(spec, str):
        raise TypeError(
            f"compression must be None, 'fp32', 'fp16' or 'bf16', got {type_name(spec)} {spec!r}"
        )
    wire = parse_wire(spec)
    cast = CASTS.get(wire.name)
    if cast is None:
        raise ValueError(
            f"wire {spec!r} cannot ride a plain SUM all-reduce (its encoded values do not add "
            "up: integer codes with per-rank scales, or sparse values at per-rank positions); "
            "allowed values are None, 'fp32', 'fp16', 'bf16'"
        )
    return cast
