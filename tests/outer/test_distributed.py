"""DiLoCo / LocalSGD on real process groups: replays against the references, wires, checkpoints.

One 2-rank spawn runs every 2-replica check (the exact replays, every wire format of the
registry replayed against the reference with its own averaging math, ``topk:1.0`` against
``fp32`` bit for bit, error feedback over 50 syncs, checkpoints with a sync in flight -- and
residuals -- through torch.save for every format and torch.distributed.checkpoint, finite
syncs of huge pseudo-gradients, the agreement check, a fragment exchange moved to other
channels); one 4-rank spawn (slow) runs subgroups
and 4-way lossy means. The parent compares against :mod:`tests.outer.reference`.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from distoptim import DiLoCo
from distoptim.comm.channel import GroupChannel
from distoptim.comm.guard import DesyncError
from distoptim.comm.stats import CommStats, ring_allreduce_bytes
from distoptim.comm.wire import parse_wire
from distoptim.launch import spawn
from distoptim.outer.agreement import HEADER_BYTES
from distoptim.outer.exchange import FragmentExchange
from tests.comm import reference as wire_ref
from tests.outer import reference as ref
from tests.outer.reference import Config

ATOL = 1e-10
EXACT = {
    "diloco_sgd": Config(),
    "diloco_adamw": Config(inner="adamw"),
    "localsgd": Config(outer=None, sync_every=2, steps=6),
    "fragments2": Config(sync_every=4, fragments=2, steps=12),
    "streaming": Config(sync_every=4, fragments=2, delay=1, alpha=0.5, steps=13),
}
FIRST_SYNC = Config(sync_every=3, steps=3)  # one sync: the wire's error is visible alone
DRIFT = Config(inner="adamw", sync_every=2, steps=100)  # 50 syncs
NUMEL = 57  # parameters of reference.mlp()
# every format of the registry, replayed against the reference (F = 2; and delay 1, alpha 0.5)
LOSSY = ["fp16", "bf16", "int8", "int4", "int2", "topk:0.1", "topk:0.25+int2", "topk:1.0"]
NO_FEEDBACK = ["int4", "topk:0.25+int2"]
REPLAYS = {"fragments2": EXACT["fragments2"], "streaming": EXACT["streaming"]}
HUGE = 0.75 * torch.finfo(torch.float32).max  # finite, above FLT_MAX / 2


def _with(cfg: Config, **changes: Any) -> Config:
    return Config(**{**vars(cfg), **changes})


def _run(cfg: Config, rank: int, world: int, **extra: Any) -> dict[str, Any]:
    model, opt = ref.run(cfg, rank, world, **extra)
    return {
        "local": ref.flat(model.parameters()),
        "global": ref.flat(opt.global_parameters),
        "bytes": opt.comm_stats.bytes_sent,
        "collectives": opt.comm_stats.collectives,
    }


def _round_trip(cfg: Config, rank: int, world: int, split: int, ckpt_dir: str | None) -> bool:
    """Checkpoint after ``split`` steps (torch.save, or DCP into ``ckpt_dir``), resume, compare."""
    model, opt = ref.run(cfg, rank, world, stop=split)
    if ckpt_dir is None:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    else:  # per-replica keys: DCP writes one copy of each key, replicas differ between syncs
        dcp.save(
            {f"replica{rank}": {"model": model.state_dict(), "opt": opt.state_dict()}},
            checkpoint_id=ckpt_dir,
        )
    ref.run(cfg, rank, world, start=split, model=model, opt=opt)

    # the resumed replica starts elsewhere: other weights, a few steps of its own
    model2, opt2 = ref.run(cfg, rank, world, stop=split, model=ref.mlp(seed=7))
    if ckpt_dir is None:
        saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    else:
        saved = {"model": model2.state_dict(), "opt": opt2.state_dict()}
        dcp.load({f"replica{rank}": saved}, checkpoint_id=ckpt_dir)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    ref.run(cfg, rank, world, start=split, model=model2, opt=opt2)
    return torch.equal(ref.flat(model.parameters()), ref.flat(model2.parameters())) and (
        torch.equal(ref.flat(opt.global_parameters), ref.flat(opt2.global_parameters))
    )


def _expect_mismatch(fn: Any) -> str:
    try:
        fn()
    except DesyncError as exc:  # ParameterMismatchError is one too
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _huge_sync(wire: str) -> torch.Tensor:
    """The global copy after one sync whose pseudo-gradients are ±0.75 FLT_MAX (float32)."""
    p = torch.nn.Parameter(torch.zeros(64))
    opt = DiLoCo(torch.optim.SGD([p], lr=1.0), torch.optim.SGD([p], lr=1.0), 1, wire=wire)
    p.grad = torch.full_like(p, HUGE)
    p.grad[1::2] *= -1
    opt.step()  # θ_r = -g, so Δ = θ_g - θ_r = g on both replicas; θ_g' = -mean Δ
    return opt.global_parameters[0].clone()


def _residuals_refused(rank: int, world: int) -> str:
    """A checkpoint whose residuals have another scheme's names is refused before loading."""
    cfg = _with(EXACT["fragments2"], wire="topk:0.25+int2", steps=4)
    _, opt = ref.run(cfg, rank, world)
    sd = copy.deepcopy(opt.state_dict())
    entry = sd["wrapper"]["residuals"][0][0]
    entry["shard"] = entry["local"].clone()  # as a two-phase format would have
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _formats(rank: int, world: int) -> dict[str, Any]:
    """Every format of the registry: replays, resumes with a sync in flight, huge values."""
    out: dict[str, Any] = {}
    for wire in LOSSY:
        for name, cfg in REPLAYS.items():
            out["replay", wire, name, True] = _run(_with(cfg, wire=wire), rank, world)
        stream = _with(EXACT["streaming"], wire=wire)
        out["resume", wire] = _round_trip(stream, rank, world, 6, None)
        out["residual_names", wire] = [
            sorted(r)
            for r in ref.run(stream, rank, world)[1].state_dict()["wrapper"]["residuals"][0]
        ]
    for wire in NO_FEEDBACK:
        for name, cfg in REPLAYS.items():
            cfg = _with(cfg, wire=wire, error_feedback=False)
            out["replay", wire, name, False] = _run(cfg, rank, world)
    for wire in ("fp32", *LOSSY):
        out["huge", wire] = _huge_sync(wire)
    out["residuals_refused"] = _residuals_refused(rank, world)
    return out


