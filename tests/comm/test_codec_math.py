"""Every codec against its documented math, in float64, on every float dtype, at the extremes.

For each wire format (the casts, the absmax integers, top-k with every value format) and each
buffer dtype (float16, bfloat16, float32, float64) the encoded bytes are decoded into float64
and into the buffer's dtype and compared, bit for bit, with :mod:`tests.comm.reference` (which
computes the definitions exactly: rationals where float64 cannot decide), and the documented
bounds are checked on their own: ``|x - q·s| <= s/2`` for absmax, the relative error ``2^-p``
(half a subnormal step below the normal range) for casts. The data covers random values, each
dtype's largest finite value, smallest normal and subnormal magnitudes, values small next to
the dtype's range, and zero-size buffers.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from distoptim.comm.codecs import Absmax, CodecError, DenseCodec, TopKCodec, narrow
from distoptim.comm.wire import parse_wire
from tests.comm import reference as ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
DENSE = ["fp16", "bf16", "int8", "int4", "int2"]
SPARSE = ["topk:0.25", "topk:0.25+fp16", "topk:0.25+bf16", "topk:0.3+int8", "topk:0.25+int4"]
SPARSE += ["topk:0.5+int2"]
CASES = ["random", "largest", "smallest_normal", "subnormal", "mixed", "small", "empty"]
BLOCK = 256  # one absmax chunk (the buffers are 1024 values over 2 shards)
BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _subnormal(dtype: torch.dtype) -> float:
    """The smallest positive (subnormal) value of ``dtype``."""
    return torch.finfo(dtype).smallest_normal * 2.0 ** (1 - BITS[dtype])


def _signs(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=g, dtype=torch.float64).mul_(2).sub_(1)


def _data(case: str, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of ``dtype`` (finite values): 1024 values but for ``empty``."""
    g = torch.Generator().manual_seed(CASES.index(case) * 10 + DTYPES.index(dtype))
    fi = torch.finfo(dtype)
    n = 4 * BLOCK
    if case == "empty":
        return torch.zeros(0, dtype=dtype)
    if case == "random":  # magnitudes over five decades, within every dtype's normal range
        scale = torch.logspace(-4, 1, n, dtype=torch.float64)
        x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    elif case == "largest":  # the top of the range, the largest value itself in every chunk
        x = torch.rand(n, generator=g, dtype=torch.float64).mul_(0.5).add_(0.5).mul_(fi.max)
        x[::BLOCK] = fi.max
    elif case == "smallest_normal":
        x = torch.rand(n, generator=g, dtype=torch.float64).add_(1).mul_(fi.smallest_normal)
        x[::BLOCK] = fi.smallest_normal
    elif case == "subnormal":  # k times the smallest subnormal, k = 0 .. 255
        x = torch.randint(0, 256, (n,), generator=g, dtype=torch.float64) * _subnormal(dtype)
        x[::BLOCK] = _subnormal(dtype)
    elif case == "mixed":  # every extreme in every chunk, and zeros
        pool = torch.tensor(
            [fi.max, fi.max / 3, 1.0, fi.smallest_normal, _subnormal(dtype), 0.0],
            dtype=torch.float64,
        )
        x = pool[torch.randint(0, pool.numel(), (n,), generator=g)]
    else:  # "small": far below 1, as a float16 pseudo-gradient of a slowly moving weight
        x = torch.randn(n, generator=g, dtype=torch.float64) * 1e-6
    x = (x * _signs(g, n)).to(dtype)
    assert torch.isfinite(x).all()
    return x


def _cast_bound(x: torch.Tensor, d: torch.Tensor, wire: torch.dtype) -> None:
    """``|x - D| <= 2^-p |x|``, or half a subnormal step below the normal range, unless ``x``
    saturated (then ``D`` is the wire's largest finite value)."""
    big = torch.finfo(wire).max
    x = x.to(torch.float64)
    inside = x.abs() <= big
    bound = torch.maximum(x.abs() * 2.0 ** -BITS[wire], torch.tensor(_subnormal(wire) / 2))
    assert torch.all((x - d).abs()[inside] <= bound[inside])
    assert torch.all(d[~inside].abs() == big)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("wire", DENSE)
