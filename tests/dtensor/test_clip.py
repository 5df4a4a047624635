"""distoptim.dtensor.clip on plain tensors against a numpy reference (the mesh cases run in
test_mesh.py): each rule, which one applies when several are set, and Keras' inf/NaN behaviour
(Keras' own numbers are in test_keras_fidelity.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distoptim.dtensor import GradientsClipOption
from distoptim.dtensor.clip import clip_gradients, squared_norms


def _np_clip(grads, clipnorm=None, clipvalue=None, global_clipnorm=None):
    """The rule of GradientsClipOption, written independently in float64 numpy: only the first
    option set applies (clipnorm, global_clipnorm, clipvalue), with Keras' formulas."""
    out = [np.asarray(g, dtype=np.float64).copy() for g in grads]
    with np.errstate(invalid="ignore", divide="ignore"):
        if clipnorm is not None:  # tf.clip_by_norm: t * c / max(||t||, c)
            return [g * clipnorm / np.maximum(np.sqrt(np.sum(g * g)), clipnorm) for g in out]
        if global_clipnorm is not None:  # tf.clip_by_global_norm
            n = np.sqrt(sum(np.sum(g * g) for g in out))
            s = global_clipnorm * min(1.0 / n, 1.0 / global_clipnorm) + (n - n)
            return [g * s for g in out]
    if clipvalue is not None:
        return [np.clip(g, -clipvalue, clipvalue) for g in out]
    return out


def _grads(seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (7,), (2, 2, 2), ()]
    return [torch.randn(s, generator=gen, dtype=torch.float64) * scale for s in shapes]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"clipnorm": 1.0},
        {"clipnorm": 100.0},  # no-op: every norm below
        {"global_clipnorm": 2.0},
        {"global_clipnorm": 1e6},
        {"clipvalue": 0.5},
        {"clipnorm": 3.0, "clipvalue": 0.4},  # clipvalue ignored (Keras)
        {"global_clipnorm": 2.0, "clipvalue": 0.3},  # clipvalue ignored (Keras)
    ],
)
def test_clipping_matches_numpy_reference(kwargs):
    grads = _grads()
    before = [g.clone() for g in grads]
    got = clip_gradients(grads, GradientsClipOption(**kwargs))
    want = _np_clip([g.numpy() for g in grads], **kwargs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-12, atol=1e-15)
    for g, b in zip(grads, before):  # inputs untouched
        assert torch.equal(g, b)


def test_only_the_first_option_set_applies():
    """Keras: clipnorm, then global_clipnorm, then clipvalue -- the first set is the only rule."""
    g = [torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([0.0, 12.0]).double()]
    both = GradientsClipOption(clipnorm=1.0, clipvalue=0.7)
    assert both.rule == "clipnorm" and both.ignored == ("clipvalue",)
    got = clip_gradients(g, both)
    alone = clip_gradients(g, GradientsClipOption(clipnorm=1.0))
    assert all(torch.equal(a, b) for a, b in zip(got, alone))
    np.testing.assert_allclose(got[0].numpy(), [0.6, 0.8])  # 0.8 > clipvalue: not clamped
    both = GradientsClipOption(global_clipnorm=1.0, clipvalue=0.1)
    assert both.rule == "global_clipnorm" and both.ignored == ("clipvalue",)
    got = clip_gradients(g, both)
    np.testing.assert_allclose(got[1].numpy(), [0.0, 12.0 / 13.0])
    assert GradientsClipOption(clipvalue=0.5).ignored == () and GradientsClipOption().rule is None


def test_no_option_returns_the_same_objects():
    g = _grads()
    assert all(a is b for a, b in zip(clip_gradients(g, None), g))
    assert all(a is b for a, b in zip(clip_gradients(g, GradientsClipOption()), g))


def test_squared_norms_match_numpy_and_bf16_accumulates_in_fp32():
    g = _grads()
    sq = squared_norms(g, [None] * len(g))
    np.testing.assert_allclose(sq.numpy(), [float((x * x).sum()) for x in g], rtol=1e-12)
    b = [torch.full((4096,), 1.0, dtype=torch.bfloat16)]
    assert squared_norms(b, [None]).dtype == torch.float32
    assert squared_norms(b, [None]).item() == 4096.0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradients_follow_keras(bad):
    g = _grads()
    g[1][2] = bad
    # per-tensor, t * c / max(||t||, c): an inf element is NaN, the rest of its tensor 0; a NaN
    # element makes its tensor NaN; the other tensors are clipped as usual
    got = clip_gradients(g, GradientsClipOption(clipnorm=1.0))
    if bad == float("inf"):
        assert torch.isnan(got[1][2]) and (got[1][torch.arange(7) != 2] == 0).all()
    else:
        assert torch.isnan(got[1]).all()
    for i in (0, 2, 3):
        assert torch.isfinite(got[i]).all()
    want = _np_clip([x.numpy() for x in g], clipnorm=1.0)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-12)
    # global: every gradient becomes NaN
    got = clip_gradients(g, GradientsClipOption(global_clipnorm=1.0))
    assert all(torch.isnan(x).all() for x in got)
    # value only: inf clamps to +-clipvalue, NaN stays NaN
    got = clip_gradients(g, GradientsClipOption(clipvalue=0.5))[1]
    assert (got[2].item() == 0.5) if bad == float("inf") else torch.isnan(got[2])