def _rebind(rank: int) -> dict[str, bool]:
    """FragmentExchange.rebind: a channel of the same size and rank keeps the scheme and its
    residuals; another size rebuilds them (residuals from zero) for the new layout."""
    local = [torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))]
    global_ = [torch.zeros(300, dtype=torch.float64)]
    ex = FragmentExchange(
        local, global_, parse_wire("int8"), GroupChannel(None, 2), CommStats(), True, 1 << 20, False
    )

    def sync() -> torch.Tensor:
        ex.form()
        return ex.finish(ex.launch())[0]

    first = sync().clone()
    residual = ex.residuals[0]["local"]
    out = {"kept": not ex.rebind(GroupChannel(None, 2)) and ex.residuals[0]["local"] is residual}
    alone, _ = dist.new_subgroups_by_enumeration([[0], [1]])
    out["alone"] = ex.rebind(GroupChannel(alone, 1)) and ex.residuals == []
    out["own"] = torch.equal(sync(), global_[0] - local[0])  # Δ itself
    out["back"] = ex.rebind(GroupChannel(None, 2)) and all(
        not r.any() for r in ex.residuals[0].values()
    )
    out["fresh"] = torch.equal(sync(), first)  # zero residuals, as at first
    return out


def _two_ranks(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: _run(cfg, rank, world) for name, cfg in EXACT.items()}
    out["rebind"] = _rebind(rank)
    for wire in ("fp32", "bf16", "int8"):
        out["first", wire] = _run(_with(FIRST_SYNC, wire=wire), rank, world)
        for ef in (True, False) if wire != "fp32" else (True,):
            drift = _with(DRIFT, wire=wire, error_feedback=ef)
            out["drift", wire, ef] = _run(drift, rank, world)["local"]
    stream_int8 = _with(EXACT["streaming"], wire="int8")
    out["stream_int8"] = _run(stream_int8, rank, world)
    out["resume", "fp32"] = _round_trip(EXACT["streaming"], rank, world, 6, None)
    out["resume", "dcp"] = _round_trip(EXACT["streaming"], rank, world, 6, f"{ckpt_dir}/a")
    out.update(_formats(rank, world))

    # options that differ on one rank, and checkpoints of different steps
    other = Config(sync_every=2 if rank == 0 else 4, steps=4)
    out["mismatch_options"] = _expect_mismatch(lambda: ref.run(other, rank, world))
    seeded = ref.mlp(seed=rank)  # replicas that do not start from the same weights
    out["mismatch_weights"] = _expect_mismatch(
        lambda: ref.run(EXACT["diloco_sgd"], rank, world, model=seeded)
    )
    cfg = EXACT["fragments2"]  # rank 1 keeps its step-4 state, rank 0 its step-6 state
    model, opt = ref.run(cfg, rank, world, stop=4)
    sd = copy.deepcopy(opt.state_dict())
    ref.run(cfg, rank, world, start=4, stop=6, model=model, opt=opt)
    sd = sd if rank else opt.state_dict()
    model, opt = ref.run(cfg, rank, world, stop=0)
    opt.load_state_dict(sd)
    out["mismatch_steps"] = _expect_mismatch(
        lambda: ref.run(cfg, rank, world, start=sd["iterations"], model=model, opt=opt)
    )
    dist.barrier()  # every collective above paired up: the group is still usable
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(_two_ranks, 2, args=(str(tmp_path_factory.mktemp("dcp")),), timeout=120)


