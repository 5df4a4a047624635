"""Option records, schedules and SGD's get_config/from_config: validation and exact round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distoptim.dtensor import (
    SGD,
    EMAOption,
    ExponentialDecay,
    GradientsClipOption,
    PiecewiseConstantDecay,
)


@pytest.mark.parametrize(
    "kwargs, err",
    [
        ({"clipnorm": 0.0}, ValueError),
        ({"clipvalue": -1.0}, ValueError),
        ({"global_clipnorm": float("nan")}, ValueError),
        ({"clipnorm": float("inf")}, ValueError),
        ({"clipnorm": 1.0, "global_clipnorm": 1.0}, ValueError),
        ({"clipnorm": "1"}, TypeError),
        ({"clipvalue": True}, TypeError),
    ],
)
def test_clip_option_rejects(kwargs, err):
    with pytest.raises(err):
        GradientsClipOption(**kwargs)


@pytest.mark.parametrize(
    "kwargs, err",
    [
        ({"use_ema": True, "ema_momentum": 1.5}, ValueError),
        ({"use_ema": True, "ema_momentum": -0.1}, ValueError),
        ({"use_ema": True, "ema_momentum": float("nan")}, ValueError),
        ({"use_ema": True, "ema_overwrite_frequency": 0}, ValueError),
        ({"use_ema": True, "ema_overwrite_frequency": 2.0}, TypeError),
        ({"use_ema": True, "ema_overwrite_frequency": True}, TypeError),
        ({"use_ema": 1}, TypeError),
    ],
)
def test_ema_option_rejects(kwargs, err):
    with pytest.raises(err):
        EMAOption(**kwargs)


def test_option_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown keys"):
        GradientsClipOption.from_config({"clipnorm": 1.0, "clip_norm": 2.0})
    with pytest.raises(ValueError, match="unknown keys"):
        EMAOption.from_config({"use_ema": True, "momentum": 0.5})


def test_schedules_follow_keras():
    s = ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    assert s(0) == pytest.approx(0.1) and s(10) == pytest.approx(0.05)
    assert s(5) == pytest.approx(0.1 * 0.5**0.5)
    st_ = ExponentialDecay(0.1, 10, 0.5, staircase=True)
    assert st_(9) == pytest.approx(0.1) and st_(10) == pytest.approx(0.05)
    p = PiecewiseConstantDecay([2, 5], [1.0, 0.5, 0.1])
    assert [p(i) for i in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.1]
    with pytest.raises(ValueError):
        PiecewiseConstantDecay([2, 5], [1.0, 0.5])
    with pytest.raises(ValueError):
        ExponentialDecay(0.1, 0, 0.5)


@pytest.mark.parametrize(
    "make, err, match",
    [
        (lambda: ExponentialDecay(True, 10, 0.5), ValueError, "initial_learning_rate"),
        (lambda: ExponentialDecay(0.1, 10, 0.5, staircase=1), TypeError, "staircase"),
        (lambda: PiecewiseConstantDecay([2, 5], [1.0, "0.5", 0.1]), ValueError, r"values\[1\]"),
        (lambda: PiecewiseConstantDecay([2.0, 5], [1.0, 0.5, 0.1]), TypeError, "boundaries"),
        (lambda: PiecewiseConstantDecay([True, 5], [1.0, 0.5, 0.1]), TypeError, "boundaries"),
    ],
)
def test_schedules_refuse_bools_and_strings_as_numbers(make, err, match):
    """A bool is no learning rate and "0.5" no value: refused, not read as 1 or 0.5."""
    with pytest.raises(err, match=match):
        make()


def test_schedules_take_numpy_scalars_and_serialize_python_numbers():
    s = ExponentialDecay(np.float32(0.5), np.int64(10), np.float64(0.5))
    p = PiecewiseConstantDecay(np.array([2, 5]), np.array([1.0, 0.5, 0.1], dtype=np.float32))
    for sched in (s, p):
        cfg = json.loads(json.dumps(sched.get_config()))
        assert type(sched).from_config(cfg) == sched
    assert s(10) == 0.25 and p(3) == 0.5


_pos = st.floats(1e-6, 1e6, allow_nan=False, allow_infinity=False)
_clip = st.one_of(
    st.none(),
    st.builds(
        GradientsClipOption,
        clipnorm=st.one_of(st.none(), _pos),
        clipvalue=st.one_of(st.none(), _pos),
    ),
    st.builds(
        GradientsClipOption,
        global_clipnorm=st.one_of(st.none(), _pos),
        clipvalue=st.one_of(st.none(), _pos),
    ),
)
_ema = st.one_of(
    st.none(),
    st.builds(
        EMAOption,
        use_ema=st.booleans(),
        ema_momentum=st.floats(0.0, 1.0),
        ema_overwrite_frequency=st.one_of(st.none(), st.integers(1, 10_000)),
    ),
)
_lr = st.one_of(
    st.floats(0.0, 10.0),
    st.builds(
        ExponentialDecay,
        initial_learning_rate=st.floats(0.0, 1.0),
        decay_steps=st.integers(1, 1000),
        decay_rate=st.floats(0.01, 1.0),
        staircase=st.booleans(),
    ),
    st.builds(
        PiecewiseConstantDecay,
        boundaries=st.just([10, 20]),
        values=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3),
    ),
)


@pytest.mark.filterwarnings("ignore:gradients_clip_option sets")
@settings(max_examples=60, deadline=None)
@given(
    lr=_lr,
    momentum=st.floats(0.0, 1.0),
    nesterov=st.booleans(),
    clip=_clip,
    ema=_ema,
    jit=st.booleans(),
    name=st.text(max_size=12),
)
def test_config_round_trip(lr, momentum, nesterov, clip, ema, jit, name):
    opt = SGD(
        learning_rate=lr,
        momentum=momentum,
        nesterov=nesterov,
        gradients_clip_option=clip,
        ema_option=ema,
        jit_compile=jit,
        name=name,
    )
    cfg = opt.get_config()
    text = json.dumps(cfg)  # JSON-serializable
    again = SGD.from_config(json.loads(text))
    assert again.get_config() == cfg
    assert again.get_name() == name
    assert again._clip == clip and again._ema_option == ema
    if callable(lr):
        assert [again.learning_rate(i) for i in (0, 7, 25)] == [lr(i) for i in (0, 7, 25)]
    else:
        assert again.learning_rate == lr


def test_from_config_rejects_unknown_keys_and_bad_schedules():
    cfg = SGD(learning_rate=0.1).get_config()
    with pytest.raises(ValueError, match="unknown config keys"):
        SGD.from_config({**cfg, "lr_decay": 0.1})
    with pytest.raises(ValueError, match="cannot find schedule"):
        SGD.from_config({**cfg, "learning_rate": {"class_name": "nowhere.Nope", "config": {}}})
    with pytest.raises(ValueError, match="from_config"):
        SGD.from_config({**cfg, "learning_rate": {"class_name": "math.sqrt", "config": {}}})


def test_lambda_schedule_runs_but_cannot_be_serialized():
    opt = SGD(learning_rate=lambda step: 0.1 / (1 + step))
    with pytest.raises(ValueError, match="cannot be serialized"):
        opt.get_config()


def test_config_is_the_keras_argument_list():
    cfg = SGD(lr=0.5, momentum=0.9, name="opt").get_config()
    assert set(cfg) == {
        "name",
        "learning_rate",
        "momentum",
        "nesterov",
        "amsgrad",
        "gradients_clip_option",
        "ema_option",
        "jit_compile",
        "mesh",
    }
    assert cfg["learning_rate"] == 0.5 and cfg["amsgrad"] is False
    assert isinstance(SGD.from_config(cfg), torch.optim.Optimizer)
