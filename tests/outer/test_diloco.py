"""DiLoCo / LocalSGD on one process: the schedule, the outer step, mixing, checkpoints, bad input.

Outside a process group the optimizer is one replica, so every schedule, delay and mixing rule
is checked here against :mod:`tests.outer.reference` cheaply; the multi-rank tests
(``test_distributed.py``) check the averaging over replicas and the wire formats.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import distoptim
from distoptim import DiLoCo, LocalSGD
from tests.outer import reference as ref
from tests.outer.reference import Config

ATOL = 1e-10

CONFIGS = {
    "diloco_sgd": Config(),
    "diloco_adamw": Config(inner="adamw"),
    "outer_adam": Config(outer="adam", sync_every=2, steps=8),
    "localsgd": Config(outer=None, sync_every=2, steps=6),
    "fragments2": Config(sync_every=4, fragments=2, steps=12),
    "streaming": Config(sync_every=4, fragments=2, delay=1, alpha=0.5, steps=13),
    "delay_alpha0": Config(sync_every=4, fragments=2, delay=1, steps=11),
    "fragments4_delay2": Config(inner="adamw", sync_every=12, fragments=4, delay=2, steps=26),
    "int8_one_replica": Config(sync_every=2, steps=6, wire="int8"),  # nothing is quantized
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_replica_matches_reference(name):
    cfg = CONFIGS[name]
    model, opt = ref.run(cfg, 0, 1)
    local, global_ = ref.simulate(cfg, 1)
    torch.testing.assert_close(ref.flat(model.parameters()), local[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(ref.flat(opt.global_parameters), global_, rtol=0, atol=ATOL)
    assert opt.iterations == cfg.steps
    assert opt.comm_stats.bytes_sent == 0  # a group of one sends nothing


def test_the_outer_step_is_not_a_no_op():
    # guards the references: DiLoCo with Nesterov differs from LocalSGD and from no sync
    cfg = Config(sync_every=2, steps=6)
    diloco = ref.simulate(cfg, 1)[0][0]
    plain = ref.simulate(Config(outer=None, sync_every=2, steps=6), 1)[0][0]
    assert (diloco - plain).abs().max() > 1e-3


def test_sync_steps_and_counters():
    cfg = Config(sync_every=4, fragments=2, delay=1, steps=9)
    model, opt = ref.run(cfg, 0, 1, stop=4)
    assert opt.syncs == 1  # fragment 0 launched at 2, applied at 3; fragment 1 launched at 4
    assert opt.state_dict()["wrapper"]["pending"]["fragment"] == 1
    ref.run(cfg, 0, 1, start=4, stop=9, model=model, opt=opt)
    assert opt.syncs == 4  # applied at 3, 5, 7, 9
    assert [f.offset for f in opt.schedule.fragments] == [2, 4]


def test_user_gradients_survive_a_sync():
    model = ref.mlp()
    opt = DiLoCo(
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
        sync_every=1,
    )
    ref.loss_of(model, torch.randn(4, 5).double(), torch.randn(4, 3).double()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    opt.step()  # syncs: the pseudo-gradient is swapped into .grad only for the outer step
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)


def test_tf_path_equals_torch_path():
    cfg = Config(sync_every=4, fragments=2, delay=1, alpha=0.5, steps=7)
    model, _ = ref.run(cfg, 0, 1)
    x, y = ref.data(1)
    model2 = ref.mlp()
    opt2 = ref.build(cfg, model2)
    for t in range(cfg.steps):
        opt2.minimize(lambda t=t: ref.loss_of(model2, x[0, t], y[0, t]))
    assert torch.equal(ref.flat(model.parameters()), ref.flat(model2.parameters()))
    assert opt2.iterations == cfg.steps


def test_outer_scheduler_and_param_groups_of_its_own():
    model = ref.mlp()
    ps = list(model.parameters())
    outer = torch.optim.SGD([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.1}], lr=0.7)
    opt = DiLoCo(torch.optim.SGD(ps[::-1], lr=0.1), outer, sync_every=1)  # any order, any groups
    sched = torch.optim.lr_scheduler.StepLR(outer, step_size=1, gamma=0.5)
    x, y = ref.data(1)
    for t in range(3):
        opt.zero_grad()
        ref.loss_of(model, x[0, t], y[0, t]).backward()
        opt.step()
        sched.step()
    assert outer.param_groups[0]["lr"] == pytest.approx(0.7 / 8)


@pytest.mark.parametrize("name", ["streaming", "diloco_adamw", "localsgd"])
def test_state_dict_round_trip_mid_flight(name):
    cfg = CONFIGS[name]
    split = 6  # streaming: fragment 0 launched at 6 is still in flight after step 6
    model, opt = ref.run(cfg, 0, 1, stop=split)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    ref.run(cfg, 0, 1, start=split, model=model, opt=opt)

    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    model2 = ref.mlp(seed=5)  # different weights: everything must come from the checkpoint
    opt2 = ref.build(cfg, model2)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    assert opt2.iterations == split
    ref.run(cfg, 0, 1, start=split, model=model2, opt=opt2)
    assert torch.equal(ref.flat(model.parameters()), ref.flat(model2.parameters()))
    assert torch.equal(ref.flat(opt.global_parameters), ref.flat(opt2.global_parameters))


def _snapshot(opt):
    return copy.deepcopy(opt.state_dict())


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _corrupt(sd, path, value):
    node = sd
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


BAD_STATES = {
    "no wrapper": (("wrapper",), {}),
    "other config": (("wrapper", "config", "sync_every"), 8),
    "global shape": (("wrapper", "global", 0), torch.zeros(2, 2, dtype=torch.float64)),
    "global dtype": (("wrapper", "global", 1), torch.zeros(6, dtype=torch.float32)),
    "pending at the wrong step": (("wrapper", "pending", "fragment"), -1),
    "pending payload": (("wrapper", "pending", "payload", 0, 0), torch.zeros(3)),
    "syncs": (("wrapper", "syncs"), -1),
    "outer groups": (("wrapper", "outer", "param_groups"), []),
    "iterations": (("iterations",), -2),
}


@pytest.mark.parametrize("case", sorted(BAD_STATES))
def test_bad_state_dict_changes_nothing(case):
    cfg = CONFIGS["streaming"]
    _model, opt = ref.run(cfg, 0, 1, stop=6)  # fragment 0 in flight
    good = opt.state_dict()
    bad = copy.deepcopy(good)
    path, value = BAD_STATES[case]
    _corrupt(bad, path, value)
    _model2, opt2 = ref.run(cfg, 0, 1, stop=3)
    before = _snapshot(opt2)
    with pytest.raises((ValueError, TypeError)):
        opt2.load_state_dict(bad)
    assert _same(before, opt2.state_dict())


def test_pending_must_match_the_step():
    cfg = CONFIGS["streaming"]
    _, opt = ref.run(cfg, 0, 1, stop=6)
    sd = opt.state_dict()
    sd["iterations"] = 7  # at step 7 nothing is in flight
    _, opt2 = ref.run(cfg, 0, 1, stop=2)
    with pytest.raises(ValueError, match="nothing in flight"):
        opt2.load_state_dict(sd)


def test_state_dict_structure_does_not_depend_on_the_step():
    cfg = CONFIGS["streaming"]
    fresh = ref.build(cfg, ref.mlp()).state_dict()["wrapper"]
    _, opt = ref.run(cfg, 0, 1, stop=6)
    busy = opt.state_dict()["wrapper"]

    def shape(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype)
        if isinstance(x, dict):
            return {k: shape(v) for k, v in x.items()}
        if isinstance(x, list):
            return [shape(v) for v in x]
        return type(x).__name__

    fresh.pop("outer"), busy.pop("outer")  # torch's own lazily created state
    assert shape(fresh) == shape(busy)
    assert busy["pending"]["fragment"] == 0 and fresh["pending"]["fragment"] == -1


def _over_cross_shard(model):
    """DiLoCo over CrossShardOptimizer over the mesh SGD with a decaying rate (one process: the
    CrossShardOptimizer is one shard); the SGD and the CrossShardOptimizer each step once alone
    before they are wrapped, so the three step counts differ."""
    from distoptim.dtensor import SGD as MeshSGD
    from distoptim.dtensor import ExponentialDecay

    x, y = ref.data(1)
    sgd = MeshSGD(model.parameters(), learning_rate=ExponentialDecay(0.1, 2, 0.5), momentum=0.9)
    with pytest.warns(UserWarning, match="torch.distributed is not initialized"):
        inner = distoptim.CrossShardOptimizer(sgd)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for opt in (sgd, inner):
        opt.zero_grad()
        ref.loss_of(model, x[0, 0], y[0, 0]).backward()
        opt.step()
    return DiLoCo(inner, outer, sync_every=4)


def _counts(opt):
    return (opt.iterations, opt.wrapped.iterations, opt.wrapped.wrapped.iterations)


def test_state_dict_keeps_the_step_count_of_a_mesh_sgd_two_wrappers_deep():
    """The mesh SGD's own count (its schedule reads it) comes back through DiLoCo over a
    CrossShardOptimizer, and the resumed run continues bit for bit."""
    x, y = ref.data(1)
    split = 6  # between the syncs at 4 and 8

    def train(model, opt, first, last):
        for t in range(first, last):
            opt.zero_grad()
            ref.loss_of(model, x[0, t], y[0, t]).backward()
            opt.step()

    model = ref.mlp()
    opt = _over_cross_shard(model)
    train(model, opt, 1, split + 1)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, split + 1, 11)
    model2 = ref.mlp(seed=5)
    opt2 = _over_cross_shard(model2)
    model2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    assert _counts(opt2) == (split, split + 1, split + 2)
    train(model2, opt2, split + 1, 11)
    assert _counts(opt2) == _counts(opt)
    assert torch.equal(ref.flat(model.parameters()), ref.flat(model2.parameters()))


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------
def _pair(model=None, inner_lr=0.1, outer_lr=0.7):
    model = model or ref.mlp()
    return (
        torch.optim.SGD(model.parameters(), lr=inner_lr),
        torch.optim.SGD(model.parameters(), lr=outer_lr, momentum=0.9, nesterov=True),
    )


BAD_ARGS = {
    "sync_every 0": ({"sync_every": 0}, "sync_every"),
    "sync_every float": ({"sync_every": 2.0}, "sync_every"),
    "fragments not dividing H": ({"sync_every": 6, "fragments": 4}, "divisible"),
    "fragments > params": ({"sync_every": 10, "fragments": 5}, "more than the 4 parameters"),
    "fragments 0": ({"fragments": 0}, "fragments"),
    "delay = H/F": ({"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, "< sync_every"),
    "delay negative": ({"fragment_sync_delay": -1}, "fragment_sync_delay"),
    "alpha > 1": ({"fragment_update_alpha": 1.5}, r"\[0, 1\]"),
    "alpha nan": ({"fragment_update_alpha": math.nan}, r"\[0, 1\]"),
    "alpha bool": ({"fragment_update_alpha": True}, r"\[0, 1\]"),
    "unknown wire": ({"wire": "fp8"}, "unknown wire"),
    "bucket cap": ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_arguments(case):
    kwargs, match = BAD_ARGS[case]
    kwargs = {"sync_every": 4, **kwargs}
    inner, outer = _pair()
    with pytest.raises(ValueError, match=match):
        DiLoCo(inner, outer, **kwargs)


def test_bad_types():
    inner, outer = _pair()
    with pytest.raises(TypeError, match="outer"):
        DiLoCo(inner, object(), sync_every=2)
    with pytest.raises(TypeError, match="inner"):
        DiLoCo([1], outer, sync_every=2)
    with pytest.raises(TypeError, match="wire"):
        DiLoCo(inner, outer, sync_every=2, wire=8)
    with pytest.raises(TypeError, match="error_feedback"):
        DiLoCo(inner, outer, sync_every=2, error_feedback=1)
    with pytest.raises(TypeError, match="name"):
        DiLoCo(inner, outer, sync_every=2, name=3)
    with pytest.raises(TypeError, match="LocalSGD"):
        LocalSGD(object(), sync_every=2)
    with pytest.raises(ValueError, match="separate optimizer"):
        DiLoCo(inner, inner, sync_every=2)


def test_outer_over_other_parameters():
    model, other = ref.mlp(), ref.mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="exactly the inner optimizer's parameters"):
        DiLoCo(inner, torch.optim.SGD(other.parameters(), lr=0.7), sync_every=2)
    with pytest.raises(ValueError, match="lacks 2"):  # a subset is not enough
        DiLoCo(inner, torch.optim.SGD(list(model.parameters())[:2], lr=0.7), sync_every=2)


@pytest.mark.parametrize("which", ["inner", "outer"])
def test_non_finite_hyperparameters(which):
    inner, outer = _pair(
        inner_lr=math.nan if which == "inner" else 0.1,
        outer_lr=math.inf if which == "outer" else 0.7,
    )
    with pytest.raises(ValueError, match="finite"):
        DiLoCo(inner, outer, sync_every=2)


def test_group_needs_a_process_group():
    inner, outer = _pair()
    with pytest.raises(ValueError, match="initialized"):
        DiLoCo(inner, outer, sync_every=2, group=[[0], [1]])


def test_join_needs_a_manager():
    inner, outer = _pair()
    opt = DiLoCo(inner, outer, sync_every=2)
    with pytest.raises(ValueError, match=r"join\(\) needs a torchft manager"):
        opt.join()  # without one, a sync at another step than the group's desynchronises it


def test_parameters_are_fixed():
    model = ref.mlp()
    inner, outer = _pair(model)
    opt = DiLoCo(inner, outer, sync_every=2)
    with pytest.raises(ValueError, match="fixes its parameters"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})


def test_public_names():
    assert distoptim.DiLoCo is DiLoCo and distoptim.LocalSGD is LocalSGD
    assert "DiLoCo" in dir(distoptim) and "outer" in dir(distoptim)
    opt = LocalSGD(torch.optim.SGD(ref.mlp().parameters(), lr=0.1), sync_every=3)
    assert opt.get_name() == "LocalSGD" and opt.num_replicas == 1
    assert "sync_every=3" in repr(opt)
