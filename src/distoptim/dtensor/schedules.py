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
import numbers
from typing import Any

from distoptim.checks import check_bool, check_int, check_real, check_type

__all__ = ["ExponentialDecay", "PiecewiseConstantDecay"]


def _from_config(cls: type, config: Any) -> Any:
    check_type(f"{cls.__name__}.from_config's config", config, dict, "a dict")
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
        lr = check_real("initial_learning_rate", self.initial_learning_rate, 0.0)
        rate = check_real("decay_rate", self.decay_rate, 0.0, low_open=True)
        steps = check_int("decay_steps", self.decay_steps, 1)
        check_bool("staircase", self.staircase)
        object.__setattr__(self, "initial_learning_rate", lr)
        object.__setattr__(self, "decay_rate", rate)
        object.__setattr__(self, "decay_steps", steps)

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
        b = tuple(
            int(check_type(f"boundaries[{i}]", x, numbers.Integral, "an int"))
            for i, x in enumerate(self.boundaries)
        )
        v = tuple(check_real(f"values[{i}]", x, 0.0) for i, x in enumerate(self.values))
        if any(b2 <= b1 for b1, b2 in itertools.pairwise(b)):
            raise ValueError(f"boundaries must be strictly increasing, got {b!r}")
        if len(v) != len(b) + 1:
            raise ValueError(
                f"values needs len(boundaries) + 1 = {len(b) + 1} entries, got {len(v)}"
            )
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
