"""CrossShardOptimizer(shard_optimizer_state=True): weight-update sharding (ZeRO-1, Xu et al.).

Results are compared bitwise (float64) with the unsharded optimizer -- itself replayed against
single-process references in ``test_cross_shard.py`` -- for every element-wise torch optimizer.
One 2-rank spawn bundles the multi-rank checks; one shard (no process group) runs the same
flat machinery without communication and covers the rest in-process.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import CrossShardOptimizer, DesyncError
from distoptim.comm.shard_transport import (
    AllReduceStandIn,
    NativeTransport,
    PairwiseExchange,
    ShardTransport,
)
from distoptim.cross_shard_sharding import ELEMENTWISE_OPTIMIZERS, elementwise
from distoptim.launch import spawn
from distoptim.sync import sharding
from tests.test_cross_shard import TwoHeads, clipped_on_one_rank

PER_RANK = 4
STEPS = 3

Make = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Make] = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.05, amsgrad=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=0.05),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=1.0),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=0.05),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=0.05),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=0.05),
}


@elementwise
class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023): sign of an interpolated momentum; element-wise."""

    def __init__(self, params: Any, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class GlobalNormSGD(torch.optim.SGD):
    """Clips by the norm of *all* gradients inside step(): couples elements, not shardable."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, 1.0)
        return super().step(closure)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3))


def _data(world: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(STEPS + 1, world * PER_RANK, 6, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS + 1, world * PER_RANK, 3, generator=g, dtype=torch.float64)
    return x, y


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two param groups with different hyperparameters (the second at a tenth of the rate)."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first}, {"params": rest, "lr": 0.005}]


def _train(
    opt: CrossShardOptimizer,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    schedule: bool = True,
) -> None:
    """Steps with zero_grad, accumulation across a step boundary, apply_gradients, a schedule."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if schedule else None

    def loss_of(k: int) -> torch.Tensor:
        return F.mse_loss(model(x[k]), y[k])

    for k in range(STEPS):
        opt.zero_grad()
        loss_of(k).backward()
        opt.step()
        if sched is not None:
            sched.step()
    loss_of(STEPS).backward()  # no zero_grad: accumulates onto the last step's gradient
    opt.step()
    opt.apply_gradients(opt.compute_gradients(loss_of(0)))


def _use_transport(opt: CrossShardOptimizer, kind: type[ShardTransport]) -> None:
    """Make ``opt``'s sharded collectives travel over ``kind`` (gloo: pairwise by default)."""
    scatter = opt._rounds.comm.scatter
    t = scatter.transport
    scatter.transport = kind(t.group, t.size, t.rank, t.ranks)


def _pair(
    make: Make,
    rows: torch.Tensor,
    world: int,
    transport: type[ShardTransport] = PairwiseExchange,
    **kwargs: Any,
) -> tuple[tuple[torch.Tensor, dict], tuple[torch.Tensor, dict], CrossShardOptimizer]:
    """The same training unsharded and sharded: (params, state dict) of each, and the sharded.

    ``transport``: how the sharded run's reduce-scatter and all-gather travel (on gloo, the
    pairwise exchange by default; gloo's own collectives, or the all-reduce stand-in).
    """
    x, y = _data(world)
    out = []
    for shard in (False, True):
        model = _mlp().double()
        # unsharded with bucket views leaves the replica mean in .grad (the same update up to
        # rounding); sharded keeps the local gradient, as the unsharded default does
        mine = (
            kwargs if shard else {k: v for k, v in kwargs.items() if k != "gradient_as_bucket_view"}
        )
        opt = CrossShardOptimizer(make(_groups(model)), shard_optimizer_state=shard, **mine)
        if shard:
            _use_transport(opt, transport)
        _train(opt, model, x[:, rows], y[:, rows])
        opt.consolidate_state_dict(to=None)  # every rank reads the gathered state
        out.append((_flat(model), opt.state_dict(), opt))
        opt.remove_hooks()
    return out[0][:2], out[1][:2], out[1][2]


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for k, sa in a["state"].items():
        sb = b["state"][k]
        if sa.keys() != sb.keys():
            return False
        for n, va in sa.items():
            vb = sb[n]
            same = (
                torch.is_tensor(vb) and va.shape == vb.shape and torch.equal(va, vb)
                if torch.is_tensor(va)
                else va == vb
            )
            if not same:
                return False
    return True


def _rows(rank: int) -> torch.Tensor:
    return torch.arange(rank * PER_RANK, (rank + 1) * PER_RANK)


# ---------------------------------------------------------------------------------------------
# the 2-rank bundle
# ---------------------------------------------------------------------------------------------
def _optimizers(rank: int, world: int, out: dict[str, Any]) -> None:
    rows = _rows(rank)
    for name, make in {**OPTIMIZERS, "Lion": lambda ps: Lion(ps, lr=0.01)}.items():
        for overlap in (False, True) if name in ("SGD", "Adam") else (False,):
            (pa, sa), (pb, sb), opt = _pair(make, rows, world, overlap=overlap)
            out[f"opt/{name}/{overlap}"] = (torch.equal(pa, pb), _same_state(sa, sb))
    # with views and overlap (over every transport); a tiny cap splits parameters
    views = {"gradient_as_bucket_view": True, "overlap": True}
    for key, transport, kwargs in (
        ("views", PairwiseExchange, views),
        ("views_native", NativeTransport, views),
        ("views_all_reduce", AllReduceStandIn, views),
        ("native", NativeTransport, {}),
        ("all_reduce", AllReduceStandIn, {}),
        ("tiny_buckets", PairwiseExchange, {"bucket_cap_mb": 1e-4}),
        ("tiny_buckets_native", NativeTransport, {"bucket_cap_mb": 1e-4}),
    ):
        (pa, sa), (pb, sb), opt = _pair(OPTIMIZERS["Adam"], rows, world, transport, **kwargs)
        out[f"opt/{key}"] = (torch.equal(pa, pb), _same_state(sa, sb))
        if key == "tiny_buckets":
            out["tiny_buckets/split_params"] = any(
                piece.numel < opt.bucket_plan.params[piece.member].numel()
                for pieces in opt._apply.update.layout.pieces
                for piece in pieces
            )


def _memory_and_bytes(rank: int, world: int, out: dict[str, Any]) -> None:
    rows = _rows(rank)
    x, y = _data(world)
    stats = {}
    kinds = {True: PairwiseExchange, "native": NativeTransport, "all_reduce": AllReduceStandIn}
    for shard in (False, True, "native", "all_reduce"):
        model = _mlp().double()
        opt = CrossShardOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.05), shard_optimizer_state=bool(shard)
        )
        if shard:
            _use_transport(opt, kinds[shard])
        for k in range(2):
            opt.zero_grad()
            F.mse_loss(model(x[k, rows]), y[k, rows]).backward()
            opt.step()
        stats[shard] = opt.comm_stats.as_dict()
        if shard is True:
            bucket_bytes = max(b.padded for b in opt.bucket_plan.buckets) * 8
            out["memory"] = (opt._apply.update.state_bytes(), bucket_bytes)
            out["flat_params"] = all(
                p.data_ptr() == v.data_ptr()
                for b, flat in zip(opt.bucket_plan.buckets, opt._apply.update.flats)
                for p, v in zip((opt.bucket_plan.params[i] for i in b.members), b.views(flat))
            )
            # the gathered slot is the whole state, equal on every rank
            slot = opt.get_slot(model[0].weight, "exp_avg")
            out["slot_equal_everywhere"] = all(torch.equal(s, slot) for s in _gather(slot))
        elif shard is False:
            full = sum(
                v.numel() * v.element_size()
                for s in opt.wrapped.state.values()
                for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0
            )
            out["memory_unsharded"] = full
    out["bytes"] = tuple(stats[k]["bytes_sent"] for k in (False, True, "native", "all_reduce"))


