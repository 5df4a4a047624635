"""The two option records of the mesh-aware SGD: gradient clipping and weight averaging (EMA).

Owns: :class:`GradientsClipOption` and :class:`EMAOption` -- validated on construction (so an
optimizer never holds an impossible option), immutable, and serializable to/from plain JSON
dicts (``get_config`` / ``from_config``) so that ``SGD.get_config()`` can carry them.
The math they configure lives in :mod:`distoptim.dtensor.clip` and :mod:`distoptim.dtensor.sgd`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["EMAOption", "GradientsClipOption"]


def _type_name(x: object) -> str:
    return type(x).__name__


def _check_positive(name: str, value: Any) -> float | None:
    """``None`` or a finite real number > 0 (as float); anything else is an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be None or a positive number, got {_type_name(value)}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (or None to disable), got {value!r}")
    return value


def _check_keys(cls: type, config: Any) -> dict[str, Any]:
    if not isinstance(config, dict):
        raise TypeError(f"{cls.__name__}.from_config needs a dict, got {_type_name(config)}")
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

    Applied in this order, on the full logical gradients (for a sharded DTensor every element
    is counted once; a replicated one is not counted twice):

    1. ``clipnorm``: each gradient ``g`` alone becomes ``g * clipnorm / max(||g||, clipnorm)``.
    2. ``global_clipnorm``: with ``n = sqrt(sum_i ||g_i||^2)`` over every gradient of the step
       (every group, every mesh), each becomes ``g_i * global_clipnorm / max(n, global_clipnorm)``.
    3. ``clipvalue``: every element is clamped to ``[-clipvalue, clipvalue]``.

    A non-finite norm (a gradient holding ``inf`` or ``NaN``) makes the gradients it scales
    ``NaN`` (the one tensor for ``clipnorm``, all of them for ``global_clipnorm``), as
    ``tf.clip_by_global_norm`` does: a broken gradient is never turned into a plausible finite
    update. ``clipvalue`` maps ``+-inf`` to ``+-clipvalue`` and keeps ``NaN``.

    Every value is a finite number > 0; ``clipnorm`` and ``global_clipnorm`` exclude each other.
    """

    clipnorm: float | None = None
    clipvalue: float | None = None
    global_clipnorm: float | None = None

    def __post_init__(self) -> None:
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            object.__setattr__(self, name, _check_positive(name, getattr(self, name)))
        if self.clipnorm is not None and self.global_clipnorm is not None:
            raise ValueError(
                "clipnorm and global_clipnorm cannot both be set: choose per-tensor (clipnorm) "
                "or global-norm (global_clipnorm) clipping"
            )

    @property
    def active(self) -> bool:
        """Whether any clipping is switched on."""
        return any(v is not None for v in (self.clipnorm, self.clipvalue, self.global_clipnorm))

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
    (``avg`` starts as a copy of ``w``). With ``ema_overwrite_frequency = k`` the weights are
    replaced by their averages whenever ``iterations % k == 0`` after an update.
    ``SGD.finalize_variable_values(var_list)`` writes the averages into the weights at the end.

    ``ema_momentum`` is in ``[0, 1]``; ``ema_overwrite_frequency`` is ``None`` or an int >= 1.
    """

    use_ema: bool = False
    ema_momentum: float = 0.99
    ema_overwrite_frequency: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.use_ema, bool):
            raise TypeError(f"use_ema must be a bool, got {_type_name(self.use_ema)}")
        m = self.ema_momentum
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise TypeError(f"ema_momentum must be a number in [0, 1], got {_type_name(m)}")
        if not 0.0 <= float(m) <= 1.0:  # also rejects NaN
            raise ValueError(f"ema_momentum must be in [0, 1], got {m!r}")
        object.__setattr__(self, "ema_momentum", float(m))
        f = self.ema_overwrite_frequency
        if f is not None:
            if isinstance(f, bool) or not isinstance(f, int):
                raise TypeError(
                    f"ema_overwrite_frequency must be None or an int >= 1, got {_type_name(f)}"
                )
            if f < 1:
                raise ValueError(f"ema_overwrite_frequency must be an int >= 1 or None, got {f}")

    def get_config(self) -> dict[str, Any]:
        """A JSON-serializable dict; ``from_config`` of it gives an equal option."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EMAOption:
        return cls(**_check_keys(cls, config))
