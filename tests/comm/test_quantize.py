"""Wire formats: the codecs' error bounds and layouts, and the two-phase quantized mean on 2 ranks.

The multi-rank checks run in one spawned group: identical results on every rank, error within
the quantization steps, the bytes both phases put on the wire, a settled phase 1 finishing as
the original, and error feedback keeping the summed error of many rounds bounded.
"""

from __future__ import annotations

import pytest
import torch

from distoptim.comm.quantize import (
    WIRES,
    BF16Codec,
    Int8Codec,
    PendingMean,
    QuantizedMean,
    codec_for,
    parse_wire,
)
from distoptim.comm.stats import CommStats
from distoptim.launch import spawn

NUMEL = 1000
ROUNDS = 20


def _chunk_steps(x: torch.Tensor, layout) -> torch.Tensor:
    """Per element: the int8 step ``absmax(chunk) / 127`` of the chunk it falls in (padded x)."""
    padded = torch.zeros(layout.padded, dtype=x.dtype)
    padded[: x.numel()] = x
    chunks = padded.view(-1, layout.chunk)
    steps = chunks.abs().amax(dim=1, keepdim=True).expand_as(chunks) / 127
    return steps.reshape(-1)[: x.numel()]


def test_parse_wire():
    assert [parse_wire(w.upper()) for w in WIRES] == list(WIRES)
    with pytest.raises(ValueError, match="unknown wire 'fp8'"):
        parse_wire("fp8")
    with pytest.raises(TypeError):
        parse_wire(None)
    assert codec_for("fp32") is None
    assert isinstance(codec_for("int8"), Int8Codec) and isinstance(codec_for("bf16"), BF16Codec)


@pytest.mark.parametrize(("numel", "shards"), [(1, 2), (7, 2), (1000, 4), (5000, 3), (256, 1)])
def test_int8_layout(numel, shards):
    layout = Int8Codec().layout(numel, shards)
    assert layout.padded >= numel and layout.shard % layout.chunk == 0
    assert layout.chunk % 4 == 0 and layout.chunk <= 256
    assert layout.width == layout.shard + 4 * layout.shard // layout.chunk
    assert layout.padded - numel < shards * layout.chunk  # padding below one chunk per shard


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int8_round_trip_error_is_half_a_step(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUMEL, generator=g, dtype=dtype) * torch.logspace(-3, 2, NUMEL, dtype=dtype)
    x[:256] = 0  # an all-zero chunk stays zero
    codec = Int8Codec()
    layout = codec.layout(NUMEL, 2)
    rows = torch.zeros(layout.padded, dtype=dtype)
    rows[:NUMEL] = x
    rows = rows.view(2, layout.shard)
    wire = torch.empty(2, layout.width, dtype=torch.int8)
    codec.encode(rows, wire, layout)
    back = codec.decode(wire, dtype, layout).reshape(-1)[:NUMEL]
    err = (back - x).abs()
    assert torch.all(err <= _chunk_steps(x, layout) * (0.5 + 1e-6))
    assert torch.equal(back[:256], x[:256])
    assert not torch.equal(back, x)  # it is lossy


def test_bf16_round_trip():
    x = torch.randn(100, dtype=torch.float64)
    codec = BF16Codec()
    layout = codec.layout(100, 2)
    wire = torch.empty(2, layout.width, dtype=torch.bfloat16)
    codec.encode(x.view(2, 50), wire, layout)
    assert torch.equal(
        codec.decode(wire, torch.float64, layout).reshape(-1), x.to(torch.bfloat16).double()
    )


def test_a_group_of_one_has_nothing_to_average():
    with pytest.raises(ValueError, match=">= 2 ranks"):
        QuantizedMean(Int8Codec(), None, 1, CommStats())