def _presence_and_replans(rank: int, world: int, out: dict[str, Any]) -> None:
    x, y = _data(world)
    rows = _rows(rank)
    # head_b on rank 1 only, and not at step 1: segments split; unused never has state
    results = {}
    for shard in (False, True):
        model = TwoHeads()
        opt = CrossShardOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1),
            shard_optimizer_state=shard,
            gradient_as_bucket_view=True,
        )
        for k in range(STEPS):
            opt.zero_grad()
            model.loss(x[k, rows], y[k, rows], use_b=rank == 1 and k != 1).backward()
            opt.step()
        opt.consolidate_state_dict(to=None)
        results[shard] = (_flat(model), opt.state_dict())
        out[f"presence/unused_slot/{shard}"] = opt.get_slot(model.unused.weight, "exp_avg")
    out["presence"] = (
        torch.equal(results[False][0], results[True][0]),
        _same_state(results[False][1], results[True][1]),
    )
    # freeze mid-run (its state parks), unfreeze later (its state comes back), add a group
    results = {}
    for shard in (False, True):
        model = _mlp().double()
        opt = CrossShardOptimizer(
            torch.optim.Adam(model[0].parameters(), lr=0.05), shard_optimizer_state=shard
        )
        opt.add_param_group({"params": list(model[2].parameters()), "lr": 0.01})
        for k in range(STEPS + 1):
            if k == 1:
                model[0].weight.requires_grad_(False)
            if k == 2:
                model[0].weight.requires_grad_(True)
                opt.add_param_group({"params": list(model[4].parameters()), "lr": 0.02})
            opt.zero_grad()
            F.mse_loss(model(x[k, rows]), y[k, rows]).backward()
            opt.step()
        opt.consolidate_state_dict(to=None)
        results[shard] = (_flat(model), opt.state_dict(), opt.comm_stats.repeated_rounds)
    out["replan"] = (
        torch.equal(results[False][0], results[True][0]),
        _same_state(results[False][1], results[True][1]),
        results[True][2],
    )


