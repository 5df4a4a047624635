"""The two option records of the mesh-aware SGD: gradient clipping and weight averaging (EMA).

Owns: :class:`GradientsClipOption` and :class:`EMAOption` -- validated on construction (so an
optimizer never holds an impossible option), immutable, and serializable to/from plain JSON
dicts (``get_config`` / ``from_config``) so that ``SGD.get_config()`` can carry them.
The math they configure lives in :mod:`distoptim.dtensor.clip` and :mod:`distoptim.dtensor.ema`.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from distoptim.checks import (
    check_bool,
    check_optional_int,
    check_positive,
    check_real,
    check_type,
)

__all__ = ["EMAOption", "GradientsClipOption"]

_CLIP_ORDER = ("clipnorm", "global_clipnorm", "clipvalue")


def _check_keys(cls: type, config: Any) -> dict[str, Any]:
    check_type(f"{cls.__name__}.from_config's config", config, dict, "a dict")
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(
            f"{cls.__name__}.from_config: unknown keys {unknown}; "
            f"allowed keys are {sorted(allowed)}"
        )
    return config


@dataclasses.dataclass(frozen=True)
class GradientsClipOption:
    """How gradients are clipped before the update (each field ``None`` = off).

    As in Keras, **one** rule applies: the first option set in the order ``clipnorm``,
    ``global_clipnorm``, ``clipvalue`` (:attr:`rule`); a ``clipvalue`` given together with a
    norm option is ignored (:attr:`ignored`; ``SGD`` warns about it when constructed). Norms
    are those of the full logical gradients (for a sharded DTensor every element is counted
    once; a replicated one is not counted twice):

    * ``clipnorm``: each gradient ``g`` alone becomes ``g * clipnorm / max(||g||, clipnorm)``.
      An ``inf`` element makes ``||g||`` infinite: that element becomes ``NaN``, every finite
      one 0. A ``NaN`` element makes the whole tensor ``NaN``.
    * ``global_clipnorm``: with ``n = sqrt(sum_i ||g_i||^2)`` over every gradient of the step
      (every group, every mesh), each becomes ``g_i * global_clipnorm / max(n, global_clipnorm)``;
      a non-finite ``n`` makes every gradient ``NaN`` (``tf.clip_by_global_norm``'s rule): a
      broken gradient is never turned into a plausible finite update.
    * ``clipvalue``: every element is clamped to ``[-clipvalue, clipvalue]`` (``+-inf`` becomes
      ``+-clipvalue``, ``NaN`` stays ``NaN``).

    Every value is a finite number > 0; ``clipnorm`` and ``global_clipnorm`` exclude each other
    (Keras refuses that pair too).
    """

    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None

    def __post_init__(self) -> None:
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            value = check_type(
                name, getattr(self, name), numbers.Real, "a number > 0", optional=True
            )
            if value is not None:
                object.__setattr__(self, name, check_positive(f"{name} (None to disable)", value))
        if self.clipnorm is not None and self.global_clipnorm is not None:
            raise ValueError(
                "clipnorm and global_clipnorm cannot both be set: choose per-tensor (clipnorm) "
                "or global-norm (global_clipnorm) clipping"
            )

    @property
    def active(self) -> bool:
        """Whether any clipping is switched on."""
        return self.rule is not None

    @property
    def rule(self) -> str | None:
        """The option that is applied: the first set of clipnorm, global_clipnorm, clipvalue."""
        return next((n for n in _CLIP_ORDER if getattr(self, n) is not None), None)

    @property
    def ignored(self) -> tuple[str, ...]:
        """Options that are set but not applied because :attr:`rule` comes first."""
        return tuple(n for n in _CLIP_ORDER if getattr(self, n) is not None and n != self.rule)

    def get_config(self) -> dict[str, Any]:
        """A JSON-serializable dict; ``from_config`` of it gives an equal option."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GradientsClipOption:
        return cls(**_check_keys(cls, config))


@dataclasses.dataclass(frozen=True)
class EMAOption:
    """Exponential moving average of the weights (slot ``"average"``).

    With ``use_ema`` on, after every update ``avg = ema_momentum * avg + (1 - ema_momentum) * w``
    for each variable that got a gradient in that step (``avg`` starts as a copy of ``w``; a
    variable without a gradient keeps its average, as in Keras). With
    ``ema_overwrite_frequency = k`` those same variables are replaced by their averages whenever
    ``iterations % k == 0`` after an update (a variable without a gradient in that step is not
    overwritten). ``SGD.finalize_variable_values(var_list)`` writes the averages into the
    weights at the end.

    ``ema_momentum`` is in ``[0, 1]``; ``ema_overwrite_frequency`` is ``None`` or an int >= 1.
    """

    use_ema: bool = False
    ema_momentum: float = 0.99
    ema_overwrite_frequency: int | None = None

    def __post_init__(self) -> None:
        check_bool("use_ema", self.use_ema)
        m = check_type("ema_momentum", self.ema_momentum, numbers.Real, "a number in [0, 1]")
        object.__setattr__(self, "ema_momentum", check_real("ema_momentum", m, 0.0, 1.0))
        name, f = "ema_overwrite_frequency", self.ema_overwrite_frequency
        check_type(name, f, numbers.Integral, "an int >= 1", optional=True)
        object.__setattr__(self, name, check_optional_int(name, f, 1))

    def get_config(self) -> dict[str, Any]:
        """A JSON-serializable dict; ``from_config`` of it gives an equal option."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EMAOption:
        return cls(**_check_keys(cls, config))
