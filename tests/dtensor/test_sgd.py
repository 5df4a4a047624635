"""distoptim.dtensor.SGD on plain tensors (one process): the seed page's examples, the update
rule against a hand reference, EMA, schedules, Keras-style variables, state, jit and errors.
The DTensor / multi-rank behaviour is in test_mesh.py."""

from __future__ import annotations

import copy
import inspect
import json
import pydoc
import re
import warnings

import numpy as np
import pytest
import torch

import distoptim
from distoptim.dtensor import SGD, EMAOption, ExponentialDecay, GradientsClipOption


# ---- the seed page ---------------------------------------------------------------------------
def test_seed_example_plain_sgd():
    opt = SGD(learning_rate=0.1)
    var = torch.tensor(1.0, requires_grad=True)
    step_count = opt.minimize(lambda: (var**2) / 2.0, [var])
    assert step_count == 1
    assert var.item() == pytest.approx(0.9)
    assert opt.get_slot(var, "m") is None and opt.get_slot_names() == []


def test_seed_example_momentum():
    opt = distoptim.SGD(learning_rate=0.1, momentum=0.9)
    var = torch.tensor(1.0, requires_grad=True)
    val0 = var.item()
    opt.minimize(lambda: (var**2) / 2.0, [var])
    val1 = var.item()
    assert val0 - val1 == pytest.approx(0.1)
    assert opt.minimize(lambda: (var**2) / 2.0, [var]) == 2
    assert val1 - var.item() == pytest.approx(0.18)
    assert opt.get_slot_names() == ["m"]
    assert opt.get_slot(var, "m").item() == pytest.approx(-0.18)


# ---- the rule against a hand reference --------------------------------------------------------
def _reference(w0, grads, lrs, momentum, nesterov):
    """Keras' SGD written out in float64 numpy, one step per gradient."""
    w = np.array(w0, dtype=np.float64)
    v = np.zeros_like(w)
    for g, lr in zip(grads, lrs):
        if momentum == 0:
            w = w - lr * g
            continue
        v = momentum * v - lr * g
        w = w + (momentum * v - lr * g if nesterov else v)
    return w, v


@pytest.mark.parametrize(
    "momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True), (0.5, True)]
)
def test_update_matches_hand_reference_with_a_schedule(momentum, nesterov):
    gen = torch.Generator().manual_seed(1)
    w0 = [torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen)]
    params = [w.clone().requires_grad_() for w in w0]
    grads = [[torch.randn(w.shape, generator=gen, dtype=w.dtype) for w in w0] for _ in range(5)]
    sched = ExponentialDecay(0.2, decay_steps=2, decay_rate=0.5)
    opt = SGD(params, learning_rate=sched, momentum=momentum, nesterov=nesterov)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g
        kept = [g.clone() for g in gs]
        opt.step()
        assert all(torch.equal(a, b) for a, b in zip(gs, kept))  # gradients are read only
    assert opt.iterations == 5
    for i, p in enumerate(params):
        w, v = _reference(
            w0[i].numpy(),
            [gs[i].numpy() for gs in grads],
            [sched(t) for t in range(5)],
            momentum,
            nesterov,
        )
        tol = 1e-12 if p.dtype == torch.float64 else 1e-5
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=tol, atol=tol)
        if momentum:
            np.testing.assert_allclose(opt.get_slot(p, "m").numpy(), v, rtol=tol, atol=tol)
    assert opt.param_groups[0]["lr"] == pytest.approx(sched(4))