def test_dense_codecs_follow_their_math(wire, dtype, case):
    x = _data(case, dtype)
    codec = parse_wire(wire).codec
    for shards in (1, 2):
        layout = codec.layout(x.numel(), shards, dtype)
        rows = torch.zeros(layout.padded, dtype=dtype)
        rows[: x.numel()] = x
        rows = rows.view(shards, layout.shard)
        out = torch.empty(shards, layout.width, dtype=torch.uint8)
        codec.encode(rows, out, layout)
        exact = codec.decode(out, torch.float64, layout).reshape(-1)[: x.numel()]
        mine = codec.decode(out, dtype, layout).reshape(-1)[: x.numel()]
        assert torch.isfinite(exact).all() and torch.isfinite(mine).all()
        # D rounded once into the buffer's dtype, saturating
        assert torch.equal(mine, ref.round_to(exact, dtype).to(dtype))
        if wire in ("fp16", "bf16"):
            assert torch.equal(exact, ref.cast(x, wire, torch.float64)), (shards, "cast")
            _cast_bound(x, exact, ref.CASTS[wire])
        else:
            chunk = layout.chunk
            levels = ref.LEVELS[wire]
            for lo in range(0, x.numel(), chunk):
                part = x[lo : lo + chunk]
                s = ref.scale(float(part.to(torch.float64).abs().max()), levels)
                want = ref.codes(part, s, levels) * s  # exact in float64
                assert torch.equal(exact[lo : lo + chunk], want), (shards, lo)
                if s < ref.FLT_MAX:  # the documented bound, exactly
                    assert torch.all((part.to(torch.float64) - want).abs() <= s / 2), lo
                assert s > 0 or not part.any()  # a chunk sends something unless it is zero
        # error feedback's step: x - D(Q(x)) in the buffer's dtype
        left = rows.clone()
        codec.subtract_decoded(left, out, layout)
        assert torch.equal(left, rows - codec.decode(out, dtype, layout))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("wire", SPARSE)
def test_topk_codecs_follow_their_math(wire, dtype, case):
    x = _data(case, dtype)
    codec = parse_wire(wire).codec
    name = codec.values.name
    layout = codec.layout(x.numel(), dtype)
    row = torch.zeros(1, layout.padded, dtype=dtype)
    row[0, : x.numel()] = x
    out = torch.empty(1, layout.width, dtype=torch.uint8)
    codec.encode(row, out, layout)
    positions, exact = codec.decode(out, torch.float64, layout)
    dense = codec.dense(out, dtype, layout)[0]
    keep = min(layout.chunk, math.ceil(round(codec.density * layout.chunk, 9)))
    magnitude = row[0].to(torch.float64).abs()
    for c in range(layout.chunks):
        lo, hi = c * layout.chunk, (c + 1) * layout.chunk
        kept = positions[0, c * keep : (c + 1) * keep]
        assert kept.unique().numel() == keep and torch.all((kept >= lo) & (kept < hi))
        others = torch.ones(layout.chunk, dtype=torch.bool)
        others[kept - lo] = False
        if others.any():  # a top-k: nothing left out is larger than what was kept
            assert magnitude[kept].min() >= magnitude[lo:hi][others].max()
        got = exact[0, c * keep : (c + 1) * keep]
        assert torch.equal(got, ref.values(row[0, kept], name, torch.float64)), c
    want = torch.zeros(layout.padded, dtype=dtype)
    want[positions[0]] = ref.round_to(exact[0], dtype).to(dtype)
    assert torch.equal(dense, want) and torch.isfinite(dense).all()
    left = row.clone()
    codec.subtract_decoded(left, out, layout)
    assert torch.equal(left, row - dense)


@pytest.mark.parametrize("wire", [*DENSE, *SPARSE])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_size_buffers_encode_to_nothing(wire, dtype):
    codec = parse_wire(wire).codec
    dense = isinstance(codec, DenseCodec)
    layout = codec.layout(0, 2, dtype) if dense else codec.layout(0, dtype)
    rows = 2 if dense else 1
    x = torch.zeros(rows, 0, dtype=dtype)
    out = torch.empty(rows, layout.width, dtype=torch.uint8)
    assert layout.width == 0
    codec.encode(x, out, layout)
    back = codec.decode(out, dtype, layout) if dense else codec.dense(out, dtype, layout)
    assert back.shape == (rows, 0) and back.dtype == dtype
    codec.subtract_decoded(x, out, layout)


