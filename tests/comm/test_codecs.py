"""The codecs against :mod:`tests.comm.reference`: ``D(Q(x))`` bit for bit, byte layouts, bounds.

Single process: every format's encode/decode round trip equals the plain reference of its math,
each row carries exactly the documented bytes, the absmax error is at most half a step, casts
saturate finite values and pass non-finite ones, and error feedback leaves exactly what was
dropped.
"""

from __future__ import annotations

import math

import pytest
import torch

from distoptim.comm.codecs import Absmax, Cast, DenseCodec, TopKCodec
from distoptim.comm.feedback import ErrorFeedback, NoFeedback
from distoptim.comm.wire import parse_wire
from tests.comm import reference as ref

DENSE = ["fp16", "bf16", "int8", "int4", "int2"]
SPARSE = ["topk:0.02", "topk:0.1+int2", "topk:0.3+int4", "topk:0.5+int8", "topk:0.05+bf16"]
SIZES = [1, 7, 57, 1000, 5003]


def _data(numel: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 1, numel, dtype=torch.float64)  # small values beside large ones
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def _dense_round_trip(wire: str, x: torch.Tensor, shards: int) -> tuple[torch.Tensor, object]:
    codec = parse_wire(wire).codec
    layout = codec.layout(x.numel(), shards, x.dtype)
    rows = torch.zeros(layout.padded, dtype=x.dtype)
    rows[: x.numel()] = x
    rows = rows.view(shards, layout.shard)
    out = torch.empty(shards, layout.width, dtype=torch.uint8)
    codec.encode(rows, out, layout)
    return codec.decode(out, x.dtype, layout).reshape(-1)[: x.numel()], layout


@pytest.mark.parametrize("wire", DENSE)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("shards", [1, 2, 3])
def test_dense_formats_match_the_reference(wire, numel, shards):
    for dtype in (torch.float32, torch.float64):
        x = _data(numel, dtype)
        back, _ = _dense_round_trip(wire, x, shards)
        assert torch.equal(back, ref.dense(x, wire, shards)), (wire, numel, shards, dtype)


@pytest.mark.parametrize("wire", SPARSE)
@pytest.mark.parametrize("numel", [*SIZES, 9000])
def test_topk_formats_match_the_reference(wire, numel):
    codec = parse_wire(wire).codec
    density, _, name = wire[5:].partition("+")
    for dtype in (torch.float32, torch.float64):
        x = _data(numel, dtype, seed=numel)
        layout = codec.layout(numel, dtype)
        row = torch.zeros(1, layout.padded, dtype=dtype)
        row[0, :numel] = x
        out = torch.empty(1, layout.width, dtype=torch.uint8)
        codec.encode(row, out, layout)
        back = codec.dense(out, dtype, layout)[0, :numel]
        assert torch.equal(back, ref.topk(x, float(density), name or "fp32")), (wire, dtype)
        kept = math.ceil(round(float(density) * layout.chunk, 9))
        assert int((back != 0).sum()) <= kept * layout.chunks


@pytest.mark.parametrize(
    ("wire", "numel", "shards", "width"),
    [
        # dense: per row, the codes of `shard` values plus 4 bytes per chunk of scales
        ("int8", 1000, 2, 512 + 4 * 2),  # shard 512 = 2 chunks of 256
        ("int4", 1000, 2, 256 + 4 * 2),
        ("int2", 1000, 2, 128 + 4 * 2),
        ("int2", 7, 2, 1 + 4),  # 4 values per shard: one chunk of 4, one byte of codes
        ("bf16", 1001, 2, 501 * 2),
        ("fp16", 10, 3, 4 * 2),
    ],
)
def test_dense_widths(wire, numel, shards, width):
    layout = parse_wire(wire).codec.layout(numel, shards, torch.float32)
    assert layout.width == width
    assert layout.padded >= numel and layout.padded - numel < shards * layout.chunk


