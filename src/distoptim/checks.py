"""Argument checks every distoptim optimizer shares, and the words its error messages use.

Owns: the rules for the values a user hands a constructor -- type names in messages, the kind
of a value (:func:`check_type`), integers, bools, strings and choices among strings, bounded
real numbers, durations, paths, and the hyperparameters of a wrapped ``torch.optim.Optimizer``
that torch itself accepts but that can only corrupt training (a NaN/Inf learning rate,
momentum, weight decay, ...). Each check raises ``TypeError`` (wrong kind of value) or
``ValueError`` (right kind, impossible value), names the argument and says what is allowed, and
changes nothing: callers run every check before their first side effect.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable
from typing import Any

import torch

__all__ = [
    "MAX_BUCKET_CAP_MB",
    "check_bool",
    "check_bucket_cap_mb",
    "check_choice",
    "check_cross_group",
    "check_finite_hyperparameters",
    "check_int",
    "check_managed_shards",
    "check_optional_int",
    "check_path",
    "check_positive",
    "check_real",
    "check_seconds",
    "check_str",
    "check_type",
    "type_name",
]


def type_name(x: object) -> str:
    """A short name of ``x``'s type for messages (``torch.FloatTensor`` for tensors)."""
    return torch.typename(x) if isinstance(x, torch.Tensor) else type(x).__name__


def check_type(
    name: str,
    value: Any,
    kind: type | tuple[type, ...],
    expected: str,
    *,
    optional: bool = False,
) -> Any:
    """``value`` if it is an instance of ``kind`` (or ``None`` when ``optional``).

    Otherwise ``TypeError``: "``{name} must be {expected}[ or None], got {type}``" --
    ``expected`` says what is allowed in words (``"a DeviceMesh"``, ``"a number in [0, 1]"``).
    A bool is not a number here: it passes only where ``kind`` names ``bool`` itself. Pair it
    with a range check (:func:`check_real`, :func:`check_int`) where wrong kinds must be
    ``TypeError`` and impossible values ``ValueError``.
    """
    if value is None and optional:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
        return value
    allowed = f"{expected} or None" if optional else expected
    raise TypeError(f"{name} must be {allowed}, got {type_name(value)}")


