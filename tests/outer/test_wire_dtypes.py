"""DiLoCo's wire formats on parameters of every float dtype and size, on two real replicas.

One 2-rank spawn (gloo) runs: Streaming DiLoCo with a fragment made only of zero-size
parameters under every wire (it syncs like ``fp32``, on every rank); float64 parameters whose
finite pseudo-gradients pass float32's range under the absmax wires (the global copy stays
finite, saturated at ``L · FLT_MAX``, and later syncs go on); float16 parameters with small
pseudo-gradients under int8/int4 (they move the global copy as ``fp32`` does, within the
quantization step); an encoding that fails on a rank raises there as a local CodecError.
Every rank's result is checked.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from distoptim import DiLoCo
from distoptim.comm.channel import GroupChannel
from distoptim.comm.stats import CommStats
from distoptim.comm.wire import parse_wire
from distoptim.launch import spawn
from distoptim.outer.exchange import FragmentExchange

WIRES = ["fp32", "fp16", "bf16", "int8", "int4", "int2", "topk:0.5", "topk:0.5+int2"]
STREAMING = {"delay0": (0, 0.0), "delay1": (1, 0.5)}  # fragment_sync_delay, update alpha
STEPS = 8
FLT_MAX = torch.finfo(torch.float32).max
LEVELS = {"int8": 127, "int4": 7, "int2": 1}
HUGE = [1e300, -1e300, 1e41, -5e40, 3.0, 0.0]  # finite in float64, past float32's range


def _zero_size_fragment(rank: int, wire: str, delay: int, alpha: float) -> dict[str, Any]:
    """Streaming DiLoCo, F = 2: fragment 0 a weight of 8 values, fragment 1 only empty ones."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8))
    empty = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(0, 3))]
    params = [weight, *empty]
    opt = DiLoCo(
        torch.optim.SGD(params, lr=0.1),
        torch.optim.SGD(params, lr=0.7, momentum=0.5),
        sync_every=4,
        fragments=2,
        fragment_sync_delay=delay,
        fragment_update_alpha=alpha,
        wire=wire,
    )
    try:
        for t in range(STEPS):
            weight.grad = torch.full_like(weight, float(rank + 1 + t))
            for p in empty:
                p.grad = torch.zeros_like(p)
            opt.step()
        opt.finish()
    except Exception as exc:  # the parent shows what every rank raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "error": None,
        "syncs": opt.syncs,
        "refused": opt.refused_syncs,
        "global": [g.detach().clone() for g in opt.global_parameters],
        "local": [p.detach().clone() for p in params],
    }


def _huge_float64(wire: str) -> dict[str, Any]:
    """Two syncs of float64 parameters: the first with pseudo-gradients up to 1e300."""
    p = torch.nn.Parameter(torch.zeros(len(HUGE), dtype=torch.float64))
    opt = DiLoCo(torch.optim.SGD([p], lr=1.0), torch.optim.SGD([p], lr=1.0), 1, wire=wire)
    p.grad = torch.tensor(HUGE, dtype=torch.float64)
    opt.step()  # θ_r = -g, so Δ = g on both replicas and θ_g' = -mean Δ
    first = opt.global_parameters[0].detach().clone()
    p.grad = torch.ones_like(p)
    try:
        opt.step()  # the next sync is not refused: the global copy is finite
    except Exception as exc:  # (the parent shows it)
        return {"first": first, "error": f"{type(exc).__name__}: {exc}"}
    return {
        "first": first,
        "second": opt.global_parameters[0].detach().clone(),
        "refused": opt.refused_syncs,
        "error": None,
    }


def _small_float16(rank: int, wire: str) -> torch.Tensor:
    """One sync of float16 parameters whose pseudo-gradients are about 1e-6."""
    p = torch.nn.Parameter(torch.zeros(300, dtype=torch.float16))
    opt = DiLoCo(torch.optim.SGD([p], lr=1.0), torch.optim.SGD([p], lr=1.0), 1, wire=wire)
    g = torch.linspace(-3e-6, 3e-6, 300, dtype=torch.float64) * (1 + rank)
    p.grad = g.to(torch.float16)
    opt.step()
    return opt.global_parameters[0].detach().clone()