@pytest.mark.parametrize(
    ("wire", "numel", "dtype", "width"),
    [
        # positions (1 byte when the chunk has <= 256 values, else 2) then the kept values
        ("topk:0.02", 1000, torch.float32, 20 * 2 + 20 * 4),
        ("topk:0.02", 1000, torch.float64, 20 * 2 + 20 * 8),  # fp32 keeps the buffer's dtype
        ("topk:0.02", 200, torch.float32, 4 * 1 + 4 * 4),  # one chunk of 200: uint8 positions
        ("topk:0.02+int2", 10000, torch.float32, 3 * (82 * 2) + math.ceil(3 * 82 / 4) + 3 * 4),
        ("topk:0.1+int4", 57, torch.float64, 6 * 1 + 3 + 4),
        ("topk:1.0", 5, torch.float32, 5 * 1 + 5 * 4),
        ("topk:0.01+bf16", 8192, torch.float32, 2 * 41 * 2 + 2 * 41 * 2),
    ],
)
def test_topk_widths(wire, numel, dtype, width):
    layout = parse_wire(wire).codec.layout(numel, dtype)
    assert layout.width == width


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_absmax_error_is_at_most_half_a_step(name):
    x = _data(4096)
    x[:256] = 0  # an all-zero chunk stays zero
    back, layout = _dense_round_trip(name, x, 2)
    steps = x.view(-1, layout.chunk).abs().amax(1, keepdim=True) / ref.LEVELS[name]
    err = (back - x).view(-1, layout.chunk).abs()
    assert torch.all(err <= steps * (0.5 + 1e-6))
    assert torch.equal(back[:256], x[:256])
    assert not torch.equal(back, x)  # it is lossy


def test_codes_pack_and_unpack_for_every_count():
    for bits, name in ((2, "int2"), (4, "int4")):
        coder = Absmax(name, bits)
        for count in (1, 3, 5, 8, 13):
            values = torch.arange(count, dtype=torch.float64).sub_(count / 2).view(1, 1, count)
            out = torch.empty(1, coder.width(1, count, torch.float64), dtype=torch.uint8)
            coder.encode(values, out)
            assert out.shape[1] == math.ceil(count * bits / 8) + 4
            back = coder.decode(out, 1, count, torch.float64, torch.float64)
            assert torch.equal(back.view(-1), ref.absmax(values.view(-1), name))


def test_casts_saturate_finite_values_and_pass_the_others():
    x = torch.tensor([1e6, -1e6, math.inf, -math.inf, math.nan, 3.0], dtype=torch.float32)
    coder = Cast("fp16", torch.float16)
    out = torch.empty(1, coder.width(1, 6, x.dtype), dtype=torch.uint8)
    coder.encode(x.view(1, 1, 6), out)
    back = coder.decode(out, 1, 6, x.dtype, x.dtype).view(-1)
    assert back[:2].tolist() == [65504.0, -65504.0]
    assert back[2:4].tolist() == [math.inf, -math.inf] and math.isnan(back[4])
    assert back[5] == 3.0
    near_max = torch.tensor([torch.finfo(torch.float32).max], dtype=torch.float32)
    bf16, _ = _dense_round_trip("bf16", near_max, 1)  # would round up to inf unsaturated
    assert torch.isfinite(bf16).all()


@pytest.mark.parametrize("wire", ["int2", "topk:0.1+int2"])
def test_error_feedback_keeps_exactly_what_was_dropped(wire):
    codec = parse_wire(wire).codec
    x = _data(600)
    dense = isinstance(codec, DenseCodec)
    layout = codec.layout(600, 2, x.dtype) if dense else codec.layout(600, x.dtype)
    shape = (2, layout.shard) if dense else (1, layout.padded)
    residual = torch.zeros(layout.padded, dtype=x.dtype)
    sent_sum = torch.zeros(layout.padded, dtype=x.dtype)
    for k in range(5):  # e ← (x + e) - D(Q(x + e)), round after round
        y = residual.clone()
        y[:600] += x
        rows = ErrorFeedback().combine(x, residual).view(shape)
        out = torch.empty(shape[0], layout.width, dtype=torch.uint8)
        ErrorFeedback().encode(codec, rows, out, layout)
        sent = codec.decode(out, x.dtype, layout) if dense else codec.dense(out, x.dtype, layout)
        assert torch.equal(residual, y - sent.reshape(-1)), k
        sent_sum += sent.reshape(-1)
    # what travelled sums to what was meant minus only the current residual
    torch.testing.assert_close(sent_sum[:600] + residual[:600], 5 * x, rtol=0, atol=1e-12)
    # without feedback the input is encoded as it is and nothing is kept
    scratch = torch.zeros(layout.padded, dtype=x.dtype)
    rows = NoFeedback().combine(x, scratch).view(shape)
    out = torch.empty(shape[0], layout.width, dtype=torch.uint8)
    NoFeedback().encode(codec, rows, out, layout)
    assert torch.equal(scratch[:600], x)


def test_codec_arguments_are_checked():
    with pytest.raises(ValueError, match="density"):
        TopKCodec(0.0, Cast("fp32", None))
    with pytest.raises(ValueError, match="chunk"):
        TopKCodec(0.5, Cast("fp32", None), chunk=1 << 16)
    with pytest.raises(ValueError, match="bits"):
        Absmax("int3", 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        DenseCodec(Absmax("int8", 8), chunk=6)