def test_non_contiguous_parameters_and_gradients_are_updated_right():
    """The fused kernel needs contiguous tensors; others must take the stride-aware path."""
    gen = torch.Generator().manual_seed(6)
    p = torch.randn(3, 4, generator=gen, dtype=torch.float64).t().requires_grad_()
    q = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)  # same bucket
    assert p.is_leaf and not p.is_contiguous()
    w0 = [p.detach().numpy().copy(), q.detach().numpy().copy()]
    opt = SGD([p, q], lr=0.1, momentum=0.9, nesterov=True)
    grads = []
    for _ in range(3):
        g = [
            torch.randn(4, 3, generator=gen, dtype=torch.float64),
            torch.randn(3, 4, generator=gen, dtype=torch.float64).t(),
        ]
        grads.append(g)
        opt.apply_gradients([(g[0], p), (g[1], q)])  # contiguous grad for p, transposed for q
    for i, t in enumerate((p, q)):
        w, v = _reference(w0[i], [g[i].numpy() for g in grads], [0.1] * 3, 0.9, True)
        np.testing.assert_allclose(t.detach().numpy(), w, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(opt.get_slot(t, "m").numpy(), v, rtol=1e-12, atol=1e-12)


def test_torch_lr_scheduler_drives_param_groups():
    p = torch.ones(3, requires_grad=True)
    opt = SGD([p], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert torch.allclose(p.detach(), torch.full((3,), 1 - 1 - 0.5 - 0.25))


def test_learning_rate_can_be_set_keras_style():
    p = torch.ones(2, requires_grad=True)
    opt = SGD([p], learning_rate=0.1)
    assert opt.learning_rate == 0.1
    opt.learning_rate = 0.5
    p.grad = torch.ones(2)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((2,), 0.5))
    assert opt.get_config()["learning_rate"] == 0.5
    opt.learning_rate = ExponentialDecay(1.0, 1, 0.5)  # at iterations=1: 0.5
    opt.step()
    assert torch.allclose(p.detach(), torch.zeros(2))
    with pytest.raises(ValueError):
        opt.learning_rate = -1.0
    assert isinstance(opt.learning_rate, ExponentialDecay)


def test_param_groups_have_their_own_hyperparameters():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    opt = SGD([{"params": [a]}, {"params": [b], "lr": 0.5, "momentum": 0.9}], lr=0.1)
    for _ in range(2):
        a.grad, b.grad = torch.ones(2), torch.ones(2)
        opt.step()
    assert torch.allclose(a.detach(), torch.full((2,), 0.8))
    assert torch.allclose(b.detach(), torch.full((2,), 1 - 0.5 - (0.45 + 0.5)))
    assert opt.get_slot(a, "m") is None and opt.get_slot(b, "m") is not None


def test_clipping_is_applied_before_the_update_and_grads_untouched():
    p = torch.zeros(2, requires_grad=True)
    opt = SGD([p], lr=1.0, gradients_clip_option=GradientsClipOption(clipnorm=1.0))
    g = torch.tensor([3.0, 4.0])
    p.grad = g
    opt.step()
    assert torch.allclose(p.detach(), torch.tensor([-0.6, -0.8]))
    assert torch.equal(p.grad, torch.tensor([3.0, 4.0]))  # .grad is not modified


# ---- EMA -------------------------------------------------------------------------------------
def test_ema_overwrite_and_finalize_match_reference():
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(6, generator=gen, dtype=torch.float64)
    p = w0.clone().requires_grad_()
    q = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # never gets a gradient
    mu, k = 0.8, 3
    opt = SGD([p, q], lr=0.1, momentum=0.5, ema_option=EMAOption(True, mu, k))
    assert opt.get_slot_names() == ["average", "m"]
    w, v, avg = w0.numpy().copy(), np.zeros(6), w0.numpy().copy()
    for t in range(1, 8):
        g = torch.randn(6, generator=gen, dtype=torch.float64)
        p.grad = g
        opt.step()
        v = 0.5 * v - 0.1 * g.numpy()
        w = w + v
        avg = mu * avg + (1 - mu) * w
        if t % k == 0:
            w = avg.copy()
        np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(opt.get_slot(p, "average").numpy(), avg, rtol=1e-12)
    assert torch.equal(q.detach(), torch.zeros(2, dtype=torch.float64))
    opt.finalize_variable_values([p])
    np.testing.assert_allclose(p.detach().numpy(), avg, rtol=1e-12)


def test_finalize_without_ema_changes_nothing():
    p = torch.ones(2, requires_grad=True)
    opt = SGD([p], lr=0.1)
    opt.finalize_variable_values([p])
    assert torch.equal(p.detach(), torch.ones(2))
    with pytest.raises(ValueError):
        opt.finalize_variable_values([torch.ones(2)])


# ---- Keras-style variables -------------------------------------------------------------------
def test_keras_style_build_apply_gradients_and_variables():
    opt = SGD(learning_rate=0.1, momentum=0.9, ema_option=EMAOption(use_ema=True))
    assert opt._all_params() == [] and opt.variables() == []
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(2, 2, requires_grad=True)
    opt.build([a])
    opt.build([a])  # idempotent
    assert len(opt._all_params()) == 1 and opt.get_slot(a, "m") is not None
    assert opt.apply_gradients([(torch.ones(3), a), (torch.ones(2, 2), b)]) == 1  # b adopted
    assert len(opt._all_params()) == 2
    assert torch.allclose(b.detach(), torch.full((2, 2), 0.9))
    assert len(opt.variables()) == 4
    extra = opt.add_variable((2,), initializer="ones")
    assert torch.equal(extra, torch.ones(2)) and opt.variables()[-1] is extra
    init = torch.arange(3.0)
    s = opt.add_variable_from_reference(a, "velocity2", initial_value=init)
    assert torch.equal(s, init) and opt.get_slot(a, "velocity2") is s and s is not init
    with pytest.raises(ValueError, match="already exists"):
        opt.add_variable_from_reference(a, "m")
    assert opt.add_variable_from_reference(b, "z").shape == b.shape


def test_update_step_is_public_and_overridable():
    calls = []

    class SignSGD(SGD):
        def update_step(self, gradient, variable):
            calls.append(tuple(variable.shape))
            variable.sub_(0.5 * torch.sign(gradient))

    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = SignSGD([a, b], lr=0.1)
    a.grad, b.grad = torch.tensor([2.0, -3.0]), torch.ones(3)
    opt.step()
    assert calls == [(2,), (3,)] and opt.iterations == 1
    assert torch.equal(a.detach(), torch.tensor([-0.5, 0.5]))
    # the base class' update_step applies the rule to one variable, without counting a step
    p = torch.ones(2, requires_grad=True)
    base = SGD([p], lr=0.25, momentum=0.5)
    base.update_step(torch.ones(2), p)
    assert torch.equal(p.detach(), torch.full((2,), 0.75)) and base.iterations == 0


# ---- the signature, as help() and IDEs show it ------------------------------------------------
def test_signature_shows_real_defaults():
    """help(SGD) shows ``learning_rate=0.01`` (not a sentinel ``<object object at 0x...>``),
    while ``lr=`` still stands in only when ``learning_rate`` is not given."""
    sig = inspect.signature(SGD)
    text = str(sig)
    assert " at 0x" not in text, text
    assert re.search(r"learning_rate: '[^']*' = 0\.01, ", text), text
    assert "lr: 'float | Callable[[int], float] | None' = None" in text, text
    assert "= 0.01" in pydoc.render_doc(SGD, renderer=pydoc.plaintext)
    p = torch.ones(1, requires_grad=True)
    default = SGD([p])
    assert type(default.learning_rate) is float and default.learning_rate == 0.01
    assert type(default.param_groups[0]["lr"]) is float
    assert json.loads(json.dumps(default.get_config()))["learning_rate"] == 0.01
    assert SGD([p], lr=0.2).learning_rate == 0.2
    with pytest.raises(ValueError, match="not both"):  # an explicit 0.01 is a given rate
        SGD([p], learning_rate=0.01, lr=0.2)


# ---- jit ---------------------------------------------------------------------------------------
def _run_steps(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def test_jit_compile_matches_eager():
    """The one compiled test (torch.compile on CPU costs seconds): two small tensors."""
    gen = torch.Generator().manual_seed(4)
    w0 = [torch.randn(8, generator=gen), torch.randn(3, 2, generator=gen)]
    grads = [[torch.randn(w.shape, generator=gen) for w in w0] for _ in range(3)]
    pj = [w.clone().requires_grad_() for w in w0]
    pe = [w.clone().requires_grad_() for w in w0]
    oj = SGD(
        pj,
        learning_rate=ExponentialDecay(0.1, 1, 0.5),
        momentum=0.9,
        nesterov=True,
        jit_compile=True,
    )
    oe = SGD(pe, learning_rate=ExponentialDecay(0.1, 1, 0.5), momentum=0.9, nesterov=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn
        _run_steps(oj, pj, grads)
    _run_steps(oe, pe, grads)
    assert not oj._jit_failed
    for a, b in zip(pj, pe):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_jit_falls_back_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        def fn(*a, **k):
            raise RuntimeError("no compiler here")

        return fn

    monkeypatch.setattr(torch, "compile", broken)
    p = torch.ones(2, requires_grad=True)
    opt = SGD([p], lr=0.5, jit_compile=True)
    p.grad = torch.ones(2)
    with pytest.warns(RuntimeWarning, match="falls back"):
        opt.step()
    assert torch.equal(p.detach(), torch.full((2,), 0.5)) and opt._jit_failed


# ---- bad input: clear error, nothing mutated ---------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"momentum": 1.5}, ValueError, "momentum"),
        ({"momentum": -0.1}, ValueError, "momentum"),
        ({"learning_rate": -0.1}, ValueError, "learning_rate"),
        ({"learning_rate": float("nan")}, ValueError, "learning_rate"),
        ({"learning_rate": 0.1, "lr": 0.2}, ValueError, "not both"),
        ({"learning_rate": lambda t: -1.0}, ValueError, "schedule"),
        ({"amsgrad": True}, ValueError, "amsgrad"),
        ({"nesterov": 1}, TypeError, "nesterov"),
        ({"gradients_clip_option": {"clipvalue": 0}}, ValueError, "clipvalue"),
        ({"gradients_clip_option": {"clipnorm": 1, "global_clipnorm": 1}}, ValueError, "both"),
        ({"ema_option": {"use_ema": True, "ema_momentum": 2.0}}, ValueError, "ema_momentum"),
        ({"ema_option": {"use_ema": True, "ema_overwrite_frequency": 0}}, ValueError, ">= 1"),
        ({"mesh": "cpu"}, TypeError, "DeviceMesh"),
    ],
)
def test_constructor_rejects(kwargs, err, match):
    with pytest.raises(err, match=match):
        SGD([torch.ones(1, requires_grad=True)], **kwargs)


def _snapshot(opt, params):
    def copy(v):
        return v.clone() if isinstance(v, torch.Tensor) else v

    return (
        [p.detach().clone() for p in params],
        [{k: copy(v) for k, v in opt.state[p].items()} for p in params],
        opt.iterations,
        len(opt._all_params()),
        [(g["lr"], g["momentum"], g["nesterov"]) for g in opt.param_groups],
    )


def _same(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
    for sa, sb in zip(a[1], b[1]):
        assert sa.keys() == sb.keys()
        for k in sa:
            x, y = sa[k], sb[k]
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert a[2:] == b[2:]


def test_bad_calls_change_nothing():
    a, b = torch.ones(3, requires_grad=True), torch.ones(2, requires_grad=True)
    opt = SGD([a, b], lr=0.1, momentum=0.9, ema_option=EMAOption(True))
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    good = copy.deepcopy(opt.state_dict())  # (writes the momentum in Keras' units)
    bad_group = {**good["param_groups"][0], "momentum": 2.0}
    before = _snapshot(opt, [a, b])
    newcomer = torch.zeros(4, requires_grad=True)
    bad_calls = [
        (ValueError, lambda: opt.apply_gradients([(torch.ones(4), a)])),  # shape mismatch
        (ValueError, lambda: opt.apply_gradients([(torch.ones(3), a), (torch.ones(5), newcomer)])),
        (TypeError, lambda: opt.apply_gradients([(torch.ones(3), a), (1.0, b)])),
        (TypeError, lambda: opt.build([torch.ones(2, dtype=torch.int64)])),
        (ValueError, lambda: opt.add_param_group({"params": [newcomer], "momentum": 3.0})),
        (ValueError, lambda: opt.add_param_group({"params": [newcomer], "weight_decay": 0.1})),
        (ValueError, lambda: opt.load_state_dict({**good, "iterations": -1})),
        (ValueError, lambda: opt.load_state_dict({**good, "state": {0: {"m": torch.ones(2)}}})),
        (ValueError, lambda: opt.load_state_dict({**good, "state": {7: {}}})),
        (TypeError, lambda: opt.load_state_dict({**good, "state": {0: {"m": 1.0}}})),
        (ValueError, lambda: opt.load_state_dict({**good, "state": {0: {"momentum_scale": 1.0}}})),
        (ValueError, lambda: opt.load_state_dict({**good, "param_groups": [bad_group]})),
        (ValueError, lambda: opt.load_state_dict({**good, "param_groups": []})),
    ]
    for err, call in bad_calls:
        with pytest.raises(err):
            call()
        _same(before, _snapshot(opt, [a, b]))
    # an lr made invalid behind the optimizer's back is caught before the update
    opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1
    _same(before, _snapshot(opt, [a, b]))
    assert id(newcomer) not in {id(p) for p in opt._all_params()}