def check_int(name: str, value: Any, low: int) -> int:
    """``value`` as an ``int`` if it is an integer ``>= low`` (numpy integers too, not bools)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(value)


def check_optional_int(name: str, value: Any, low: int) -> int | None:
    """``None``, or ``value`` as an ``int`` if it is an integer ``>= low`` (not a bool)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise ValueError(f"{name} must be None or an int >= {low}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0/1, not a numpy bool): ``TypeError``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_str(name: str, value: Any) -> str:
    """``value`` if it is a ``str``; ``TypeError`` naming its type otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type_name(value)}")
    return value


def check_choice(name: str, value: Any, allowed: Iterable[str], *, fold_case: bool = True) -> str:
    """``value`` (lower-cased when ``fold_case``) if it is one of the strings ``allowed``.

    ``TypeError`` for a non-string, ``ValueError`` for an unknown string; both list what is
    allowed.
    """
    options = list(allowed)
    listed = ", ".join(map(repr, options))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {listed}, got {type_name(value)} {value!r}")
    key = value.lower() if fold_case else value
    if key not in options:
        raise ValueError(f"unknown {name} {value!r}: allowed values are {listed}")
    return key


def check_real(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """``value`` as a ``float`` if it is a finite real number in the given interval.

    ``low``/``high`` bound it (``None``: unbounded on that side), closed unless ``low_open`` /
    ``high_open``. Bools are refused (``True`` is not a number here); NaN and +-Inf always are.
    """
    ok = (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(float(value))
    )
    if ok:
        x = float(value)
        ok = (low is None or (x > low if low_open else x >= low)) and (
            high is None or (x < high if high_open else x <= high)
        )
    if ok:
        return float(value)
    if low is not None and high is not None:
        where = f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        where = f" {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        where = f" {'<' if high_open else '<='} {high:g}"
    else:
        where = ""
    raise ValueError(f"{name} must be a finite number{where}, got {value!r}")


MAX_BUCKET_CAP_MB = float(1 << 20)
"""The largest ``bucket_cap_mb`` accepted: 1 TiB (one bucket per dtype and device beyond any
real model; larger values only overflow the byte count)."""


def check_bucket_cap_mb(value: Any) -> float:
    """``bucket_cap_mb`` (every bucketed optimizer's) as a float in ``(0, MAX_BUCKET_CAP_MB]``."""
    try:
        return check_real("bucket_cap_mb", value, 0.0, MAX_BUCKET_CAP_MB, low_open=True)
    except ValueError:
        raise ValueError(
            f"bucket_cap_mb must be a finite number of MiB in (0, {MAX_BUCKET_CAP_MB:.0f}] "
            f"(at most 1 TiB per bucket), got {value!r}"
        ) from None


def check_seconds(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """A duration in seconds: a finite number ``> 0`` (``>= 0`` with ``allow_zero``)."""
    if not allow_zero:
        return check_positive(name, value, "seconds")
    try:
        return check_real(name, value, 0.0)
    except ValueError:
        raise ValueError(f"{name} must be a finite number >= 0 (seconds), got {value!r}") from None


def check_path(name: str, value: Any, *, optional: bool = False) -> str | None:
    """``value`` as a ``str`` path if it is a ``str`` or ``os.PathLike`` (or None if optional)."""
    if value is None and optional:
        return None
    if not isinstance(value, (str, os.PathLike)):
        allowed = "a path (str or os.PathLike)" + (" or None" if optional else "")
        raise TypeError(f"{name} must be {allowed}, got {type_name(value)}")
    return os.fspath(value)  # type: ignore[return-value]


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


def check_cross_group(
    owner: str,
    params: Iterable[torch.Tensor],
    replicas: list[int] | None,
    refused: dict[str, bool],
) -> None:
    """Parameters that are ``DTensor``s (a replica group of several processes, each holding
    its piece) are averaged only with their counterparts in other groups.

    ``replicas``: the global ranks this process would average with (``None``: not in a process
    group); ``refused``: options that cannot be combined with ``DTensor`` parameters, by name,
    ``True`` where given. Raises ``ValueError`` (parameters mixed, meshes over different ranks,
    a channel that holds another piece of this process's own model, a refused option); changes
    nothing.
    """
    from distoptim.local_shards import sharded_ranks

    params = list(params)
    ranks = sharded_ranks(owner, params)
    if ranks is None:
        return
    given = [name for name, on in refused.items() if on]
    if given:
        raise ValueError(
            f"{owner}: the parameters are DTensors (a model sharded over ranks {list(ranks)}), "
            f"which {', '.join(given)} does not support yet; allowed with DTensor parameters: "
            "the default apply path (packed .grad, overlap=False, max_grad_norm=) over group=, "
            "group_assignment= or a torchft manager="
        )
    if replicas is None:
        return
    import torch.distributed as dist

    me = dist.get_rank()
    shared = sorted((set(ranks) & set(replicas)) - {me})
    if shared:
        raise ValueError(
            f"{owner}: rank {me} would average its shard of the model with ranks {shared}, "
            f"which hold other pieces of the same model (its parameters are DTensors over ranks "
            f"{list(ranks)}): averaging them mixes different parameters. Pass the cross-group "
            "channel -- this process and its counterpart in every other replica group: "
            "group=mesh with mesh_dim_names=('replicate', 'shard') and the model sharded over "
            "mesh['shard'], group=<that ProcessGroup>, or a group_assignment like "
            "[[0, 2], [1, 3]] for 2 groups of 2 processes"
        )


def check_managed_shards(
    owner: str, params: Iterable[torch.Tensor], group_assignment: Any, group_size: int
) -> tuple[int, ...] | None:
    """``DTensor`` parameters under a torchft manager whose replica group has ``group_size``
    processes (the Manager's ``world_size``): the manager averages each shard with its
    counterparts in the other groups, so the group must be the processes the parameters'
    meshes cover, and no ``group_assignment`` (a channel inside the group) may be given.

    Returns the global ranks of the group's shards (``None``: plain parameters, nothing
    checked). Raises ``ValueError``; changes nothing.
    """
    from distoptim.local_shards import sharded_ranks

    ranks = sharded_ranks(owner, list(params))
    if ranks is None:
        return None
    if group_assignment is not None:
        raise ValueError(
            f"{owner}: the parameters are DTensors (a model sharded over ranks {list(ranks)}) "
            "and a torchft manager= averages each shard with its counterparts in the other "
            "replica groups; group_assignment= (a channel inside the group) cannot be "
            "combined with it: drop group_assignment="
        )
    if group_size != len(ranks):
        raise ValueError(
            f"{owner}: the parameters are DTensors over {len(ranks)} processes (ranks "
            f"{list(ranks)}), but this torchft replica group has {group_size} process(es) (the "
            "Manager's world_size): build each process's Manager with the group's replica_id, "
            "its rank in the group and world_size = the processes the model is sharded over "
            "(fully_shard(model, mesh=<the group's mesh>), not a mesh across the groups)"
        )
    return ranks