def _checkpoints(rank: int, world: int, out: dict[str, Any]) -> None:
    x, y = _data(world)
    rows = _rows(rank)
    models, opts = [], []
    for shard in (True, False, True):
        model = _mlp().double()
        models.append(model)
        opts.append(
            CrossShardOptimizer(
                torch.optim.Adam(_groups(model), lr=0.05), shard_optimizer_state=shard
            )
        )
    _train(opts[0], models[0], x[:, rows], y[:, rows], schedule=False)
    opts[0].consolidate_state_dict(to=None)
    sd = copy.deepcopy(opts[0].state_dict())  # sharded -> unsharded format
    with torch.no_grad():
        for m in models[1:]:
            for p, q in zip(m.parameters(), models[0].parameters()):
                p.copy_(q)
    opts[1].load_state_dict(copy.deepcopy(sd))  # into an unsharded optimizer
    opts[2].load_state_dict(copy.deepcopy(opts[1].state_dict()))  # ... and back, sharded
    for opt, model in zip(opts, models):
        _train(opt, model, x[:, rows], y[:, rows], schedule=False)
    out["ckpt"] = [torch.equal(_flat(models[0]), _flat(m)) for m in models[1:]]
    out["ckpt_iterations"] = [o.iterations for o in opts]


def _local_grads(rank: int, world: int, out: dict[str, Any]) -> None:
    """.grad as bucket views keeps this replica's local gradient after every sharded step --
    also when backward allocated fresh tensors (``model.zero_grad()`` set them to None) that
    the round copied into the buckets -- so accumulating across a step boundary equals the
    unsharded run. Over the pairwise exchange and over the all-reduce stand-in (which reduces a
    copy of the buckets)."""
    x, y = _data(world)
    rows = _rows(rank)
    for transport in (PairwiseExchange, AllReduceStandIn):
        for zero in ("opt", "model"):
            flats, kept = [], True
            for shard in (False, True):
                model = _mlp().double()
                opt = CrossShardOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                    shard_optimizer_state=shard,
                    gradient_as_bucket_view=shard,
                )
                if shard:
                    _use_transport(opt, transport)
                params = list(model.parameters())
                for k in range(STEPS):
                    (opt if zero == "opt" else model).zero_grad()
                    F.mse_loss(model(x[k, rows]), y[k, rows]).backward()
                    local = [p.grad.clone() for p in params]
                    opt.step()
                    kept &= all(torch.equal(g, p.grad) for g, p in zip(local, params))
                F.mse_loss(model(x[STEPS, rows]), y[STEPS, rows]).backward()  # accumulates
                opt.step()
                flats.append(_flat(model))
                opt.remove_hooks()
            out[f"local_grads/{transport.name}/{zero}"] = (kept, torch.equal(*flats))


def _guard_and_compression(rank: int, world: int, out: dict[str, Any]) -> None:
    x, y = _data(world)
    rows = _rows(rank)
    # a skipped step() on one rank: DesyncError on every rank, nothing applied, group usable
    model = _mlp().double()
    opt = CrossShardOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.05), shard_optimizer_state=True, overlap=True
    )
    try:
        for k in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(x[k, rows]), y[k, rows]).backward()
            if not (rank == 1 and k == 1):
                opt.step()
        out["guard"] = "no error"
    except DesyncError as exc:
        out["guard"] = str(exc)
    flat = _flat(model)
    out["guard/replicas_equal"] = all(torch.equal(f, flat) for f in _gather(flat))
    opt.remove_hooks()
    # clipping on one rank after backward launched its reduce-scatters: reduced again, the
    # local gradients are intact (a reduce-scatter only reads them), same as overlap off
    out["edit"] = clipped_on_one_rank(rank, _sharded_views_adam)
    # 16-bit wire: close to the exact result
    flats = {}
    for compression in (None, "bf16"):
        model = _mlp().double()
        opt = CrossShardOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            shard_optimizer_state=True,
            compression=compression,
        )
        for k in range(STEPS):
            opt.zero_grad()
            F.mse_loss(model(x[k, rows]), y[k, rows]).backward()
            opt.step()
        flats[compression] = _flat(model)
    out["bf16"] = (flats[None] - flats["bf16"]).abs().max().item()