@pytest.mark.parametrize("name", sorted(EXACT))
def test_two_replicas_match_reference(two_ranks, name):
    local, global_ = ref.simulate(EXACT[name], 2)
    for rank in range(2):
        got = two_ranks[rank][name]
        torch.testing.assert_close(got["local"], local[rank], rtol=0, atol=ATOL)
        torch.testing.assert_close(got["global"], global_, rtol=0, atol=ATOL)
    # every replica holds the same global copy, bit for bit
    assert torch.equal(two_ranks[0][name]["global"], two_ranks[1][name]["global"])


def test_a_fragment_exchange_moves_to_another_channel(two_ranks):
    for rank in range(2):
        assert two_ranks[rank]["rebind"] == dict.fromkeys(
            ("kept", "alone", "own", "back", "fresh"), True
        )


def test_localsgd_is_the_parameter_average(two_ranks):
    # at a sync step every replica holds the mean of the replicas' parameters
    cfg = Config(outer=None, sync_every=1000, steps=6)  # the same steps, never synced
    unsynced = [ref.flat(ref.run(cfg, r, 2)[0].parameters()) for r in range(2)]
    synced = ref.simulate(Config(outer=None, sync_every=6, steps=6), 2)[0]
    torch.testing.assert_close(synced[0], (unsynced[0] + unsynced[1]) / 2, rtol=0, atol=ATOL)