# ---------------------------------------------------------------------------------------------
# two ranks
# ---------------------------------------------------------------------------------------------
def _inputs(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    scale = torch.logspace(-4, 1, NUMEL, dtype=torch.float64)  # small values beside large ones
    return torch.randn(NUMEL, generator=g, dtype=torch.float64) * scale


def _mean_once(wire: str, error_feedback: bool, rounds: int) -> dict:
    codec = codec_for(wire)
    stats = CommStats()
    qm = QuantizedMean(codec, None, 2, stats, error_feedback)
    layout = qm.layout(NUMEL)
    x = _inputs(torch.distributed.get_rank())
    residuals = qm.new_residuals(layout, x) if error_feedback else None
    scratch = None if error_feedback else x.new_zeros(layout.padded)
    total = torch.zeros_like(x)
    first = None
    for _ in range(rounds):
        out = torch.empty_like(x)
        qm.finish(qm.launch(x, residuals, scratch), out, residuals)
        total += out
        first = out if first is None else first
    return {"first": first, "total": total, "bytes": stats.bytes_sent, "width": layout.width}


def _settled_then_restored() -> bool:
    """A phase 1 settled into a slot (as a checkpoint would) finishes bit-identically."""
    qm = QuantizedMean(Int8Codec(), None, 2, CommStats(), error_feedback=True)
    x = _inputs(torch.distributed.get_rank())
    layout = qm.layout(NUMEL)
    res_a, res_b = qm.new_residuals(layout, x), qm.new_residuals(layout, x)
    direct = torch.empty_like(x)
    qm.finish(qm.launch(x, res_a, None), direct, res_a)
    pending = qm.launch(x, res_b, None)
    slot = x.new_zeros(layout.shard)
    qm.settle(pending, slot)
    restored = PendingMean(layout, x.dtype, None, None, shard_mean=slot.clone())
    via_slot = torch.empty_like(x)
    qm.finish(restored, via_slot, res_b)
    return torch.equal(direct, via_slot) and torch.equal(res_a.local, res_b.local)


HUGE = 0.75 * torch.finfo(torch.float32).max  # finite, above FLT_MAX / 2


def _huge_mean(wire: str) -> torch.Tensor:
    """The mean of float32 values above FLT_MAX / n: finite, as a float32 all-reduce of x / n."""
    qm = QuantizedMean(codec_for(wire), None, 2, CommStats(), error_feedback=True)
    x = torch.full((NUMEL,), HUGE, dtype=torch.float32)
    x[1::2] *= -1
    residuals = qm.new_residuals(qm.layout(NUMEL), x)
    out = torch.empty_like(x)
    qm.finish(qm.launch(x, residuals, None), out, residuals)
    return out


def _two_ranks(rank: int, world: int) -> dict:
    out = {}
    for wire in ("bf16", "int8"):
        for ef in (True, False):
            out[wire, ef] = _mean_once(wire, ef, ROUNDS)
    out["restored"] = _settled_then_restored()
    out["huge"] = {wire: _huge_mean(wire) for wire in ("bf16", "int8")}
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_two_ranks, 2, timeout=120)


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_mean_is_identical_on_every_rank_and_within_the_steps(two_ranks, wire):
    exact = (_inputs(0) + _inputs(1)) / 2
    a, b = two_ranks[0][wire, True], two_ranks[1][wire, True]
    assert torch.equal(a["first"], b["first"]) and torch.equal(a["total"], b["total"])
    err = (a["first"] - exact).abs()
    if wire == "int8":
        layout = Int8Codec().layout(NUMEL, 2)
        # phase 1: each rank's error <= its step / 2; phase 2: <= the mean's step / 2
        bound = (_chunk_steps(_inputs(0), layout) + _chunk_steps(_inputs(1), layout)) / 4
        phase2 = Int8Codec().layout(NUMEL, 2)
        bound = bound + _chunk_steps(exact.abs() + bound, phase2) / 2
    else:
        # bfloat16 keeps 8 significant bits: relative rounding error <= 2^-8 per phase
        bound = 2**-8 * (_inputs(0).abs() + _inputs(1).abs()) / 2
        bound = bound + 2**-8 * (exact.abs() + bound)
    assert torch.all(err <= bound * (1 + 1e-6))
    assert err.max() > 0  # lossy: demonstrably not the exact mean


@pytest.mark.parametrize(("wire", "item"), [("bf16", 2), ("int8", 1)])
def test_bytes_are_both_phases(two_ranks, wire, item):
    r = two_ranks[0][wire, True]
    # each round: (n - 1) shards in the all-to-all and (n - 1) in the all-gather, n = 2
    assert r["bytes"] == ROUNDS * 2 * r["width"] * item
    fp32_ring = 2 * (2 - 1) / 2 * NUMEL * 8  # float64 all-reduce of the same buffer
    assert r["bytes"] / ROUNDS < fp32_ring / (3.5 if wire == "int8" else 3.0)


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_error_feedback_keeps_the_summed_error_bounded(two_ranks, wire):
    exact = ROUNDS * (_inputs(0) + _inputs(1)) / 2
    with_ef = (two_ranks[0][wire, True]["total"] - exact).abs()
    without = (two_ranks[0][wire, False]["total"] - exact).abs()
    one_round = (two_ranks[0][wire, False]["first"] - exact / ROUNDS).abs()
    # without feedback the same rounding repeats every round: ROUNDS times one round's error
    torch.testing.assert_close(without, ROUNDS * one_round, rtol=1e-9, atol=1e-12)
    # with it, the residuals carry what was dropped: the sum stays within ~one round's error
    assert with_ef.sum() < 3 * one_round.sum()
    assert with_ef.sum() * 5 < without.sum()


def test_settled_phase_one_finishes_identically(two_ranks):
    assert two_ranks[0]["restored"] and two_ranks[1]["restored"]


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_the_mean_of_huge_finite_values_is_finite(two_ranks, wire):
    # both ranks send +-0.75 FLT_MAX: summing the decoded copies before dividing overflows
    got = two_ranks[0]["huge"][wire]
    assert torch.isfinite(got).all(), got[:4]
    torch.testing.assert_close(got.abs(), torch.full_like(got, HUGE), rtol=2**-8, atol=0)
