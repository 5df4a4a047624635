"""How the Keras numbers in ``test_keras_fidelity.py`` were made (run by hand, never by pytest).

Runs Keras 2.15's ``tf.keras.optimizers.SGD`` on the cases of ``keras_cases.py`` (literal
initial values and gradients, float32) and prints, as a Python literal to paste into
``test_keras_fidelity.py``: each optimizer's ``get_config()``, the variables after every step,
the final momentum slots ``m``, the final EMA averages and, where a case asks for it, the
variables after ``finalize_variable_values``. Numbers are printed as the shortest decimal that
reads back as the same float32.

TensorFlow is not a dependency of distoptim; this script runs in a separate environment::

    python -m venv /work/tfenv && /work/tfenv/bin/pip install "tensorflow-cpu==2.15.*"
    /work/tfenv/bin/python tests/dtensor/keras_reference.py > /tmp/keras_results.py
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from keras_cases import CASES, W0


def _schedule(spec):
    name, kwargs = spec
    return getattr(tf.keras.optimizers.schedules, name)(**kwargs)


def _optimizer(kwargs):
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("learning_rate"), tuple):
        kwargs["learning_rate"] = _schedule(kwargs["learning_rate"])
    return tf.keras.optimizers.SGD(**kwargs)


def _num(x) -> str:
    x = np.float32(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return np.format_float_positional(x, unique=True, trim="-")


def _lit(value) -> str:
    """A Python literal of nested lists of float32 numbers (``nan``/``inf`` as names)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_lit(v) for v in value) + "]"
    return _num(value)


def run_case(case):
    opt = _optimizer(case["keras"])
    vs = [tf.Variable(np.array(w, dtype=np.float32)) for w in W0]
    opt.build(vs)
    weights = []
    for grads in case["grads"]:
        pairs = [
            (None if g is None else tf.constant(np.array(g, dtype=np.float32)), v)
            for g, v in zip(grads, vs)
        ]
        opt.apply_gradients(pairs)
        weights.append([v.numpy().tolist() for v in vs])
    out = {"config": opt.get_config(), "weights": weights}
    if case["keras"].get("momentum", 0.0):
        out["m"] = [m.numpy().tolist() for m in opt.momentums]
    if case["keras"].get("use_ema"):
        out["average"] = [a.numpy().tolist() for a in opt._model_variables_moving_average]
    if case.get("finalize"):
        opt.finalize_variable_values(vs)
        out["finalized"] = [v.numpy().tolist() for v in vs]
    return out


def main() -> None:
    print(f"# Keras {keras.__version__}")
    print(f"# TensorFlow {tf.__version__}, made by tests/dtensor/keras_reference.py")
    print("KERAS = {")
    for name, case in CASES.items():
        res = run_case(case)
        print(f"    {name!r}: {{")
        print(f"        'config': {res['config']!r},")
        print("        'weights': [")
        for step in res["weights"]:
            print(f"            {_lit(step)},")
        print("        ],")
        for key in ("m", "average", "finalized"):
            if key in res:
                print(f"        {key!r}: {_lit(res[key])},")
        print("    },")
    print("}")


if __name__ == "__main__":
    main()
