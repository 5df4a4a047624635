"""Keras' momentum kept in torch's buffer units (distoptim.dtensor.momentum), and the one-pass
update it buys: exact across any learning-rate sequence (float64 replays against Keras' rule),
bit for bit torch's fused Nesterov SGD at a constant rate, ``.grad`` only read, and a state
dict that shows Keras' ``v`` and restores bit for bit."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from distoptim.dtensor import (
    SGD,
    EMAOption,
    ExponentialDecay,
    GradientsClipOption,
    PiecewiseConstantDecay,
)
from distoptim.dtensor.kernels import sgd_update
from distoptim.dtensor.momentum import keras_step, next_scale, velocity

# jumps up and down, two zeros in a row, a tiny rate, a zero first
_LRS = [0.0, 0.1, 0.1, 0.0, 0.0, 0.5, 1e-4, 0.3, 0.3, 0.3, 0.02, 0.0, 0.2, 0.2]


def _keras(w, v, grads, lrs, mu, nesterov):
    """Keras' SGD in float64 numpy (v = momentum slot)."""
    for g, lr in zip(grads, lrs):
        v = mu * v - lr * g
        w = w + (mu * v - lr * g if nesterov else v)
    return w, v


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mu", [0.9, 0.5, 1.0])
@pytest.mark.parametrize("start", ["fresh", "loaded"])
def test_units_are_exact_for_any_learning_rate_sequence(nesterov, mu, start):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, generator=gen, dtype=torch.float64)
    grads = [torch.randn(50, generator=gen, dtype=torch.float64) for _ in _LRS]
    v0 = torch.randn(50, generator=gen, dtype=torch.float64) if start == "loaded" else None
    # a fresh buffer is zeros with scale 0; a loaded one is -v with scale -1
    buf, scale = (torch.zeros(50, dtype=torch.float64), 0.0) if v0 is None else (-v0, -1.0)
    want_w, want_v = w.numpy().copy(), np.zeros(50) if v0 is None else v0.numpy().copy()
    for g, lr in zip(grads, _LRS):
        new = next_scale(scale, lr)
        sgd_update([w], [g], [buf], keras_step(lr, mu, nesterov, scale, new), impl="fused")
        scale = new
        want_w, want_v = _keras(want_w, want_v, [g.numpy()], [lr], mu, nesterov)
        np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(velocity(buf, scale).numpy(), want_v, rtol=1e-11, atol=1e-11)
    assert -0.2 < scale < 0  # moving towards torch's units (-lr) at the last rate


def test_scale_follows_the_rate_and_lands_on_the_fixed_point():
    assert next_scale(0.0, 0.1) == -0.1  # a fresh buffer starts at torch's units
    assert next_scale(-0.1, 0.1) == -0.1
    assert next_scale(-0.1, 0.0) == -0.1  # lr 0 keeps the units
    assert next_scale(-0.4, 0.1) == pytest.approx(-0.2)  # geometric mean
    s = -1.0
    for _ in range(80):
        s = next_scale(s, 0.037)
    assert s == -0.037
    kp = keras_step(0.037, 0.9, True, s, next_scale(s, 0.037))
    assert (kp.momentum, kp.dampening, kp.lr, kp.nesterov) == (0.9, 0.0, 0.037, True)


@pytest.mark.parametrize("nesterov", [True, False])
def test_constant_rate_is_torch_fused_sgd_bit_for_bit(nesterov):
    """At a constant lr our buffer *is* torch's momentum buffer: same kernel, same numbers."""
    torch.manual_seed(0)
    w0 = [torch.randn(300, 7), torch.randn(5)]
    ours = [w.clone().requires_grad_() for w in w0]
    theirs = [w.clone().requires_grad_() for w in w0]
    opt = SGD(ours, lr=0.05, momentum=0.9, nesterov=nesterov)
    ref = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, nesterov=nesterov, fused=True)
    for _ in range(4):
        grads = [torch.randn(w.shape) for w in w0]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        buf = ref.state[q]["momentum_buffer"]
        assert torch.equal(opt.get_slot(p, "m"), buf * -0.05)
        assert torch.equal(opt.get_slot(p, "momentum"), opt.get_slot(p, "m"))  # Keras 3's name


