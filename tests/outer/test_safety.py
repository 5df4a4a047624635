"""DiLoCo / LocalSGD at the edges: a clean end, or the same error on every replica, quickly.

* ``finish()`` applies the sync in flight and syncs every fragment whose local values are not
  its global copy, so every replica ends holding the global model (against
  :func:`tests.outer.reference.simulate` with ``finish=True``); at a sync step it changes
  nothing.
* A replica that calls ``finish()`` while another reaches a sync, or finishes at another step:
  ``DesyncError`` on both within ``FAST_S``. A replica whose loop returns before a sync, without
  ``finish()``: ``DesyncError`` on the peer within ``FAST_S`` saying a replica stopped taking
  part (not gloo's "Connection closed by peer", not the process group's timeout).
* A non-finite pseudo-gradient on one replica (fp32, bf16, int8; with a sync in flight too):
  ``NonFiniteSyncError`` on every replica naming it, no outer step, the global copy kept, the
  fragment's local values reset to it; training goes on and a checkpoint taken then resumes.
* Outer optimizers that differ (lr 0.7 vs 0.5; LocalSGD vs DiLoCo) and an inner LR scheduler
  stepped on rank 0 only: ``ParameterMismatchError`` at the first sync after the divergence,
  naming the difference.
* A replica's checkpoint loaded on another replica: ``ValueError`` naming both; ``state_dict()``
  between syncs warns, once, how to get the global model.

One 2-rank spawn runs every multi-rank case; each leaves the ranks paired (a small all-reduce
after it proves it), and the case that ends the group runs last. Cheaper single-replica checks
run in this process.
"""

from __future__ import annotations

import copy
import io
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import distoptim
from distoptim import DiLoCo, LocalSGD
from distoptim.comm.guard import DesyncError, ParameterMismatchError
from distoptim.launch import spawn
from distoptim.outer import NonFiniteSyncError
from tests.outer import reference as ref
from tests.outer.reference import Config

ATOL = 1e-10
FAST_S = 5.0  # "quickly": the process group's timeout in this spawn is 120 s

FINISH = {
    "diloco_mid_round": Config(sync_every=3, steps=7),
    "diloco_at_a_sync": Config(sync_every=3, steps=6),
    "adamw_outer_adam": Config(inner="adamw", outer="adam", sync_every=4, steps=10),
    "streaming_in_flight": Config(sync_every=4, fragments=2, delay=1, alpha=0.5, steps=12),
    "streaming_int8": Config(sync_every=4, fragments=2, delay=1, alpha=0.5, steps=12, wire="int8"),
    "fragments4_delay2": Config(inner="adamw", sync_every=12, fragments=4, delay=2, steps=15),
    "localsgd": Config(outer=None, sync_every=2, steps=5),
}
NON_FINITE = {
    "fp32": Config(sync_every=3, steps=6),
    "bf16": Config(sync_every=3, steps=6, wire="bf16"),
    "int8": Config(sync_every=3, steps=6, wire="int8"),
    "int8_in_flight": Config(sync_every=4, fragments=2, delay=1, steps=8, wire="int8"),
}


