"""distoptim.dtensor.kernels: the four implementations of torch's SGD rule agree with a float64
numpy reference, the dispatcher's choices, and the pinned behaviour of ``torch._fused_sgd_``
(the one private torch API, behind ``fused_sgd_step``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distoptim.dtensor.kernels import KernelParams, fused_sgd_step, fused_supported, sgd_update

_PARAMS = [
    KernelParams(momentum=0.0, dampening=0.0, lr=0.3, nesterov=False),  # no buffer
    KernelParams(momentum=0.9, dampening=0.0, lr=0.1, nesterov=False),
    KernelParams(momentum=0.9, dampening=0.0, lr=0.1, nesterov=True),
    KernelParams(momentum=2.5, dampening=0.6, lr=0.02, nesterov=True),  # a rescaling step
    KernelParams(momentum=0.8, dampening=1.0, lr=-0.4, nesterov=False),  # Keras at lr = 0
]


def _rule(w, g, b, p: KernelParams):
    """torch's SGD rule in float64 numpy (the kernels module docstring)."""
    if b is None:
        return w - p.lr * g, None
    b = p.momentum * b + (1 - p.dampening) * g
    return w - p.lr * (g + p.momentum * b if p.nesterov else b), b


def _tensors(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(9,), (2, 3), (33,), ()]
    ws = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    gs = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    bs = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    return ws, gs, bs


@pytest.mark.parametrize("impl", ["single", "foreach", "fused", "auto"])
@pytest.mark.parametrize("p", _PARAMS)
def test_implementations_follow_the_rule_and_only_read_gradients(impl, p):
    ws, gs, bs = _tensors(torch.float64)
    bufs = None if p.momentum == 0 else bs
    want = [_rule(w.numpy(), g.numpy(), None if bufs is None else b.numpy(), p)
            for w, g, b in zip(ws, gs, bs)]  # fmt: skip
    g_before = [g.clone() for g in gs]
    sgd_update(ws, gs, bufs, p, impl=impl)
    for i, (w, b) in enumerate(want):
        np.testing.assert_allclose(ws[i].numpy(), w, rtol=1e-14, atol=1e-14)
        if b is not None:
            np.testing.assert_allclose(bs[i].numpy(), b, rtol=1e-14, atol=1e-14)
    assert all(torch.equal(a, b) for a, b in zip(gs, g_before))


def test_auto_splits_strided_tensors_off_the_fused_kernel():
    """The fused kernel walks raw memory; a transposed tensor must take the foreach path."""
    p = _PARAMS[2]
    gen = torch.Generator().manual_seed(1)
    ws = [torch.randn(3, 4, generator=gen, dtype=torch.float64).t(), torch.randn(4, 3).double()]
    gs = [torch.randn(4, 3, generator=gen).double(), torch.randn(3, 4, generator=gen).double().t()]
    bs = [torch.randn(4, 3, generator=gen).double(), torch.randn(4, 3, generator=gen).double()]
    want = [_rule(w.numpy(), g.numpy(), b.numpy(), p) for w, g, b in zip(ws, gs, bs)]
    sgd_update(ws, gs, bs, p)
    for i, (w, b) in enumerate(want):
        np.testing.assert_allclose(ws[i].numpy(), w, rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(bs[i].numpy(), b, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", _PARAMS)
def test_fused_sgd_step_pins_torch_kernel(dtype, p):
    """What fused_sgd_step relies on in ``torch._fused_sgd_`` on CPU: the rule to rounding, in
    one call, and gradients untouched (no ``grad_scale`` is passed), also with Nesterov."""
    ws, gs, bs = _tensors(dtype, seed=2)
    bufs = None if p.momentum == 0 else bs
    want = [_rule(w.double().numpy(), g.double().numpy(),
                  None if bufs is None else b.double().numpy(), p)
            for w, g, b in zip(ws, gs, bs)]  # fmt: skip
    g_before = [g.clone() for g in gs]
    fused_sgd_step(ws, gs, bufs, p)
    tol = 1e-14 if dtype == torch.float64 else 2e-6
    for i, (w, b) in enumerate(want):
        np.testing.assert_allclose(ws[i].double().numpy(), w, rtol=tol, atol=tol)
        if b is not None:
            np.testing.assert_allclose(bs[i].double().numpy(), b, rtol=tol, atol=tol)
    assert all(torch.equal(a, b) for a, b in zip(gs, g_before))


def test_fused_is_trusted_only_where_pinned():
    """CPU: float32/float64 only (torch 2.13's CPU kernel is wrong for bfloat16/float16
    momentum buffers); half precision on CPU takes the foreach path and is right."""
    assert fused_supported(torch.zeros(1)) and fused_supported(torch.zeros(1).double())
    assert not fused_supported(torch.zeros(1, dtype=torch.bfloat16))
    assert not fused_supported(torch.zeros(1, dtype=torch.float16))
    p = _PARAMS[2]
    ws, gs, bs = _tensors(torch.bfloat16, seed=3)
    want = [_rule(w.double().numpy(), g.double().numpy(), b.double().numpy(), p)
            for w, g, b in zip(ws, gs, bs)]  # fmt: skip
    sgd_update(ws, gs, bs, p)
    # within a few bfloat16 roundings (the broken fused kernel is off by 0.3 to 1e19 here)
    for i, (w, b) in enumerate(want):
        np.testing.assert_allclose(ws[i].double().numpy(), w, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(bs[i].double().numpy(), b, rtol=2e-2, atol=2e-2)
