"""The averaging schemes on two real ranks, against :mod:`tests.comm.reference`.

One spawned 2-rank group runs every format (SUM all-reduce, two-phase mean, gather-and-sum),
with and without error feedback, for many rounds; the parent checks: the same result on both
ranks, bit for bit the reference's mean (residuals included, round after round), the bytes each
rank sent, error feedback keeping the summed error bounded, a settled mean restored from its
slot finishing as the original, finite means of finite inputs above FLT_MAX / n, and the mean
dividing by the channel's contributors (a member that takes part without contributing).
"""

from __future__ import annotations

import math

import pytest
import torch

from distoptim.comm.averaging import Mean
from distoptim.comm.channel import GroupChannel
from distoptim.comm.stats import CommStats
from distoptim.comm.wire import parse_wire
from distoptim.launch import spawn
from tests.comm import reference as ref

NUMEL = 1000
ROUNDS = 12
LOSSY = ["fp16", "bf16", "int8", "int4", "int2", "topk:0.02", "topk:0.1+int2", "topk:0.3+int4"]
WIRES = ["fp32", *LOSSY, "topk:1.0"]
HUGE = 0.75 * torch.finfo(torch.float32).max  # finite, above FLT_MAX / 2


def _inputs(rank: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    scale = torch.logspace(-4, 1, NUMEL, dtype=torch.float64)  # small values beside large ones
    return (torch.randn(NUMEL, generator=g, dtype=torch.float64) * scale).to(dtype)


def _once(mean: Mean, x: torch.Tensor, buffers) -> torch.Tensor:
    payload = x.clone()  # the payload is overwritten with the mean
    mean.finish(mean.launch(payload, buffers), payload, buffers)
    return payload


def _rounds(wire: str, error_feedback: bool) -> dict:
    stats = CommStats()
    mean = parse_wire(wire).mean(GroupChannel(None, 2), stats, error_feedback)
    x = _inputs(torch.distributed.get_rank())
    buffers = mean.buffers(x.clone(), keep_payload=False)
    outs = [_once(mean, x, buffers) for _ in range(ROUNDS)]
    return {
        "outs": torch.stack(outs),
        "bytes": stats.bytes_sent,
        "collectives": stats.collectives,
        "residuals": {k: v.clone() for k, v in buffers.residuals.items()},
    }


def _settled_then_restored(wire: str) -> bool:
    """A launched mean settled into its slot (as a checkpoint would hold it) and restored from
    a copy of that slot finishes bit-identically, residuals included."""
    mean = parse_wire(wire).mean(GroupChannel(None, 2), CommStats(), True)
    x = _inputs(torch.distributed.get_rank())
    direct_buffers = mean.buffers(x.clone(), keep_payload=True)
    direct = _once(mean, x, direct_buffers)
    payload = x.clone()
    buffers = mean.buffers(payload, keep_payload=True)
    pending = mean.launch(payload, buffers)
    mean.settle(pending, buffers)
    saved = buffers.slot.clone()
    buffers.slot.zero_()  # a fresh process: the slot comes from the checkpoint
    buffers.slot.copy_(saved)
    restored = mean.restore(payload, buffers)
    mean.finish(restored, payload, buffers)
    same_residuals = all(
        torch.equal(direct_buffers.residuals[k], buffers.residuals[k]) for k in buffers.residuals
    )
    return torch.equal(direct, payload) and same_residuals


def _huge(wire: str) -> torch.Tensor:
    """The mean of ±0.75 FLT_MAX in float32 on both ranks."""
    mean = parse_wire(wire).mean(GroupChannel(None, 2), CommStats(), True)
    x = torch.full((NUMEL,), HUGE, dtype=torch.float32)
    x[1::2] *= -1
    return _once(mean, x, mean.buffers(x.clone(), keep_payload=False))


class _FirstOnly(GroupChannel):
    """The default group, in which only rank 0's payload counts (rank 1 sends zeros)."""

    @property
    def contributors(self) -> int:
        return 1


def _contributors(wire: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One mean over a channel of 2 members with 1 contributor, and over the plain channel."""
    x = _inputs(0) if torch.distributed.get_rank() == 0 else torch.zeros(NUMEL, dtype=torch.float64)
    outs = []
    for channel in (_FirstOnly(None, 2), GroupChannel(None, 2)):
        mean = parse_wire(wire).mean(channel, CommStats(), False)
        outs.append(_once(mean, x, mean.buffers(x.clone(), keep_payload=False)))
    return outs[0], outs[1]


def _two_ranks(rank: int, world: int) -> dict:
    out: dict = {}
    for wire in ("fp32", "int8", "topk:0.1"):
        out["contributors", wire] = _contributors(wire)
    for wire in WIRES:
        out[wire, True] = _rounds(wire, True)
        if wire in LOSSY:
            out[wire, False] = _rounds(wire, False)
        out["restored", wire] = _settled_then_restored(wire)
        out["huge", wire] = _huge(wire)
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(_two_ranks, 2, timeout=180)


def _reference(wire: str, error_feedback: bool) -> torch.Tensor:
    mean = ref.Mean(wire, 2, error_feedback)
    return torch.stack([mean([_inputs(0), _inputs(1)]) for _ in range(ROUNDS)])


@pytest.mark.parametrize(("wire", "ef"), [(w, True) for w in WIRES] + [(w, False) for w in LOSSY])
def test_every_round_is_the_reference_mean_on_both_ranks(two_ranks, wire, ef):
    a, b = two_ranks[0][wire, ef], two_ranks[1][wire, ef]
    assert torch.equal(a["outs"], b["outs"])
    assert torch.equal(a["outs"], _reference(wire, ef))
    if wire in LOSSY:
        exact = (_inputs(0) / 2 + _inputs(1) / 2).expand(ROUNDS, -1)
        assert (a["outs"] - exact).abs().max() > 0  # lossy: demonstrably not the exact mean


def _width(wire: str) -> int:
    """Bytes of one row on the wire for NUMEL float64 values over 2 ranks (docs/compression.md)."""
    if wire.startswith("topk:"):
        density, _, values = wire[5:].partition("+")
        keep = math.ceil(float(density) * NUMEL)  # one chunk of NUMEL (< 4096) values
        index = 2  # 2-byte positions: the chunk has more than 256 values
        if values in ("", "fp32"):
            return keep * (index + 8)  # values in the buffer's dtype
        bits = int(values[3:])
        return keep * index + math.ceil(keep * bits / 8) + 4  # one float32 scale per chunk
    shard = NUMEL // 2
    if wire in ("fp16", "bf16"):
        return 2 * shard
    bits = int(wire[3:])
    shard = 512  # 500 values rounded up to whole chunks of 256
    return shard * bits // 8 + 4 * (shard // 256)


@pytest.mark.parametrize("wire", WIRES)
def test_bytes_are_counted_as_sent(two_ranks, wire):
    got = two_ranks[0][wire, True]
    scheme = parse_wire(wire).scheme
    if scheme == "all-reduce":  # the ring all-reduce's 2 (n - 1) / n of the buffer
        per_round, collectives = 2 * (2 - 1) * NUMEL * 8 // 2, 1
    elif scheme == "two-phase":  # (n - 1) rows in the all-to-all, (n - 1) in the all-gather
        per_round, collectives = 2 * (2 - 1) * _width(wire), 2
    else:  # gather-and-sum: this rank's row to the n - 1 others
        per_round, collectives = (2 - 1) * _width(wire), 1
    assert got["bytes"] == ROUNDS * per_round
    assert got["collectives"] == ROUNDS * collectives


@pytest.mark.parametrize("wire", ["bf16", "int8", "int4", "int2", "topk:0.3+int4"])
def test_error_feedback_keeps_the_summed_error_bounded(two_ranks, wire):
    exact = ROUNDS * (_inputs(0) + _inputs(1)) / 2
    with_ef = (two_ranks[0][wire, True]["outs"].sum(0) - exact).abs()
    without = (two_ranks[0][wire, False]["outs"].sum(0) - exact).abs()
    one_round = (two_ranks[0][wire, False]["outs"][0] - exact / ROUNDS).abs()
    # without feedback the same rounding repeats every round: ROUNDS times one round's error
    torch.testing.assert_close(without, ROUNDS * one_round, rtol=1e-9, atol=1e-12)
    # with it, the residuals carry what was dropped
    assert with_ef.sum() * 3 < without.sum()


def test_residuals_are_per_rank_and_named_by_scheme(two_ranks):
    for wire, names in (("int8", {"local", "shard"}), ("topk:0.02", {"local"}), ("fp32", set())):
        a, b = two_ranks[0][wire, True]["residuals"], two_ranks[1][wire, True]["residuals"]
        assert set(a) == names
        for name in names:
            assert not torch.equal(a[name], b[name]) and a[name].abs().max() > 0
    assert two_ranks[0]["int8", False]["residuals"] == {}


def test_topk_at_density_one_is_the_lossless_mean_bit_for_bit(two_ranks):
    assert torch.equal(two_ranks[0]["topk:1.0", True]["outs"], two_ranks[0]["fp32", True]["outs"])


@pytest.mark.parametrize("wire", WIRES)
def test_a_settled_mean_restored_from_its_slot_finishes_identically(two_ranks, wire):
    assert two_ranks[0]["restored", wire] and two_ranks[1]["restored", wire]


@pytest.mark.parametrize("wire", ["fp32", "int8", "topk:0.1"])
def test_the_mean_divides_by_the_channels_contributors(two_ranks, wire):
    one, plain = two_ranks[0]["contributors", wire]
    assert torch.equal(one, two_ranks[1]["contributors", wire][0])
    # rank 1 sent zeros: over one contributor the mean is twice the mean over two, exactly
    # (every encoding scales by powers of two), and for fp32 rank 0's payload itself
    assert torch.equal(one, 2 * plain)
    if wire == "fp32":
        assert torch.equal(one, _inputs(0))


@pytest.mark.parametrize("wire", WIRES)
def test_the_mean_of_huge_finite_values_is_finite(two_ranks, wire):
    # both ranks send ±0.75 FLT_MAX: summing the decoded copies before dividing overflows
    got = two_ranks[0]["huge", wire]
    assert torch.isfinite(got).all(), got[:4]
    if wire in ("fp32", "bf16", "int8", "int4", "int2", "topk:1.0"):  # fp16 saturates at
        # 65504, top-k below density 1 sends only some values
        torch.testing.assert_close(got.abs(), torch.full_like(got, HUGE), rtol=2**-7, atol=0)