def test_fp32_bytes_are_one_ring_all_reduce_per_sync(two_ranks):
    got = two_ranks[0]["diloco_sgd"]
    syncs = EXACT["diloco_sgd"].steps // EXACT["diloco_sgd"].sync_every
    # each sync's header (words, fingerprints and two float64 sums) goes to the one peer
    assert got["bytes"] == syncs * (ring_allreduce_bytes(NUMEL * 8, 2) + HEADER_BYTES)
    assert got["collectives"] == 2 * syncs  # each sync: its header, then the all-reduce


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_first_sync_error_is_bounded_by_the_quantization_step(two_ranks, wire):
    exact, lossy = two_ranks[0]["first", "fp32"], two_ranks[0]["first", wire]
    assert torch.equal(lossy["global"], two_ranks[1]["first", wire]["global"])
    # Δ_r = θ_0 - θ_r(H), from the same inner steps without a sync
    unsynced = Config(outer=None, sync_every=1000, steps=FIRST_SYNC.steps)
    theta0 = ref.flat(ref.mlp().parameters())
    deltas = [theta0 - ref.flat(ref.run(unsynced, r, 2)[0].parameters()) for r in range(2)]
    mean = (deltas[0] + deltas[1]) / 2
    if wire == "int8":
        layout = parse_wire("int8").codec.layout(NUMEL, 2, torch.float64)

        def step(x):  # per element: absmax of its chunk / 127
            padded = torch.zeros(layout.padded, dtype=x.dtype)
            padded[:NUMEL] = x.abs()
            chunks = padded.view(-1, layout.chunk)
            return (chunks.amax(1, keepdim=True) / 127).expand_as(chunks).reshape(-1)[:NUMEL]

        bound = (step(deltas[0]) + step(deltas[1])) / 4
        bound = bound + step(mean.abs() + bound) / 2
    else:
        bound = 2**-8 * (deltas[0].abs() + deltas[1].abs()) / 2
        bound = bound + 2**-8 * (mean.abs() + bound)
    # first Nesterov step from a zero buffer moves θ by lr (1 + μ) Δ̄
    diff = (lossy["global"] - exact["global"]).abs()
    assert torch.all(diff <= 0.7 * 1.9 * bound * (1 + 1e-6) + 1e-15)
    assert diff.max() > 0  # and it is lossy
    assert lossy["bytes"] < exact["bytes"]


@pytest.mark.parametrize("wire", ["bf16", "int8"])
def test_error_feedback_reduces_the_drift_over_50_syncs(two_ranks, wire):
    exact = two_ranks[0]["drift", "fp32", True]
    with_ef = (two_ranks[0]["drift", wire, True] - exact).norm()
    without = (two_ranks[0]["drift", wire, False] - exact).norm()
    assert 0 < with_ef * 2 < without


def test_streaming_int8_stays_close_and_moves_fewer_bytes(two_ranks):
    exact, lossy = two_ranks[0]["streaming"], two_ranks[0]["stream_int8"]
    assert torch.equal(lossy["global"], two_ranks[1]["stream_int8"]["global"])
    rel = (lossy["global"] - exact["global"]).norm() / exact["global"].norm()
    assert 0 < rel < 1e-2
    assert lossy["bytes"] < exact["bytes"]


@pytest.mark.parametrize("how", ["fp32", "dcp", *LOSSY])
def test_resume_with_a_sync_in_flight(two_ranks, how):
    # the payload slots and every replica's residuals travel in the checkpoint
    assert two_ranks[0]["resume", how] and two_ranks[1]["resume", how]


@pytest.mark.parametrize(
    ("wire", "ef", "name"),
    [(w, True, n) for w in LOSSY for n in REPLAYS]
    + [(w, False, n) for w in NO_FEEDBACK for n in REPLAYS],
)
def test_every_format_matches_the_reference(two_ranks, wire, ef, name):
    cfg = _with(REPLAYS[name], wire=wire, error_feedback=ef)
    local, global_ = ref.simulate(cfg, 2)
    for rank in range(2):
        got = two_ranks[rank]["replay", wire, name, ef]
        torch.testing.assert_close(got["local"], local[rank], rtol=0, atol=ATOL)
        torch.testing.assert_close(got["global"], global_, rtol=0, atol=ATOL)
    assert torch.equal(
        two_ranks[0]["replay", wire, name, ef]["global"],
        two_ranks[1]["replay", wire, name, ef]["global"],
    )
    if wire != "topk:1.0":  # the wire is really lossy: the run differs from the exact one
        exact = ref.simulate(REPLAYS[name], 2)[1]
        assert (global_ - exact).abs().max() > 1e-12


@pytest.mark.parametrize("name", sorted(REPLAYS))
def test_topk_at_density_one_is_the_fp32_sync_bit_for_bit(two_ranks, name):
    for rank in range(2):
        dense, sparse = two_ranks[rank][name], two_ranks[rank]["replay", "topk:1.0", name, True]
        assert torch.equal(dense["local"], sparse["local"])
        assert torch.equal(dense["global"], sparse["global"])