def test_codes_are_nearest_to_the_exact_quotient_where_float32_rounds_onto_a_tie():
    """``fl32(x / s)`` can land on ``k + 1/2`` when ``x / s`` is just above it: the code is
    then ``k + 1``, not the even ``k`` that rounding the float32 quotient gives."""
    coder = Absmax("int8", 8)
    a = float(torch.tensor(100.3, dtype=torch.float32))
    s = ref.scale(a, 127)
    values, wrong = [a], 0
    for k in range(0, 126, 2):
        x = float(torch.tensor((k + 0.5) * s, dtype=torch.float32))
        quotient = torch.tensor(x, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32)
        if float(quotient) == k + 0.5 and Fraction(x) / Fraction(s) > k + 0.5:
            values.append(x)
            wrong += 1
    assert wrong >= 10  # the naive float32 rounding would miss every one of them
    x = torch.tensor(values, dtype=torch.float32)
    out = torch.empty(1, coder.width(1, x.numel(), x.dtype), dtype=torch.uint8)
    coder.encode(x.view(1, 1, -1), out)
    back = coder.decode(out, 1, x.numel(), x.dtype, torch.float64).view(-1)
    assert torch.equal(back, ref.codes(x, s, 127) * s)
    assert torch.all((x.double() - back).abs() <= s / 2)


def test_float64_to_half_rounds_once():
    """torch converts float64 to float16/bfloat16 through float32 (two roundings)."""
    x = [1 + 2**-8 + 2**-30, 1 + 2**-11 + 2**-40, -(1 + 2**-8 + 2**-30)]
    x = torch.tensor(x, dtype=torch.float64)
    assert narrow(x[:1], torch.bfloat16).item() == 1 + 2**-7
    assert narrow(x[1:2], torch.float16).item() == 1 + 2**-10
    assert narrow(x[2:], torch.bfloat16).item() == -(1 + 2**-7)
    assert torch.equal(narrow(x, torch.bfloat16).double(), ref.round_to(x, torch.bfloat16))


def test_non_finite_values_stay_non_finite():
    """A chunk with ±inf or NaN decodes to non-finite values (scales are never saturated
    from a non-finite absmax): a non-finite pseudo-gradient stays visible."""
    for bad in (math.inf, -math.inf, math.nan):
        for dtype in DTYPES:
            x = torch.ones(8, dtype=dtype)
            x[3] = bad
            for wire in ("int8", "int2", "fp16", "topk:0.5+int4"):
                codec = parse_wire(wire).codec
                if isinstance(codec, TopKCodec):
                    layout = codec.layout(8, dtype)
                    out = torch.empty(1, layout.width, dtype=torch.uint8)
                    codec.encode(x.view(1, -1), out, layout)
                    back = codec.dense(out, torch.float64, layout)
                else:
                    layout = codec.layout(8, 1, dtype)
                    out = torch.empty(1, layout.width, dtype=torch.uint8)
                    codec.encode(x.view(1, -1), out, layout)
                    back = codec.decode(out, torch.float64, layout)
                assert not torch.isfinite(back).all(), (bad, dtype, wire)


def test_a_local_codec_failure_is_a_codec_error_not_a_runtime_error():
    """What fails inside a codec is this rank's own error: never one a caller could take for
    a failed collective (those are RuntimeErrors)."""
    codec = parse_wire("int8").codec
    x = torch.ones(1, 8, dtype=torch.complex64)  # no absmax integers of complex values
    layout = codec.layout(8, 1, x.dtype)
    out = torch.empty(1, layout.width, dtype=torch.uint8)
    with pytest.raises(CodecError, match=r"wire 'int8': encode of a \(1, 8\) torch.complex64") as e:
        codec.encode(x, out, layout)
    assert not isinstance(e.value, RuntimeError)
    assert "no peer is involved" in str(e.value)