def _timed(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn()`` raised (type, message, seconds until then), or its value."""
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as exc:  # the case records whatever was raised
        return {
            "error": type(exc).__name__,
            "message": str(exc),
            "seconds": time.perf_counter() - t0,
        }
    return {"error": None, "value": value, "seconds": time.perf_counter() - t0}


def _still_paired(index: int) -> bool:
    """Both ranks reach the same next collective: the group survived the case."""
    t = torch.tensor([index, -index], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist() == [index, -index]


def _finished(cfg: Config, rank: int, world: int) -> dict[str, torch.Tensor]:
    model, opt = ref.run(cfg, rank, world)
    opt.finish()
    return {"local": ref.flat(model.parameters()), "global": ref.flat(opt.global_parameters)}


def _finish_while_peer_steps(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's loop ends after step 5 (finish()); rank 1 takes step 6, a sync."""
    cfg = Config(sync_every=3, steps=6)
    model, opt = ref.run(cfg, rank, world, stop=5)
    if rank == 0:
        return _timed(opt.finish)
    return _timed(lambda: ref.run(cfg, rank, world, start=5, model=model, opt=opt))


def _finish_at_other_steps(rank: int, world: int) -> dict[str, Any]:
    """Both call finish(), rank 0 after 4 steps, rank 1 after 5 (no sync in between)."""
    cfg = Config(sync_every=3, steps=6)
    _, opt = ref.run(cfg, rank, world, stop=4 + rank)
    return _timed(opt.finish)


def _non_finite(cfg: Config, rank: int, world: int) -> dict[str, Any]:
    """Rank 1's parameters of fragment 0 become Inf right after the inner step of fragment 0's
    first sync step (so its Δ is Inf, its inner state finite); then training goes on."""
    first = cfg.sync_every // cfg.fragments  # fragment 0's first sync
    model, opt = ref.run(cfg, rank, world, stop=first - 1)
    before = ref.flat(opt.global_parameters).clone()

    def poison(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            next(iter(model.parameters()))[0, 0] = math.inf

    hook = opt.wrapped.register_step_post_hook(poison) if rank == 1 else None
    out = _timed(
        lambda: ref.run(cfg, rank, world, start=first - 1, stop=first, model=model, opt=opt)
    )
    if hook is not None:
        hook.remove()
    out["iterations"] = opt.iterations
    out["global_kept"] = torch.equal(ref.flat(opt.global_parameters), before)
    fragment0 = opt.schedule.fragments[0]
    local = list(model.parameters())[fragment0.start : fragment0.stop]
    out["local_reset"] = all(
        torch.equal(p, g) for p, g in zip(local, opt.global_parameters[fragment0.start :])
    )
    out["refused_syncs"] = opt.refused_syncs
    # a checkpoint taken now resumes (with a sync in flight refused, nothing is in flight)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # between syncs: said once, checked elsewhere
        sd = copy.deepcopy(opt.state_dict())
    model2 = ref.mlp(seed=3)
    model2.load_state_dict(model.state_dict())
    opt2 = ref.build(cfg, model2)
    opt2.load_state_dict(sd)
    ref.run(cfg, rank, world, start=first, model=model2, opt=opt2)
    out["after"] = ref.flat(opt2.global_parameters)
    out["after_local"] = ref.flat(model2.parameters())
    out["syncs_after"] = opt2.syncs
    return out


def _outers_differ(rank: int, world: int, how: str) -> dict[str, Any]:
    model = ref.mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "lr":
        lr = 0.7 if rank == 0 else 0.5
        outer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
        opt: DiLoCo = DiLoCo(inner, outer, sync_every=3)
    elif rank == 0:  # how == "algorithm"
        opt = LocalSGD(inner, sync_every=3)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        opt = DiLoCo(inner, outer, sync_every=3)
    out = _timed(lambda: ref.run(Config(sync_every=3, steps=3), rank, world, model=model, opt=opt))
    out["syncs"] = opt.syncs
    return out


def _scheduler_on_rank0(rank: int, world: int) -> dict[str, Any]:
    """``if rank == 0: sched.step()``: the inner learning rates drift apart."""
    model = ref.mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = DiLoCo(inner, outer, sync_every=3)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    x, y = ref.data(world)

    def train() -> None:
        for t in range(6):
            opt.zero_grad()
            ref.loss_of(model, x[rank, t], y[rank, t]).backward()
            opt.step()
            if rank == 0:
                sched.step()

    out = _timed(train)
    out["iterations"] = opt.iterations
    return out


def _checkpoints(rank: int, world: int) -> dict[str, Any]:
    """Replica 0's checkpoint loaded on both replicas; the warning between syncs."""
    cfg = Config(sync_every=3, steps=4)
    model, opt = ref.run(cfg, rank, world)
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd = opt.state_dict()
        opt.state_dict()  # once per optimizer
        out["between"] = [str(w.message) for w in caught]
        caught.clear()
        opt.finish()
        opt.state_dict()
        out["after_finish"] = [str(w.message) for w in caught]
    out["finished_equal"] = torch.equal(
        ref.flat(model.parameters()), ref.flat(opt.global_parameters)
    )
    saved: list[Any] = [None, None]
    dist.all_gather_object(saved, sd)
    _, fresh = ref.run(cfg, rank, world, stop=0)
    out["load_rank0"] = _timed(lambda: fresh.load_state_dict(saved[0]))
    return out


def _safety(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    index = 0

    def case(name: str, fn: Callable[[], Any]) -> None:
        nonlocal index
        index += 1
        out[name] = fn()
        out[name, "paired"] = _still_paired(index)

    for name, cfg in FINISH.items():
        case(("finish", name), lambda cfg=cfg: _finished(cfg, rank, world))
    case("finish_while_peer_steps", lambda: _finish_while_peer_steps(rank, world))
    case("finish_at_other_steps", lambda: _finish_at_other_steps(rank, world))
    for name, cfg in NON_FINITE.items():
        case(("non_finite", name), lambda cfg=cfg: _non_finite(cfg, rank, world))
    case("outer_lr", lambda: _outers_differ(rank, world, "lr"))
    case("outer_algorithm", lambda: _outers_differ(rank, world, "algorithm"))
    case("scheduler_on_rank0", lambda: _scheduler_on_rank0(rank, world))
    case("checkpoints", lambda: _checkpoints(rank, world))
    # last: rank 1's loop returns before the sync of step 6, without finish()
    cfg = Config(sync_every=3, steps=6)
    model, opt = ref.run(cfg, rank, world, stop=5)
    if rank == 0:
        out["peer_left"] = _timed(lambda: ref.run(cfg, rank, world, start=5, model=model, opt=opt))
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(_safety, 2, timeout=120)


def _both(two_ranks: list[dict[str, Any]], key: Any) -> list[dict[str, Any]]:
    assert all(r[key, "paired"] for r in two_ranks), key  # the group is still usable
    return [r[key] for r in two_ranks]


@pytest.mark.parametrize("name", sorted(FINISH))
def test_finish_leaves_every_replica_holding_the_global_model(two_ranks, name):
    cfg = FINISH[name]
    a, b = _both(two_ranks, ("finish", name))
    for got in (a, b):
        assert torch.equal(got["local"], got["global"])  # the model is the global model
    assert torch.equal(a["global"], b["global"])  # the same on every replica, bit for bit
    local, global_ = ref.simulate(cfg, 2, finish=True)
    torch.testing.assert_close(a["global"], global_, rtol=0, atol=ATOL)
    torch.testing.assert_close(local[1], global_, rtol=0, atol=ATOL)
    if name == "diloco_at_a_sync":  # nothing left to sync: finish() changed nothing
        assert torch.equal(global_, ref.simulate(cfg, 2)[1])
    else:
        assert not torch.allclose(global_, ref.simulate(cfg, 2)[1])


@pytest.mark.parametrize("case", ["finish_while_peer_steps", "finish_at_other_steps"])
def test_a_replica_that_finishes_out_of_step_fails_every_replica_fast(two_ranks, case):
    outs = _both(two_ranks, case)
    assert [o["error"] for o in outs] == ["DesyncError", "DesyncError"], outs
    assert all(o["seconds"] < FAST_S for o in outs), [o["seconds"] for o in outs]
    assert outs[0]["message"] == outs[1]["message"]
    text = outs[0]["message"]
    assert "rank 0: finish()" in text, text
    if case == "finish_while_peer_steps":
        assert "rank 0 called finish() while rank 1 reached a sync in step()" in text, text
        assert "rank 1: step(): the sync of fragment 0 after step 6" in text, text
    else:
        assert "step counters differ" in text, text


def test_a_replica_whose_loop_ends_before_a_sync_fails_its_peer_fast(two_ranks):
    left = two_ranks[0]["peer_left"]
    assert left["error"] == "DesyncError", left
    assert left["seconds"] < FAST_S, left["seconds"]
    text = left["message"]
    assert "rank 0: the sync header of step 6 failed" in text, text
    assert "stopped taking part" in text and "finish()" in text, text


@pytest.mark.parametrize("name", sorted(NON_FINITE))
def test_a_non_finite_pseudo_gradient_is_refused_on_every_replica(two_ranks, name):
    cfg = NON_FINITE[name]
    outs = _both(two_ranks, ("non_finite", name))
    first = cfg.sync_every // cfg.fragments
    for o in outs:
        assert o["error"] == "NonFiniteSyncError", o
        assert f"fragment 0 after step {first}" in o["message"] and "rank 1" in o["message"]
        assert "rank 0" not in o["message"], o["message"]
        assert o["iterations"] == first  # the inner step counted; the replicas stay in step
        assert o["global_kept"] and o["local_reset"] and o["refused_syncs"] == 1
        assert torch.isfinite(o["after"]).all() and o["syncs_after"] >= 1
    assert outs[0]["message"] == outs[1]["message"]
    assert torch.equal(outs[0]["after"], outs[1]["after"])


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("outer_lr", "outer optimizer: group 0: lr: rank 0 0.7, rank 1 0.5"),
        ("outer_algorithm", 'algorithm: rank 0 "LocalSGD", rank 1 "DiLoCo"'),
        ("scheduler_on_rank0", "inner optimizer: group 0: lr: rank 0 0.025, rank 1 0.1"),
    ],
)
def test_optimizers_that_differ_are_refused_at_the_first_sync(two_ranks, case, says):
    outs = _both(two_ranks, case)
    for o in outs:
        assert o["error"] == "ParameterMismatchError", o
        assert says in o["message"], o["message"]
        assert "nothing was applied" in o["message"]
    # the same verdict on both (each names its own optimizer first: LocalSGD, DiLoCo)
    assert outs[0]["message"].split(":", 1)[1] == outs[1]["message"].split(":", 1)[1]
    if case == "scheduler_on_rank0":
        assert [o["iterations"] for o in outs] == [2, 2]  # the sync of step 3 raised
    else:
        assert [o["syncs"] for o in outs] == [0, 0]


def test_a_replicas_checkpoint_refuses_to_load_on_another(two_ranks):
    outs = _both(two_ranks, "checkpoints")
    assert outs[0]["load_rank0"]["error"] is None
    refused = outs[1]["load_rank0"]
    assert refused["error"] == "ValueError", refused
    text = refused["message"]
    assert "replica 0's" in text and "this is replica 1" in text, text
    assert "global" in text and "finish()" in text, text


def test_state_dict_between_syncs_warns_once_how_to_get_the_global_model(two_ranks):
    for o in _both(two_ranks, "checkpoints"):
        assert len(o["between"]) == 1, o["between"]
        assert "between syncs" in o["between"][0] and "finish()" in o["between"][0]
        assert "global_parameters" in o["between"][0]
        assert o["after_finish"] == [] and o["finished_equal"]


# ---------------------------------------------------------------------------------------------
# one replica (no process group): the same rules, no communication
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(FINISH))
def test_finish_on_one_replica_is_the_final_sync(name):
    cfg = FINISH[name]
    model, opt = ref.run(cfg, 0, 1)
    opt.finish()
    local, global_ = ref.simulate(cfg, 1, finish=True)
    torch.testing.assert_close(ref.flat(opt.global_parameters), global_, rtol=0, atol=ATOL)
    torch.testing.assert_close(ref.flat(model.parameters()), local[0], rtol=0, atol=ATOL)
    assert torch.equal(ref.flat(model.parameters()), ref.flat(opt.global_parameters))
    syncs = opt.syncs
    opt.finish()  # a second finish() at the same step has nothing left to sync
    assert opt.syncs == syncs