def _grads_after_step(opt, params, grads):
    for p, g in zip(params, grads):
        p.grad = g
    kept = [g.clone() for g in grads]
    opt.step()
    return all(torch.equal(p.grad, k) and p.grad is g for p, g, k in zip(params, grads, kept))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"nesterov": True},
        {"nesterov": False},
        {"nesterov": True, "gradients_clip_option": GradientsClipOption(clipnorm=0.5)},
        {"nesterov": True, "learning_rate": ExponentialDecay(0.1, 1, 0.5)},
    ],
)
def test_gradients_are_bit_identical_after_a_step(kwargs):
    kwargs = {"learning_rate": 0.1, **kwargs}
    gen = torch.Generator().manual_seed(3)
    params = [
        torch.randn(64, 3, generator=gen).requires_grad_(),
        torch.randn(3, 4, generator=gen).t().requires_grad_(),  # strided: the foreach path
        torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_(),
        torch.randn(6, generator=gen, dtype=torch.bfloat16).requires_grad_(),
    ]
    opt = SGD(params, momentum=0.9, **kwargs)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in params]
        grads[1] = grads[1].t().contiguous().t()  # strided like its parameter
        assert _grads_after_step(opt, params, grads)
    # apply_gradients with gradients of other dtypes: converted copies, the given ones untouched
    pairs = [(torch.randn(p.shape, generator=gen, dtype=torch.float64), p) for p in params]
    kept = [g.clone() for g, _ in pairs]
    opt.apply_gradients(pairs)
    assert all(torch.equal(g, k) for (g, _), k in zip(pairs, kept))


def _trained(schedule, steps, nesterov=True):
    torch.manual_seed(3)
    m = torch.nn.Linear(4, 3)
    opt = SGD(
        m.parameters(),
        learning_rate=schedule,
        momentum=0.9,
        nesterov=nesterov,
        ema_option=EMAOption(True, 0.9, 5),
    )
    x = torch.randn(8, 4)
    for _ in range(steps):
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    return m, opt, x


def test_state_dict_shows_keras_v_and_restores_bit_for_bit_across_a_schedule():
    """With EMA and an overwrite at step 5, through a rate of 0."""
    sched = PiecewiseConstantDecay([2, 4], [0.1, 0.03, 0.0])  # units away from torch's
    m1, o1, x = _trained(sched, 3)
    vs = [o1.get_slot(p, "m") for p in m1.parameters()]
    sd = copy.deepcopy(o1.state_dict())
    for p, v, entry in zip(m1.parameters(), vs, sd["state"].values()):
        assert set(entry) == {"m", "average"}  # Keras' slots, nothing internal
        torch.testing.assert_close(entry["m"], v, rtol=1e-7, atol=0)  # one rounding at most
        assert torch.equal(o1.get_slot(p, "m"), entry["m"])
    m2, o2, _ = _trained(ExponentialDecay(1.0, 1, 0.5), 1)  # other weights, other units
    m2.load_state_dict(m1.state_dict())
    o2.load_state_dict(sd)
    o2.learning_rate = sched
    for _ in range(3):  # lr 0.03, 0.03, 0: the two runs stay identical to the last bit
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        for a, b in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(a, b)
    assert o2.iterations == o1.iterations == 6


def test_a_keras_v_state_dict_loads_into_torch_units():
    """A dict holding only Keras' v (as earlier versions saved it) continues Keras' rule."""
    p = torch.zeros(3, requires_grad=True)
    opt = SGD([p], lr=0.1, momentum=0.5, nesterov=True)
    sd = opt.state_dict()
    sd["state"] = {0: {"m": torch.tensor([1.0, -2.0, 0.5])}}
    opt.load_state_dict(sd)
    assert torch.equal(opt.get_slot(p, "m"), torch.tensor([1.0, -2.0, 0.5]))
    p.grad = torch.tensor([1.0, 1.0, 1.0])
    opt.step()
    v = 0.5 * torch.tensor([1.0, -2.0, 0.5]) - 0.1
    torch.testing.assert_close(opt.get_slot(p, "m"), v)
    torch.testing.assert_close(p.detach(), 0.5 * v - 0.1)
