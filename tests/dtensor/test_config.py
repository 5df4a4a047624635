"""distoptim.dtensor.config: Keras 2 config dicts (written out as Keras prints them) become the
same optimizer, and what cannot be honoured is refused with a clear error. The trajectories
of Keras configs against Keras' own numbers are in test_keras_fidelity.py."""

from __future__ import annotations

import numpy as np
import pytest

from distoptim.dtensor import SGD, ExponentialDecay, PiecewiseConstantDecay
from tests.dtensor.test_keras_fidelity import KERAS

# tf.keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True).get_config() in Keras 2.15
_KERAS = KERAS["nesterov"]["config"]


def test_keras_serialize_wrapper_and_numpy_scalars_are_accepted():
    # tf.keras.optimizers.serialize(opt) wraps the config; get_config() itself holds the
    # learning rate as a numpy float32
    wrapped = {
        "module": "keras.optimizers.experimental",
        "class_name": "SGD",
        "config": {**_KERAS, "learning_rate": np.float32(0.05)},
        "registered_name": None,
    }
    opt = SGD.from_config(wrapped)
    assert opt.learning_rate == pytest.approx(0.05) and opt.defaults["nesterov"] is True
    assert opt._clip is None and opt._ema_option is None


def test_keras_schedules_in_both_spellings():
    new = {  # Keras 2.13+
        "module": "keras.optimizers.schedules",
        "class_name": "PiecewiseConstantDecay",
        "config": {"boundaries": [1, 3], "values": [0.1, 0.0, 0.02], "name": None},
        "registered_name": None,
    }
    old = {  # Keras 2.11-2.12: no module
        "class_name": "ExponentialDecay",
        "config": {
            "initial_learning_rate": 0.1,
            "decay_steps": 2,
            "decay_rate": 0.5,
            "staircase": False,
            "name": "decay",
        },
    }
    s = SGD.from_config({**_KERAS, "learning_rate": new}).learning_rate
    assert s == PiecewiseConstantDecay((1, 3), (0.1, 0.0, 0.02))
    s = SGD.from_config({**_KERAS, "learning_rate": old}).learning_rate
    assert s == ExponentialDecay(0.1, 2, 0.5)


def test_zero_clip_values_mean_off_as_in_keras():
    opt = SGD.from_config({**_KERAS, "clipnorm": 0.0, "clipvalue": 0, "weight_decay": 0.0})
    assert opt._clip is None


@pytest.mark.parametrize(
    "change, err, match",
    [
        ({"weight_decay": 0.004}, ValueError, "weight_decay"),
        ({"is_legacy_optimizer": True}, ValueError, "legacy"),
        ({"decay": 0.0}, ValueError, "legacy"),
        ({"gradients_clip_option": {"clipnorm": 1.0}}, ValueError, "mixing"),
        ({"clipnorm": 1.0, "global_clipnorm": 1.0}, ValueError, "cannot both be set"),
        ({"ema_momentum": 1.5, "use_ema": True}, ValueError, "ema_momentum"),
        ({"use_ema": 1}, TypeError, "use_ema"),
        ({"momentum": 1.2}, ValueError, "momentum"),
        (
            {
                "learning_rate": {
                    "module": "keras.optimizers.schedules",
                    "class_name": "CosineDecay",
                    "config": {"initial_learning_rate": 0.1, "decay_steps": 10},
                    "registered_name": None,
                }
            },
            ValueError,
            "CosineDecay.*not supported",
        ),
    ],
)
def test_keras_configs_that_cannot_be_honoured_are_refused(change, err, match):
    with pytest.raises(err, match=match):
        SGD.from_config({**_KERAS, **change})
