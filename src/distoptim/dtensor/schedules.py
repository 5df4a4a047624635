"""Serializable learning-rate schedules (functions of the optimizer's ``iterations``).

Owns: the two Keras schedules most often used with the Keras SGD, as callables
``schedule(step) -> float`` with ``get_config`` / ``from_config``, so that
``SGD(learning_rate=schedule).get_config()`` is JSON and ``SGD.from_config`` rebuilds it.
Any callable works as a ``learning_rate``; only ones with ``get_config``/``from_config``
(like these) can be serialized.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

from distoptim.checks import type_name

__all__ = ["ExponentialDecay", "PiecewiseConstantDecay"]


def _from_config(cls: type, config: Any) -> Any:
    if not isinstance(config, dict):
        raise TypeError(f"{cls.__name__}.from_config needs a dict, got {type_name(config)}")
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; allowed: {sorted(allowed)}")
    return cls(**config)


@dataclasses.dataclass(frozen=True)
class ExponentialDecay:
    """``lr(step) = initial_learning_rate * decay_rate ** (step / decay_steps)``.

    With ``staircase`` the exponent is ``step // decay_steps`` (a step function).
    """

    initial_learning_rate: float
    decay_steps: int
    decay_rate: float
    staircase: bool = False

    def __post_init__(self) -> None:
        lr, rate = self.initial_learning_rate, self.decay_rate
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0):
            raise ValueError(f"initial_learning_rate must be a finite number >= 0, got {lr!r}")
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"decay_rate must be a finite number > 0, got {rate!r}")
        steps = self.decay_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"decay_steps must be an int >= 1, got {steps!r}")
        if not isinstance(self.staircase, bool):
            raise TypeError(f"staircase must be a bool, got {type_name(self.staircase)}")

    def __call__(self, step: int) -> float:
        p = step // self.decay_steps if self.staircase else step / self.decay_steps
        return float(self.initial_learning_rate * self.decay_rate**p)

    def get_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ExponentialDecay:
        return _from_config(cls, config)


@dataclasses.dataclass(frozen=True)
class PiecewiseConstantDecay:
    """``values[i]`` while ``boundaries[i-1] < step <= boundaries[i]`` (Keras convention).

    ``len(values) == len(boundaries) + 1``; boundaries strictly increasing ints.
    """

    boundaries: tuple[int, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        b, v = tuple(self.boundaries), tuple(float(x) for x in self.values)
        if any(isinstance(x, bool) or not isinstance(x, int) for x in b):
            raise TypeError(f"boundaries must be ints, got {b!r}")
        if any(b2 <= b1 for b1, b2 in itertools.pairwise(b)):
            raise ValueError(f"boundaries must be strictly increasing, got {b!r}")
        if len(v) != len(b) + 1:
            raise ValueError(
                f"values needs len(boundaries) + 1 = {len(b) + 1} entries, got {len(v)}"
            )
        if any(not (math.isfinite(x) and x >= 0) for x in v):
            raise ValueError(f"values must be finite numbers >= 0, got {v!r}")
        object.__setattr__(self, "boundaries", b)
        object.__setattr__(self, "values", v)

    def __call__(self, step: int) -> float:
        for bound, value in zip(self.boundaries, self.values):
            if step <= bound:
                return value
        return self.values[-1]

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": list(self.boundaries), "values": list(self.values)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> PiecewiseConstantDecay:
        return _from_config(cls, config)
