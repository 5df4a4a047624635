"""Argument checks every distoptim optimizer shares, and the words its error messages use.

Owns: the rules for the values a user hands a constructor -- type names in messages, integer
and positive-number arguments, and the hyperparameters of a wrapped ``torch.optim.Optimizer``
that torch itself accepts but that can only corrupt training (a NaN/Inf learning rate,
momentum, weight decay, ...). Each check raises ``TypeError`` (wrong kind of value) or
``ValueError`` (right kind, impossible value), names the argument and says what is allowed, and
changes nothing: callers run every check before their first side effect.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = [
    "check_finite_hyperparameters",
    "check_int",
    "check_positive",
    "type_name",
]


def type_name(x: object) -> str:
    """A short name of ``x``'s type for messages (``torch.FloatTensor`` for tensors)."""
    return torch.typename(x) if isinstance(x, torch.Tensor) else type(x).__name__


def check_int(name: str, value: Any, low: int) -> int:
    """``value`` as an ``int`` if it is an integer ``>= low`` (numpy integers too, not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def check_positive(name: str, value: Any, unit: str = "") -> float:
    """``value`` as a ``float`` if it is a finite real number ``> 0``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or not float(value) > 0
    ):
        what = f"a finite number > 0{f' ({unit})' if unit else ''}"
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


# Hyperparameters torch optimizers keep in their param groups that must be finite numbers when
# they are numbers (a NaN learning rate silently turns every parameter into NaN).
_NUMERIC_HYPERPARAMETERS = (
    "lr",
    "momentum",
    "dampening",
    "weight_decay",
    "alpha",
    "eps",
    "lr_decay",
    "initial_accumulator_value",
    "momentum_decay",
    "rho",
)


def check_finite_hyperparameters(opt: torch.optim.Optimizer, owner: str) -> None:
    """Raise ``ValueError`` if a param group of ``opt`` holds a non-finite hyperparameter.

    Checks the numeric hyperparameters in :data:`_NUMERIC_HYPERPARAMETERS` and each element of
    ``betas``; tensor-valued ones (torch allows a tensor ``lr``) are checked element-wise.
    ``owner`` names the wrapper in the message (e.g. ``"CrossShardOptimizer"``).
    """
    for gi, group in enumerate(opt.param_groups):
        items: list[tuple[str, Any]] = [
            (k, group[k]) for k in _NUMERIC_HYPERPARAMETERS if k in group
        ]
        betas = group.get("betas")
        if isinstance(betas, (tuple, list)):
            items += [(f"betas[{i}]", b) for i, b in enumerate(betas)]
        for key, value in items:
            if _finite(value):
                continue
            raise ValueError(
                f"{owner}: param group {gi} of the wrapped {type(opt).__name__} has "
                f"{key}={value!r}; it must be a finite number (torch accepts it, but every "
                "parameter it touches would become NaN/Inf)"
            )


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return math.isfinite(float(value))
    return True  # None and other non-numbers are torch's business