def test_training_goes_on_after_finish_and_its_checkpoint_resumes():
    cfg = FINISH["streaming_in_flight"]  # fragment 1 in flight at step 12: finish applies it
    model, opt = ref.run(cfg, 0, 1)
    opt.finish()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    longer = Config(**{**vars(cfg), "steps": 20})
    ref.run(longer, 0, 1, start=12, model=model, opt=opt)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model2 = ref.mlp(seed=4)
    model2.load_state_dict(saved["model"])
    opt2 = ref.build(cfg, model2)
    opt2.load_state_dict(saved["opt"])  # nothing in flight after finish(): accepted
    ref.run(longer, 0, 1, start=12, model=model2, opt=opt2)
    assert torch.equal(ref.flat(model.parameters()), ref.flat(model2.parameters()))
    assert torch.equal(ref.flat(opt.global_parameters), ref.flat(opt2.global_parameters))


def test_a_non_finite_pseudo_gradient_is_refused_on_one_replica():
    model = ref.mlp()
    opt = DiLoCo(
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
        sync_every=1,
    )
    before = [g.clone() for g in opt.global_parameters]
    with torch.no_grad():
        next(iter(model.parameters()))[0, 0] = math.nan
    with pytest.raises(NonFiniteSyncError, match="rank 0"):
        opt.step()
    assert opt.iterations == 1 and opt.syncs == 0 and opt.refused_syncs == 1
    assert all(torch.equal(g, b) for g, b in zip(opt.global_parameters, before))
    assert all(torch.equal(p, g) for p, g in zip(model.parameters(), opt.global_parameters))
    assert issubclass(NonFiniteSyncError, FloatingPointError)


def test_a_checkpoint_of_before_this_version_still_loads():
    cfg = Config(sync_every=4, fragments=2, delay=1, steps=6)
    _, opt = ref.run(cfg, 0, 1)
    sd = opt.state_dict()
    for key in ("rank", "synced_at", "closed_at"):
        del sd["wrapper"][key]
    _, opt2 = ref.run(cfg, 0, 1, stop=0)
    opt2.load_state_dict(sd)
    assert opt2.iterations == 6


def test_global_parameters_is_a_list_and_a_call():
    _, opt = ref.run(Config(), 0, 1)
    assert isinstance(opt.global_parameters, list)
    assert opt.global_parameters() == opt.global_parameters  # AsyncDiLoCo's spelling works too
    assert all(a is b for a, b in zip(opt.global_parameters(), opt.global_parameters))


def test_public_names():
    assert distoptim.outer.NonFiniteSyncError is NonFiniteSyncError
    assert issubclass(ParameterMismatchError, DesyncError)