def _sharded_views_adam(overlap: bool) -> tuple[nn.Module, CrossShardOptimizer]:
    model = _mlp().double()
    opt = CrossShardOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.05),
        shard_optimizer_state=True,
        overlap=overlap,
        gradient_as_bucket_view=True,
        bucket_cap_mb=1e-4,
    )
    return model, opt


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _bundle(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (
        _optimizers,
        _memory_and_bytes,
        _presence_and_replans,
        _checkpoints,
        _local_grads,
    ):
        part(rank, world, out)
    _guard_and_compression(rank, world, out)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(_bundle, 2, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_elementwise_optimizer_equals_the_unsharded_run(
    two_ranks: list[dict[str, Any]],
) -> None:
    for out in two_ranks:
        for key in (k for k in out if k.startswith("opt/")):
            params_equal, state_equal = out[key]
            assert params_equal, key
            assert state_equal, key
        assert out["tiny_buckets/split_params"]  # parameters really were split between ranks
    names = {k.split("/")[1] for k in two_ranks[0] if k.startswith("opt/")}
    assert {c.__name__ for c in ELEMENTWISE_OPTIMIZERS} | {"Lion"} <= names


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_state_is_sharded_and_the_wire_carries_one_all_reduce(
    two_ranks: list[dict[str, Any]],
) -> None:
    for out in two_ranks:
        mine, bucket = out["memory"]
        assert mine <= out["memory_unsharded"] / 2 + 2 * bucket  # two moments of one bucket
        assert mine < 0.6 * out["memory_unsharded"]
        assert out["flat_params"]
        assert out["slot_equal_everywhere"]
        unsharded, pairwise, native, stand_in = out["bytes"]
        # reduce-scatter + all-gather == all-reduce of the gradients (the flags and words
        # travel in float32, in the float64 buckets without sharding), over gloo's pairwise
        # exchange as over its own collectives; the all-reduce stand-in sends 1.5x
        assert 0.8 * unsharded <= native <= unsharded
        assert pairwise == native
        assert 1.2 * unsharded <= stand_in <= 1.5 * unsharded


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_grad_as_bucket_views_keeps_the_local_gradient_under_sharding(
    two_ranks: list[dict[str, Any]],
) -> None:
    for out in two_ranks:
        keys = [k for k in out if k.startswith("local_grads/")]
        assert len(keys) == 4
        for key in keys:
            assert out[key] == (True, True), key  # (.grad local after each step, same result)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_presence_freezing_and_new_groups_follow_the_unsharded_run(
    two_ranks: list[dict[str, Any]],
) -> None:
    for out in two_ranks:
        assert out["presence"] == (True, True)
        assert out["presence/unused_slot/True"] is None  # never had a gradient: no state
        params_equal, state_equal, repeated = out["replan"]
        assert params_equal and state_equal
        assert repeated == 2  # the freeze, then unfreeze + add: each adopted in a repeat round


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoints_load_across_sharded_and_unsharded(two_ranks: list[dict[str, Any]]) -> None:
    for out in two_ranks:
        assert out["ckpt"] == [True, True]
        assert out["ckpt_iterations"] == [2 * (STEPS + 2)] * 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sequence_guard_and_edits_after_launch_with_sharding(
    two_ranks: list[dict[str, Any]],
) -> None:
    for out in two_ranks:
        assert "ranks are out of step" in out["guard"], out["guard"]
        assert out["guard/replicas_equal"]
        equal, repeated_off, repeated_on = out["edit"]
        assert equal and repeated_off == 0 and repeated_on >= 1
        assert 0 < out["bf16"] < 2e-2


# ---------------------------------------------------------------------------------------------
# one shard: the flat update without communication
# ---------------------------------------------------------------------------------------------
def _one_shard(opt: torch.optim.Optimizer, **kwargs: Any) -> CrossShardOptimizer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "behaving as one shard"
        return CrossShardOptimizer(opt, shard_optimizer_state=True, **kwargs)


@pytest.mark.parametrize("name", ["SGD", "Adam", "Adagrad", "Lion"])
def test_one_shard_equals_the_plain_optimizer(name: str) -> None:
    make = OPTIMIZERS.get(name, lambda ps: Lion(ps, lr=0.01))
    x, y = _data(1)
    plain_model, model = _mlp().double(), _mlp().double()
    plain = make(_groups(plain_model))
    opt = _one_shard(make(_groups(model)))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)
    plain_sched = torch.optim.lr_scheduler.ExponentialLR(plain, gamma=0.7)
    for k in range(STEPS):
        for o, m, s in ((plain, plain_model, plain_sched), (opt, model, sched)):
            o.zero_grad()
            F.mse_loss(m[:3](x[k])[:, :3], y[k]).backward()  # the last layer gets no gradient
            o.step()
            s.step()
    assert torch.equal(_flat(plain_model), _flat(model))
    assert opt.wrapped.state == {}  # the state lives in the shard only
    sd = opt.state_dict()
    assert _same_state(
        sd | {"param_groups": plain.state_dict()["param_groups"]}, plain.state_dict()
    )
    assert opt.get_slot(model[4].weight, "exp_avg") is None  # never updated


