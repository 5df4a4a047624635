"""The step plan that SGD keeps between steps of plain tensors (``plan.StepPlan``).

Every scenario runs twice from the same start: once as a user would (the plan kept and reused)
and once with the plan dropped before every step (built afresh, as on the first step). Whatever
happens between steps -- gradients that appear and disappear, group hyperparameters, strides,
``p.data``, new groups, state saved, loaded or reset -- both runs must agree bit for bit, and
the kept plan must actually have been reused (else the comparison proves nothing).
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from distoptim.dtensor import SGD, EMAOption, ExponentialDecay, GradientsClipOption
from distoptim.dtensor import plan as plan_module

STEPS = 7


def _params(dtypes=(torch.float32, torch.float32, torch.float64, torch.float32)):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(4, 4, generator=gen, dtype=dt).requires_grad_() for dt in dtypes]


def _grads(t: int, params: list[torch.Tensor], skip=()) -> None:
    """Deterministic gradients for step ``t`` (None for the indices in ``skip``)."""
    gen = torch.Generator().manual_seed(100 + t)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device)
        p.grad = None if i in skip else g


Event = Callable[[int, SGD, list[torch.Tensor]], None]


def _run(make: Callable[[], tuple[SGD, list[torch.Tensor]]], event: Event, keep_plan: bool):
    opt, params = make()
    trajectory = []
    for t in range(STEPS):
        event(t, opt, params)
        if not keep_plan:
            opt._plan = None
        opt.step()
        trajectory.append([p.detach().clone() for p in opt._all_params()])
    slots = [opt.get_slot(p, n) for p in opt._all_params() for n in ("m", "average")]
    return trajectory, slots, opt.state_dict(), opt


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return (
            isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and x.stride() == y.stride()
            and torch.equal(x, y)
        )
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    return x == y


def _check_twins(make, event, monkeypatch) -> None:
    builds = []
    real_build = plan_module.StepPlan.build.__func__

    def counting_build(cls, params, *args):
        builds.append(len(params))
        return real_build(cls, params, *args)

    monkeypatch.setattr(plan_module.StepPlan, "build", classmethod(counting_build))
    kept = _run(make, event, keep_plan=True)
    kept_builds = len(builds)
    fresh = _run(make, event, keep_plan=False)
    for t, (a, b) in enumerate(zip(kept[0], fresh[0])):
        assert _same(a, b), f"weights differ after step {t}"
    assert _same(kept[1], fresh[1]), "slots differ"
    assert _same(kept[2], fresh[2]), "state dicts differ"
    assert kept_builds < STEPS, "the kept plan was never reused: the test proves nothing"


def _sgd(skip_last=False, **kw):
    """SGD over :func:`_params` (with ``skip_last``, a fifth param the optimizer owns and
    the scenario leaves without a gradient)."""

    def make():
        params = _params()
        owned = [*params, torch.zeros(4, 4, requires_grad=True)] if skip_last else params
        return SGD(owned, **{"lr": 0.1, "momentum": 0.9, "nesterov": True, **kw}), owned

    return make


# ---- the scenarios ------------------------------------------------------------------------------
def _late_and_missing_grads(t, opt, ps):
    # param 3 first steps at t=2 (its buffer starts at scale 0: its own bucket, merged after);
    # param 1 misses t=4, param 0 misses t=5 and t=6.
    skip = {0: {3}, 1: {3}, 4: {1}, 5: {0}, 6: {0}}.get(t, set())
    _grads(t, ps, skip)


def _group_hyperparameters_change(t, opt, ps):
    _grads(t, ps)
    group = opt.param_groups[0]
    group["momentum"] = {2: 0.5, 3: 0.0, 4: 0.0, 5: 0.9}.get(t, group["momentum"])
    group["nesterov"] = t % 2 == 0
    group["lr"] = {3: 0.05, 6: 0.0}.get(t, group["lr"])


def _gradient_strides_change(t, opt, ps):
    _grads(t, ps)
    if t in (2, 3, 5):  # same values, transposed memory: the fused kernel must not see them
        ps[0].grad = ps[0].grad.t().contiguous().t()
        ps[2].grad = ps[2].grad.t().contiguous().t()


def _weights_replaced(t, opt, ps):
    _grads(t, ps)
    if t == 2:
        ps[0].data = ps[0].data.t()  # a transposed view: strided weight
    if t == 4:
        ps[0].data = ps[0].data.clone()  # contiguous again, new storage
        ps[1].data = ps[1].data.t().contiguous().t()


def _group_added(t, opt, ps):
    if t == 2:
        extra = torch.full((3,), 2.0, requires_grad=True)
        opt.add_param_group({"params": [extra], "momentum": 0.5, "lr": 0.3})
    _grads(t, opt._all_params(), skip={1} if t == 5 else ())


_SAVED: dict[int, dict] = {}


def _state_saved_and_loaded(t, opt, ps):
    _grads(t, ps)
    if t == 1:
        _SAVED[id(opt)] = copy.deepcopy(opt.state_dict())  # (rewrites the scales too)
    if t == 4:
        opt.load_state_dict(_SAVED.pop(id(opt)))


def _update_step_called(t, opt, ps):
    _grads(t, ps)
    if t == 3:  # at a new rate, the variable's momentum scale moves off its bucket's
        opt.param_groups[0]["lr"] = 0.05
        opt.update_step(torch.ones(4, 4), ps[1])


def _state_reset_by_hand(t, opt, ps):
    _grads(t, ps, skip={4})
    if t == 2:
        opt.state[ps[1]] = {}  # one parameter's state replaced
    if t == 4:
        opt.state = defaultdict(dict)  # everything reset, torch style
    if t == 5:
        opt.state.clear()
    if t == 6:  # param 3's state handed to param 4, which has no gradient (same size, order)
        opt.state[ps[4]] = opt.state.pop(ps[3])


def _weight_dtype_changes(t, opt, ps):
    if t == 2:  # Module.double() does this: the same Parameter, new data
        ps[0].data = ps[0].data.double()
        ps[0].grad_dtype = None
    _grads(t, ps)
    if t == 4:
        ps[1].grad.data = ps[1].grad.data.double()  # a float64 gradient for a float32 weight


def _grad_kinds_change(t, opt, ps):
    _grads(t, ps)
    if t == 2:
        ps[0].grad = torch.nn.Parameter(ps[0].grad, requires_grad=False)  # not a plain Tensor
    if t == 3:
        ps[2].grad_dtype = None  # (torch refuses a gradient of another dtype without this)
        ps[2].grad = ps[2].grad.float()  # float32 gradient for a float64 weight


def _learning_rate_set(t, opt, ps):
    _grads(t, ps)
    if t == 2:
        opt.learning_rate = 0.02
    if t == 4:
        opt.learning_rate = ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)


SCENARIOS = {
    "late and missing grads": (_sgd(), _late_and_missing_grads),
    "late and missing grads, schedule": (
        _sgd(learning_rate=ExponentialDecay(0.1, decay_steps=1, decay_rate=0.7), lr=None),
        _late_and_missing_grads,
    ),
    "group momentum, nesterov, lr change": (_sgd(), _group_hyperparameters_change),
    "gradient strides change": (_sgd(), _gradient_strides_change),
    "p.data replaced": (_sgd(), _weights_replaced),
    "add_param_group": (_sgd(), _group_added),
    "state_dict and load_state_dict": (_sgd(), _state_saved_and_loaded),
    "update_step between steps": (_sgd(), _update_step_called),
    "state reset by hand": (_sgd(skip_last=True), _state_reset_by_hand),
    "weight dtype changes (no momentum)": (
        _sgd(momentum=0.0, nesterov=False),
        _weight_dtype_changes,
    ),
    "gradient kinds and dtypes change": (_sgd(), _grad_kinds_change),
    "learning_rate set": (_sgd(), _learning_rate_set),
    "EMA, clipping, missing grads": (
        _sgd(
            ema_option=EMAOption(True, ema_momentum=0.9, ema_overwrite_frequency=3),
            gradients_clip_option=GradientsClipOption(global_clipnorm=1.0),
        ),
        _late_and_missing_grads,
    ),
    "plain momentum, clipvalue, strides": (
        _sgd(nesterov=False, gradients_clip_option=GradientsClipOption(clipvalue=0.5)),
        _gradient_strides_change,
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_kept_plan_steps_like_a_fresh_one(name, monkeypatch):
    make, event = SCENARIOS[name]
    _check_twins(make, event, monkeypatch)


def test_groups_with_and_without_momentum_and_mixed_dtypes(monkeypatch):
    def make():
        gen = torch.Generator().manual_seed(3)
        a = [
            torch.randn(5, generator=gen, dtype=dt).requires_grad_()
            for dt in (torch.float32, torch.bfloat16, torch.float64)
        ]
        b = [torch.randn(2, 3, generator=gen).requires_grad_() for _ in range(2)]
        groups = [{"params": a}, {"params": b, "momentum": 0.0, "lr": 0.2}]
        return SGD(groups, lr=0.1, momentum=0.9), a + b

    def event(t, opt, ps):
        _grads(t, ps, skip={4} if t == 3 else ())
        if t == 4:
            opt.param_groups[1]["momentum"] = 0.8  # buffers created mid-run

    _check_twins(make, event, monkeypatch)


def test_a_param_moved_to_another_group(monkeypatch):
    def make():
        params = _params()
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.3, "momentum": 0.5}]
        return SGD(groups, lr=0.1, momentum=0.9, nesterov=True), params

    def event(t, opt, ps):
        _grads(t, ps)
        if t == 3:  # the same params in the same order, but ps[1] now steps with group 1
            opt.param_groups[0]["params"] = ps[:1]
            opt.param_groups[1]["params"] = ps[1:]

    _check_twins(make, event, monkeypatch)


def test_buckets_merge_when_their_momentum_scales_meet():
    params = _params((torch.float32,) * 3)
    opt = SGD(params, lr=0.1, momentum=0.9)
    _grads(0, params, skip={2})
    opt.step()
    _grads(1, params)
    opt.step()  # params[2]'s first step: a bucket of its own (scale 0), then at -lr like the rest
    assert opt._plan is None  # dropped: a fresh plan merges the two buckets
    _grads(2, params)
    opt.step()
    assert [b.idx for b in opt._plan.buckets] == [[0, 1, 2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_a_weight_moved_to_another_device(monkeypatch):
    def event(t, opt, ps):
        if t == 3:  # Module.cuda() does this: the same Parameter, its data on the GPU
            for p in ps[:2]:
                p.grad = None
                p.data = p.data.cuda()
        _grads(t, ps)

    _check_twins(_sgd(momentum=0.0, nesterov=False), event, monkeypatch)


# ---- what the kept plan must still refuse, and what it must not keep ---------------------------
def _snapshot(opt, params):
    states = [
        {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for p in params
    ]
    return [p.detach().clone() for p in params], states, opt.iterations


def _sparse_grad(p):
    p.grad = torch.ones(p.shape, dtype=p.dtype).to_sparse()


def _weight_reshaped(p):  # (torch checks a gradient's shape when it is set, not after)
    p.data = torch.zeros(5, 4, dtype=p.dtype)


def _grad_reshaped(p):
    p.grad.data = torch.ones(5, 4, dtype=p.dtype)


def _weight_reshaped_strided_grad(p):
    p.grad = p.grad.t().contiguous().t()
    p.data = torch.zeros(5, 4, dtype=p.dtype)


@pytest.mark.parametrize(
    "spoil, err",
    [
        (_sparse_grad, TypeError),
        (_weight_reshaped, ValueError),
        (_grad_reshaped, ValueError),
        (_weight_reshaped_strided_grad, ValueError),
    ],
)
def test_a_bad_gradient_after_kept_steps_changes_nothing(spoil, err):
    params = _params()
    opt = SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    for t in range(3):
        _grads(t, params)
        opt.step()
    plan = opt._plan
    assert plan is not None
    _grads(3, params)
    spoil(params[2])
    before = _snapshot(opt, params)
    with pytest.raises(err, match="gradient 2"):
        opt.step()
    assert _same(before, _snapshot(opt, params))
    assert opt._plan is plan  # nothing was rebuilt either


def test_the_plan_is_kept_and_holds_no_gradient():
    params = _params()
    opt = SGD(params, lr=0.1, momentum=0.9)
    _grads(0, params)
    opt.step()
    plan = opt._plan
    _grads(1, params)
    watched = weakref.ref(params[0].grad)
    opt.step()
    assert opt._plan is plan  # reused
    for p in params:
        p.grad = None
    gc.collect()
    assert watched() is None  # the plan did not keep the gradient's memory alive
    opt.step()  # no gradients: nothing to plan
    assert opt._plan is plan and opt.iterations == 3