def _local_codec_failure() -> str:
    """A sync whose encoding fails on this rank (no absmax integers of complex values)."""
    local = [torch.ones(8, dtype=torch.complex64)]
    global_ = [torch.zeros(8, dtype=torch.complex64)]
    channel = GroupChannel(None, 2)
    exchange = FragmentExchange(
        local, global_, parse_wire("int8"), channel, CommStats(), True, 1 << 20, False
    )
    try:
        exchange.launch()
    except Exception as exc:  # (the parent shows it)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _child(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {"local_failure": _local_codec_failure()}
    dist.barrier()  # no collective was left half-issued: the group still works
    for wire in WIRES:
        for name, (delay, alpha) in STREAMING.items():
            out["zero", wire, name] = _zero_size_fragment(rank, wire, delay, alpha)
    for wire in ("int8", "int4", "int2", "topk:1.0+int8"):
        out["huge", wire] = _huge_float64(wire)
    for wire in ("fp32", "int8", "int4"):
        out["small", wire] = _small_float16(rank, wire)
    return out


@pytest.fixture(scope="module")
def ranks():
    return spawn(_child, 2, timeout=180)


@pytest.mark.parametrize("name", sorted(STREAMING))
@pytest.mark.parametrize("wire", WIRES)
def test_a_fragment_of_zero_size_parameters_syncs_under_every_wire(ranks, wire, name):
    fp32 = ranks[0]["zero", "fp32", name]
    assert fp32["error"] is None, fp32["error"]
    torch.manual_seed(0)
    start = torch.randn(8)  # the weight every replica starts from
    for rank in range(2):
        got = ranks[rank]["zero", wire, name]
        assert got["error"] is None, f"rank {rank}: {got['error']}"
        assert got["syncs"] == fp32["syncs"] > 0 and got["refused"] == 0
        assert [g.shape for g in got["global"]] == [(8,), (0,), (0, 3)]
        assert [p.shape for p in got["local"]] == [(8,), (0,), (0, 3)]
        # the replicas agree on the global copy, bit for bit, and the weight's moved
        rank0 = ranks[0]["zero", wire, name]["global"]
        assert all(torch.equal(g, h) for g, h in zip(got["global"], rank0))
        assert (got["global"][0] - start).abs().min() > 0.1


@pytest.mark.parametrize("wire", ["int8", "int4", "int2", "topk:1.0+int8"])
def test_float64_pseudo_gradients_past_float32_range_give_a_finite_global_copy(ranks, wire):
    levels = LEVELS[wire.rpartition("+")[2]]
    for rank in range(2):
        got = ranks[rank]["huge", wire]
        assert got["error"] is None, f"rank {rank}: {got['error']}"
        first = got["first"]
        assert torch.isfinite(first).all() and torch.isfinite(got["second"]).all(), first
        assert got["refused"] == 0
        assert torch.equal(first, ranks[0]["huge", wire]["first"])
        assert torch.equal(got["second"], ranks[0]["huge", wire]["second"])
        # saturated at L · FLT_MAX, with the signs of the pseudo-gradients
        big = torch.tensor(HUGE, dtype=torch.float64).abs() > levels * FLT_MAX
        assert torch.equal(first[big].abs(), torch.full_like(first[big], levels * FLT_MAX))
        assert torch.equal(first[big].sign(), -torch.tensor(HUGE, dtype=torch.float64)[big].sign())


@pytest.mark.parametrize("wire", ["int8", "int4"])
def test_small_float16_pseudo_gradients_move_the_global_copy(ranks, wire):
    fp32 = ranks[0]["small", "fp32"]
    assert fp32.abs().max() > 0
    step = float(fp32.abs().max()) / LEVELS[wire]  # the mean's absmax step, about
    for rank in range(2):
        got = ranks[rank]["small", wire]
        assert torch.equal(got, ranks[0]["small", wire])
        assert (got != 0).sum() > 0.9 * got.numel()
        assert (got.double() - fp32.double()).abs().max() <= 2 * step


def test_a_local_encoding_failure_is_reported_as_itself_on_every_rank(ranks):
    for rank in range(2):
        text = ranks[rank]["local_failure"]
        assert text.startswith("CodecError: wire 'int8': encode of a (2, 4) torch.complex64"), text
        assert "no peer is involved" in text and "stopped taking part" not in text
