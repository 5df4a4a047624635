"""Mesh-aware optimizers on DTensor: Keras' ``SGD`` and its option records.

``distoptim.dtensor.SGD`` (also ``distoptim.SGD``), ``GradientsClipOption``, ``EMAOption``;
serializable learning-rate schedules live in :mod:`distoptim.dtensor.schedules`. The semantics
(and how Keras configs migrate) are in ``docs/mesh_sgd.md``.
"""

from distoptim.dtensor.options import EMAOption, GradientsClipOption
from distoptim.dtensor.schedules import ExponentialDecay, PiecewiseConstantDecay
from distoptim.dtensor.sgd import SGD

__all__ = ["EMAOption", "ExponentialDecay", "GradientsClipOption", "PiecewiseConstantDecay", "SGD"]