def test_residuals_are_in_the_state_dict_by_scheme(two_ranks):
    for wire in LOSSY:
        names = ["local"] if wire.startswith("topk") else ["local", "shard"]
        assert two_ranks[0]["residual_names", wire] == [names], wire
    text = two_ranks[0]["residuals_refused"]
    assert "residuals'][0][0] must be a dict of ['local']" in text, text


@pytest.mark.parametrize("wire", ["fp32", *LOSSY])
def test_huge_finite_pseudo_gradients_give_a_finite_global_copy(two_ranks, wire):
    got = two_ranks[0]["huge", wire]
    assert torch.isfinite(got).all(), got[:4]
    assert torch.equal(got, two_ranks[1]["huge", wire])
    if wire in ("fp32", "bf16", "int8", "int4", "int2", "topk:1.0"):
        torch.testing.assert_close(got.abs(), torch.full_like(got, HUGE), rtol=2**-7, atol=0)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("mismatch_options", "ParameterMismatchError: DiLoCo: replicas disagree on the"),
        ("mismatch_options", "options: sync_every: rank 0 2, rank 1 4"),
        ("mismatch_steps", "DesyncError: DiLoCo: replicas are out of step -- step counters"),
        ("mismatch_weights", "ParameterMismatchError: DiLoCo: replicas hold different global"),
    ],
)
def test_replicas_that_disagree_raise_on_every_rank(two_ranks, case, says):
    for rank in range(2):
        text = two_ranks[rank][case]
        assert says in text and "rank 0" in text and "rank 1" in text, text


# ---------------------------------------------------------------------------------------------
# four ranks: subgroups, a 4-way quantized mean
# ---------------------------------------------------------------------------------------------
SUBGROUPS = [[0, 2], [1, 3]]


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["diloco"] = _run(EXACT["diloco_adamw"], rank, world, group=SUBGROUPS)
    out["streaming"] = _run(EXACT["streaming"], rank, world, group=SUBGROUPS)
    pg, _ = dist.new_subgroups_by_enumeration(SUBGROUPS)
    out["localsgd"] = _run(EXACT["localsgd"], rank, world, group=pg)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1000, generator=g, dtype=torch.float64)
    for wire in ("int8", "topk:0.1+int2"):
        mean = parse_wire(wire).mean(GroupChannel(None, world), CommStats(), True)
        buffers = mean.buffers(x.clone(), keep_payload=False)
        payload = x.clone()
        mean.finish(mean.launch(payload, buffers), payload, buffers)
        out["mean", wire] = payload
    return out


@pytest.mark.slow
def test_four_ranks_two_subgroups():
    outs = spawn(_four_ranks, 4, timeout=240)
    for name, cfg in (
        ("diloco", EXACT["diloco_adamw"]),
        ("streaming", EXACT["streaming"]),
        ("localsgd", EXACT["localsgd"]),
    ):
        for members in SUBGROUPS:
            local, global_ = ref.simulate(cfg, 4, members)
            for i, rank in enumerate(members):
                torch.testing.assert_close(outs[rank][name]["local"], local[i], rtol=0, atol=ATOL)
                torch.testing.assert_close(outs[rank][name]["global"], global_, rtol=0, atol=ATOL)
    # the two subgroups really trained apart
    assert not torch.allclose(outs[0]["diloco"]["global"], outs[1]["diloco"]["global"])
    xs = [
        torch.randn(1000, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        for r in range(4)
    ]
    for wire in ("int8", "topk:0.1+int2"):
        got = outs[0]["mean", wire]
        assert all(torch.equal(got, o["mean", wire]) for o in outs)
        reference = wire_ref.Mean(wire, 4)(xs)  # the 4-way sum in rank order
        torch.testing.assert_close(got, reference, rtol=0, atol=1e-12)
        assert (got - torch.stack(xs).mean(0)).abs().max() > 0
