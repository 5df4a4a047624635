"""The inputs of the Keras fidelity cases: initial values, gradients and Keras' SGD arguments.

Plain Python literals only (no imports), so that both ``keras_reference.py`` (run by hand with
TensorFlow 2.15) and ``test_keras_fidelity.py`` (run by pytest, without TensorFlow) read the same
numbers. Keras' *results* for these inputs are written literally in ``test_keras_fidelity.py``.

Every case starts from :data:`W0` (a 3-vector ``a`` and a 2x2 matrix ``b``) and applies
``len(grads)`` steps; a gradient ``None`` means the variable gets no gradient in that step.
``keras`` holds the keyword arguments of ``tf.keras.optimizers.SGD``; a learning-rate schedule
is written ``("ExponentialDecay", {...})`` / ``("PiecewiseConstantDecay", {...})``.
"""

W0 = [[0.5, -1.25, 2.0], [[1.0, -0.5], [0.25, 3.0]]]

_G = [
    [[0.3, -1.2, 2.5], [[0.4, 0.1], [-0.7, 1.1]]],
    [[-0.8, 0.6, 1.9], [[1.5, -0.2], [0.3, -0.9]]],
    [[1.4, 0.2, -0.5], [[-0.6, 0.8], [1.2, 0.05]]],
    [[0.1, -2.2, 0.7], [[0.9, -1.3], [-0.4, 0.6]]],
    [[-1.1, 0.9, 0.3], [[0.2, 0.7], [-1.6, -0.3]]],
    [[0.6, 1.7, -1.0], [[-0.5, 0.4], [0.8, 1.4]]],
    [[-0.2, -0.4, 1.3], [[1.0, -0.9], [0.1, -0.6]]],
]

_INF = float("inf")
_NAN = float("nan")

CASES = {
    # ---- the update rule -------------------------------------------------------------------
    "plain": {"keras": {"learning_rate": 0.1}, "grads": _G[:3]},
    "momentum": {"keras": {"learning_rate": 0.05, "momentum": 0.9}, "grads": _G[:6]},
    "nesterov": {
        "keras": {"learning_rate": 0.05, "momentum": 0.9, "nesterov": True},
        "grads": _G[:6],
    },
    # a learning rate that changes at every step (the momentum's internal units follow it)
    "nesterov_exponential_decay": {
        "keras": {
            "learning_rate": (
                "ExponentialDecay",
                {"initial_learning_rate": 0.1, "decay_steps": 2, "decay_rate": 0.5},
            ),
            "momentum": 0.9,
            "nesterov": True,
        },
        "grads": _G[:7],
    },
    "momentum_staircase_decay": {
        "keras": {
            "learning_rate": (
                "ExponentialDecay",
                {
                    "initial_learning_rate": 0.2,
                    "decay_steps": 3,
                    "decay_rate": 0.1,
                    "staircase": True,
                },
            ),
            "momentum": 0.8,
        },
        "grads": _G[:7],
    },
    # learning rates 0.1, 0.1, 0, 0, 0.02, 0.02, 0.02: steps at lr 0 still move by momentum
    "nesterov_piecewise_through_zero": {
        "keras": {
            "learning_rate": (
                "PiecewiseConstantDecay",
                {"boundaries": [1, 3], "values": [0.1, 0.0, 0.02]},
            ),
            "momentum": 0.8,
            "nesterov": True,
        },
        "grads": _G[:7],
    },
    # ---- clipping: Keras applies only the first option set (clipnorm, global_clipnorm, value)
    "clipnorm_and_clipvalue": {
        "keras": {"learning_rate": 0.1, "momentum": 0.9, "clipnorm": 1.0, "clipvalue": 0.3},
        "grads": _G[:4],
    },
    "global_clipnorm_and_clipvalue": {
        "keras": {
            "learning_rate": 0.1,
            "momentum": 0.9,
            "nesterov": True,
            "global_clipnorm": 2.0,
            "clipvalue": 0.3,
        },
        "grads": _G[:4],
    },
    "clipvalue": {
        "keras": {"learning_rate": 0.1, "momentum": 0.5, "clipvalue": 0.5},
        "grads": _G[:3],
    },
    # an Inf element: NaN there only; a NaN element: the whole tensor NaN
    "clipnorm_inf_and_nan": {
        "keras": {"learning_rate": 0.1, "momentum": 0.9, "clipnorm": 1.0},
        "grads": [
            [[0.3, _INF, 2.5], [[_NAN, 0.1], [-0.7, 1.1]]],
            _G[1],
        ],
    },
    "global_clipnorm_inf": {
        "keras": {"learning_rate": 0.1, "global_clipnorm": 1.0},
        "grads": [[[0.3, _INF, 2.5], [[0.4, 0.1], [-0.7, 1.1]]]],
    },
    # ---- EMA: a variable without a gradient keeps its average; the overwrite skips it --------
    "ema_missing_gradient": {
        "keras": {
            "learning_rate": 0.1,
            "momentum": 0.5,
            "nesterov": True,
            "use_ema": True,
            "ema_momentum": 0.8,
            "ema_overwrite_frequency": 3,
        },
        "grads": [
            _G[0],
            [_G[1][0], None],
            [_G[2][0], None],  # an overwrite step: b is not overwritten
            _G[3],
            [None, _G[4][1]],
            [_G[5][0], None],  # overwrite step again
            _G[6],
        ],
        "finalize": True,
    },
    "ema_global_clipnorm": {
        "keras": {
            "learning_rate": 0.05,
            "momentum": 0.9,
            "global_clipnorm": 1.5,
            "use_ema": True,
            "ema_momentum": 0.9,
        },
        "grads": _G[:5],
        "finalize": True,
    },
}