def test_segments_are_cut_at_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sharding, "SEGMENT_ELEMENTS", 7)
    x, y = _data(1)
    plain_model, model = _mlp().double(), _mlp().double()
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.05)
    opt = _one_shard(torch.optim.Adam(model.parameters(), lr=0.05))
    for k in range(STEPS):
        for o, m in ((plain, plain_model), (opt, model)):
            o.zero_grad()
            F.mse_loss(m(x[k]), y[k]).backward()
            o.step()
    assert torch.equal(_flat(plain_model), _flat(model))
    segments = opt._apply.update.segments
    assert max(seg.param.numel() for seg in segments) == 7
    assert sum(seg.param.numel() for seg in segments) == sum(p.numel() for p in model.parameters())
    assert _same_state(opt.state_dict() | {"param_groups": plain.state_dict()["param_groups"]},
                       plain.state_dict())  # fmt: skip


def test_segments_merge_per_group_and_split_where_presence_differs() -> None:
    model = _mlp().double()
    opt = _one_shard(torch.optim.Adam(_groups(model), lr=0.05))
    x, y = _data(1)
    F.mse_loss(model(x[0]), y[0]).backward()
    opt.step()
    # one bucket, two groups: [layer 4, layer 2 | layer 0] in ready order -> two segments
    assert len(opt._apply.update.segments) == 2
    opt.zero_grad()
    F.mse_loss(model[:3](x[1])[:, :3], y[1]).backward()  # layer 4 gets no gradient
    opt.step()
    assert len(opt._apply.update.segments) == 3


def test_parameters_move_into_flat_buffers_and_a_replaced_one_is_taken_back() -> None:
    model = _mlp().double()
    opt = _one_shard(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _data(1)
    F.mse_loss(model(x[0]), y[0]).backward()
    opt.step()
    (flat,) = opt._apply.update.flats
    weight = model[0].weight
    assert flat.data_ptr() <= weight.data_ptr() < flat.data_ptr() + flat.numel() * 8
    weight.data = weight.data.clone() + 1.0  # the user replaces the storage
    expected = torch.add(weight.detach(), weight.grad, alpha=-0.1)
    opt.step()
    assert torch.equal(weight.detach(), expected)
    assert flat.data_ptr() <= weight.data_ptr() < flat.data_ptr() + flat.numel() * 8


def test_non_elementwise_optimizers_are_refused_before_anything_changes() -> None:
    model = _mlp()
    for opt, match in (
        (torch.optim.LBFGS(model.parameters()), "LBFGS is not known to be one"),
        (GlobalNormSGD(model.parameters(), lr=0.1), "GlobalNormSGD is not known"),
        (torch.optim.Adafactor(model.parameters()), "Adafactor"),
    ):
        with pytest.raises(TypeError, match=match):
            _one_shard(opt)
    ptrs = [p.data_ptr() for p in model.parameters()]
    _one_shard(Lion(model.parameters()))  # marked element-wise: accepted
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # nothing moves before a step
    with pytest.raises(TypeError, match="shard_optimizer_state must be True or False"):
        CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer_state=1)
