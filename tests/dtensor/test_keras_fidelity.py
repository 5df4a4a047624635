"""distoptim.dtensor.SGD against Keras 2.15's ``tf.keras.optimizers.SGD``, Keras' numbers literally.

``KERAS`` below was printed by ``keras_reference.py`` (TensorFlow 2.15.1, Keras 2.15.0, float32;
see that file for how to rerun it) for the inputs of ``keras_cases.py``: per case, Keras' own
``get_config()`` dict, the variables after every step, the final momentum slots ``m``, EMA
averages and finalized variables. Each test builds our SGD from Keras' config dict
(``SGD.from_config``), replays the same gradients (``None`` = no gradient for that variable in
that step) and must land within 1e-6 of Keras at every step, NaNs at the same places.

What the cases pin: the update rule with constant, decaying (every step), staircase and
piecewise learning rates, one of them 0 for two steps (the momentum's internal units must
follow the rate exactly); Keras' clipping (only the first of clipnorm, global_clipnorm,
clipvalue applies; clipnorm of an inf gradient is NaN at the inf element and 0 elsewhere);
EMA where a variable gets no gradient (its average is untouched and an overwrite skips it).
TensorFlow is not needed to run these tests.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distoptim.dtensor import SGD
from tests.dtensor.keras_cases import CASES, W0

nan = float("nan")
inf = float("inf")

# Keras 2.15.0, TensorFlow 2.15.1: printed by tests/dtensor/keras_reference.py
KERAS = {
    "plain": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.1,
            "momentum": 0.0,
            "nesterov": False,
        },
        "weights": [
            [[0.47, -1.13, 1.75], [[0.96, -0.51], [0.32, 2.89]]],
            [[0.55, -1.19, 1.56], [[0.80999994, -0.48999998], [0.29, 2.98]]],
            [[0.41000003, -1.21, 1.6099999], [[0.86999995, -0.57], [0.16999999, 2.975]]],
        ],
    },
    "momentum": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.05,
            "momentum": 0.9,
            "nesterov": False,
        },
        "weights": [
            [[0.485, -1.19, 1.875], [[0.98, -0.505], [0.285, 2.945]]],
            [[0.5115, -1.166, 1.6675], [[0.887, -0.4995], [0.3015, 2.9405]]],
            [[0.46535, -1.1544, 1.5057501], [[0.8333, -0.53455], [0.25634998, 2.93395]]],
            [[0.41881502, -1.03396, 1.325175], [[0.73996997, -0.501095], [0.23571497, 2.8980548]]],
            [
                [0.43193352, -0.970564, 1.1476575],
                [[0.64597297, -0.5059855], [0.29714346, 2.8807492]],
            ],
            [
                [0.4137402, -0.9985076, 1.0378917],
                [[0.58637565, -0.5303869], [0.3124291, 2.7951744]],
            ],
        ],
        "m": [
            [-0.018193344, -0.027943596, -0.10976574],
            [[-0.05959729, -0.024401452], [0.015285648, -0.085574955]],
        ],
    },
    "nesterov": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.05,
            "momentum": 0.9,
            "nesterov": True,
        },
        "weights": [
            [[0.4715, -1.136, 1.7625], [[0.962, -0.5095], [0.3165, 2.8955]]],
            [[0.53535, -1.1444, 1.4807501], [[0.8033, -0.49455002], [0.31635, 2.93645]]],
            [[0.423815, -1.14396, 1.3601751], [[0.78497005, -0.566095], [0.215715, 2.928055]]],
            [[0.37693352, -0.925564, 1.1626576], [[0.6559731, -0.4709855], [0.2171435, 2.8657496]]],
            [
                [0.4437402, -0.9135076, 0.9878919],
                [[0.5613758, -0.51038694], [0.35242915, 2.8651745]],
            ],
            [
                [0.39736617, -1.0236568, 0.93910277],
                [[0.5327382, -0.55234826], [0.32618624, 2.718157]],
            ],
        ],
        "m": [
            [-0.018193344, -0.027943596, -0.10976574],
            [[-0.05959729, -0.024401452], [0.015285648, -0.085574955]],
        ],
    },
    "nesterov_exponential_decay": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": {
                "module": "keras.optimizers.schedules",
                "class_name": "ExponentialDecay",
                "config": {
                    "initial_learning_rate": 0.1,
                    "decay_steps": 2,
                    "decay_rate": 0.5,
                    "staircase": False,
                    "name": None,
                },
                "registered_name": None,
            },
            "momentum": 0.9,
            "nesterov": True,
        },
        "weights": [
            [[0.443, -1.022, 1.525], [[0.924, -0.519], [0.38300002, 2.791]]],
            [
                [0.5261802, -1.0054102, 1.0672344],
                [[0.69007456, -0.50022995], [0.39939493, 2.8228152]],
            ],
            [
                [0.4171307, -0.9712956, 0.82366073],
                [[0.6320011, -0.5720648], [0.31924224, 2.7894232]],
            ],
            [
                [0.37526867, -0.78380716, 0.53492177],
                [[0.49227735, -0.5133885], [0.32797486, 2.7213154]],
            ],
            [
                [0.3930248, -0.7278211, 0.2830806],
                [[0.3856638, -0.5351956], [0.39910632, 2.6933603]],
            ],
            [
                [0.36410278, -0.7142826, 0.09676112],
                [[0.31100538, -0.552507], [0.40025458, 2.614428]],
            ],
            [
                [0.3523689, -0.66555107, -0.117711306],
                [[0.21210787, -0.5403483], [0.4116409, 2.579913]],
            ],
        ],
        "m": [
            [-0.015815418, 0.048590597, -0.22024715],
            [[-0.09599725, 0.001009671], [0.014040378, -0.046683498]],
        ],
    },
    "momentum_staircase_decay": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": {
                "module": "keras.optimizers.schedules",
                "class_name": "ExponentialDecay",
                "config": {
                    "initial_learning_rate": 0.2,
                    "decay_steps": 3,
                    "decay_rate": 0.1,
                    "staircase": True,
                    "name": None,
                },
                "registered_name": None,
            },
            "momentum": 0.8,
            "nesterov": False,
        },
        "weights": [
            [[0.44, -1.01, 1.5], [[0.92, -0.52], [0.39, 2.78]]],
            [[0.552, -0.93799996, 0.72], [[0.556, -0.496], [0.44199997, 2.784]]],
            [[0.36159998, -0.92039996, 0.19600004], [[0.3848, -0.6368], [0.24359997, 2.7772]]],
            [
                [0.20727997, -0.86231995, -0.23719996],
                [[0.22983997, -0.72344], [0.092879966, 2.75976]],
            ],
            [
                [0.10582395, -0.8338559, -0.58975995],
                [[0.10187195, -0.806752], [0.004303962, 2.751808]],
            ],
            [
                [0.0126591325, -0.8450847, -0.85180795],
                [[0.009497538, -0.88140166], [-0.082556844, 2.7174463]],
            ],
            [
                [-0.06147272, -0.8532678, -1.0640464],
                [[-0.06640199, -0.93932134], [-0.15224549, 2.691157]],
            ],
        ],
        "m": [
            [-0.074131854, -0.008183038, -0.2122384],
            [[-0.07589953, -0.05791969], [-0.06968865, -0.02628929]],
        ],
    },
    "nesterov_piecewise_through_zero": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": {
                "module": "keras.optimizers.schedules",
                "class_name": "PiecewiseConstantDecay",
                "config": {"boundaries": [1, 3], "values": [0.1, 0.0, 0.02], "name": None},
                "registered_name": None,
            },
            "momentum": 0.8,
            "nesterov": True,
        },
        "weights": [
            [[0.44599998, -1.0339999, 1.55], [[0.928, -0.518], [0.376, 2.802]]],
            [[0.5708, -1.0652, 1.048], [[0.6324, -0.4884], [0.36679998, 2.8936]]],
            [[0.60664, -1.0421599, 0.7984], [[0.51592, -0.48072], [0.38344, 2.89488]]],
            [[0.63531196, -1.0237279, 0.59871995], [[0.422736, -0.47457603], [0.396752, 2.895904]]],
            [
                [0.6978496, -1.0413823, 0.42817593],
                [[0.34098879, -0.49486083], [0.4650016, 2.9075232]],
            ],
            [
                [0.7086797, -1.1023059, 0.3325407],
                [[0.29679102, -0.51428866], [0.4652013, 2.8616185]],
            ],
            [
                [0.73414373, -1.1094447, 0.19323252],
                [[0.2174328, -0.49103093], [0.47456104, 2.8688948]],
            ],
        ],
        "m": [
            [0.026830083, -0.018923521, -0.14163521],
            [[-0.07419777, 0.00657216], [0.014199683, -0.005904643]],
        ],
    },
    "clipnorm_and_clipvalue": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": 1.0,
            "global_clipnorm": None,
            "clipvalue": 0.3,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.1,
            "momentum": 0.9,
            "nesterov": False,
        },
        "weights": [
            [[0.4892445, -1.206978, 1.9103707], [[0.9707491, -0.5073127], [0.30118906, 2.91956]]],
            [
                [0.51682425, -1.1962029, 1.7412125],
                [[0.8604394, -0.50269634], [0.33046246, 2.8975544]],
            ],
            [[0.4483127, -1.1998386, 1.6223034], [[0.7995521, -0.5497301], [0.2800257, 2.87455]]],
            [
                [0.38232487, -1.1079075, 1.4849932],
                [[0.6929643, -0.51725394], [0.25765002, 2.81932]],
            ],
        ],
        "m": [
            [-0.065987825, 0.09193114, -0.13731013],
            [[-0.10658775, 0.032476198], [-0.02237567, -0.055230044]],
        ],
    },
    "global_clipnorm_and_clipvalue": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": 2.0,
            "clipvalue": 0.3,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.1,
            "momentum": 0.9,
            "nesterov": True,
        },
        "weights": [
            [
                [0.4633021, -1.1032084, 1.6941842],
                [[0.9510695, -0.51223266], [0.33562842, 2.865441]],
            ],
            [
                [0.5565067, -1.1222659, 1.3052926],
                [[0.7261169, -0.49023527], [0.33131462, 2.9305322]],
            ],
            [
                [0.3432412, -1.1358317, 1.1654563],
                [[0.7255876, -0.62366444], [0.13626218, 2.9223378]],
            ],
            [
                [0.2544915, -0.8422854, 0.90605855],
                [[0.5569716, -0.5064219], [0.11299823, 2.840262]],
            ],
        ],
        "m": [
            [-0.09092508, 0.1570768, -0.23441969],
            [[-0.11817966, 0.030355167], [-0.056591697, -0.04508094]],
        ],
    },
    "clipvalue": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": 0.5,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.1,
            "momentum": 0.5,
            "nesterov": False,
        },
        "weights": [
            [[0.47, -1.2, 1.95], [[0.96, -0.51], [0.3, 2.95]]],
            [[0.505, -1.225, 1.875], [[0.89, -0.495], [0.29500002, 2.9750001]]],
            [[0.4725, -1.2575, 1.8875], [[0.905, -0.5375], [0.2425, 2.9825]]],
        ],
        "m": [
            [-0.0325, -0.032500003, 0.012499999],
            [[0.015000001, -0.0425], [-0.052500002, 0.0075]],
        ],
    },
    "clipnorm_inf_and_nan": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": 1.0,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.1,
            "momentum": 0.9,
            "nesterov": False,
        },
        "weights": [
            [[0.5, nan, 2], [[nan, nan], [nan, nan]]],
            [[0.5372597, nan, 1.9115082], [[nan, nan], [nan, nan]]],
        ],
        "m": [[0.03725972, nan, -0.08849183], [[nan, nan], [nan, nan]]],
    },
    "global_clipnorm_inf": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": 1.0,
            "clipvalue": None,
            "use_ema": False,
            "ema_momentum": 0.99,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.1,
            "momentum": 0.0,
            "nesterov": False,
        },
        "weights": [
            [[nan, nan, nan], [[nan, nan], [nan, nan]]],
        ],
    },
    "ema_missing_gradient": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": None,
            "clipvalue": None,
            "use_ema": True,
            "ema_momentum": 0.8,
            "ema_overwrite_frequency": 3,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.1,
            "momentum": 0.5,
            "nesterov": True,
        },
        "weights": [
            [[0.45499998, -1.0699999, 1.625], [[0.94, -0.515], [0.35500002, 2.835]]],
            [[0.5675, -1.1299999, 1.2775], [[0.94, -0.515], [0.35500002, 2.835]]],
            [[0.47979, -1.18976, 1.6911501], [[0.94, -0.515], [0.35500002, 2.835]]],
            [[0.437915, -0.8647599, 1.559275], [[0.795, -0.3225], [0.4325, 2.7175]]],
            [[0.437915, -0.8647599, 1.559275], [[0.7375, -0.39625], [0.69125, 2.7337499]]],
            [[0.44352752, -1.1132599, 1.6674876], [[0.7375, -0.39625], [0.69125, 2.7337499]]],
            [[0.45055878, -1.0695099, 1.482019], [[0.56875, -0.263125], [0.72562504, 2.816875]]],
        ],
        "m": [
            [-0.0259375, 0.007500004, -0.11093749],
            [[-0.1375, 0.08624999], [0.08875001, 0.04625]],
        ],
        "average": [
            [0.44493377, -1.10451, 1.6303939],
            [[0.8393661, -0.41484103], [0.44983703, 2.867719]],
        ],
        "finalized": [
            [0.44493377, -1.10451, 1.6303939],
            [[0.8393661, -0.41484103], [0.44983703, 2.867719]],
        ],
    },
    "ema_global_clipnorm": {
        "config": {
            "name": "SGD",
            "weight_decay": None,
            "clipnorm": None,
            "global_clipnorm": 1.5,
            "clipvalue": None,
            "use_ema": True,
            "ema_momentum": 0.9,
            "ema_overwrite_frequency": None,
            "jit_compile": False,
            "is_legacy_optimizer": False,
            "learning_rate": 0.05,
            "momentum": 0.9,
            "nesterov": False,
        },
        "weights": [
            [[0.492757, -1.221028, 1.9396416], [[0.9903427, -0.50241435], [0.26690036, 2.9734423]]],
            [
                [0.5077217, -1.2110658, 1.8342959],
                [[0.9413696, -0.49921638], [0.27405438, 2.9737093]],
            ],
            [
                [0.47271842, -1.2090243, 1.756796],
                [[0.91806734, -0.5240362], [0.23894593, 2.9722185]],
            ],
            [
                [0.43862152, -1.1501205, 1.6688886],
                [[0.87375, -0.51265305], [0.21772404, 2.9553132]],
            ],
            [[0.44380388, -1.126455, 1.5799893], [[0.8273426, -0.5252343], [0.25079826, 2.949881]]],
        ],
        "m": [
            [0.0051823556, 0.023665585, -0.08889926],
            [[-0.046407368, -0.012581221], [0.033074223, -0.005432211]],
        ],
        "average": [
            [0.48673418, -1.220598, 1.8924592],
            [[0.95982736, -0.50571036], [0.24914199, 2.9850569]],
        ],
        "finalized": [
            [0.48673418, -1.220598, 1.8924592],
            [[0.95982736, -0.50571036], [0.24914199, 2.9850569]],
        ],
    },
}


def _run(name: str):
    """Our SGD from Keras' config on the case's inputs: the variables after each step, and it."""
    case, ref = CASES[name], KERAS[name]
    opt = SGD.from_config(ref["config"])
    vs = [torch.tensor(w, dtype=torch.float32, requires_grad=True) for w in W0]
    opt.build(vs)
    trajectory = []
    for grads in case["grads"]:
        pairs = [(None if g is None else torch.tensor(g), v) for g, v in zip(grads, vs)]
        opt.apply_gradients(pairs)
        trajectory.append([v.detach().clone() for v in vs])
    return opt, vs, trajectory


def _close(got, want):
    np.testing.assert_allclose(got.numpy(), np.array(want, dtype=np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.filterwarnings("ignore:gradients_clip_option sets")
@pytest.mark.parametrize("name", list(CASES))
def test_trajectory_matches_keras(name):
    ref = KERAS[name]
    opt, vs, trajectory = _run(name)
    assert len(trajectory) == len(ref["weights"])
    for got_step, want_step in zip(trajectory, ref["weights"]):
        for got, want in zip(got_step, want_step):
            _close(got, want)
    for slot in ("m", "average"):
        if slot in ref:
            for v, want in zip(vs, ref[slot]):
                _close(opt.get_slot(v, slot), want)
        else:
            assert all(opt.get_slot(v, slot) is None for v in vs)
    if "finalized" in ref:
        opt.finalize_variable_values(vs)
        for v, want in zip(vs, ref["finalized"]):
            _close(v.detach(), want)


@pytest.mark.parametrize(
    "name, ignored",
    [("clipnorm_and_clipvalue", "clipvalue"), ("global_clipnorm_and_clipvalue", "clipvalue")],
)
def test_two_clip_options_warn_once_naming_the_ignored_one(name, ignored):
    with pytest.warns(UserWarning, match=f"{ignored} will be ignored") as caught:
        SGD.from_config(KERAS[name]["config"])
    assert len(caught) == 1


@pytest.mark.filterwarnings("ignore:gradients_clip_option sets")
def test_keras_config_maps_onto_ours():
    """Keras' flat keys become the option records; the schedule becomes ours."""
    cfg = SGD.from_config(KERAS["ema_missing_gradient"]["config"]).get_config()
    assert cfg == {
        "name": "SGD",
        "learning_rate": 0.1,
        "momentum": 0.5,
        "nesterov": True,
        "amsgrad": False,
        "gradients_clip_option": None,
        "ema_option": {"use_ema": True, "ema_momentum": 0.8, "ema_overwrite_frequency": 3},
        "jit_compile": False,
        "mesh": None,
    }
    cfg = SGD.from_config(KERAS["nesterov_exponential_decay"]["config"]).get_config()
    assert cfg["learning_rate"] == {
        "class_name": "distoptim.dtensor.schedules.ExponentialDecay",
        "config": {
            "initial_learning_rate": 0.1,
            "decay_steps": 2,
            "decay_rate": 0.5,
            "staircase": False,
        },
    }
    cfg = SGD.from_config(KERAS["global_clipnorm_and_clipvalue"]["config"]).get_config()
    assert cfg["gradients_clip_option"] == {
        "clipnorm": None,
        "clipvalue": 0.3,
        "global_clipnorm": 2.0,
    }
