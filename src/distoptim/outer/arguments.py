"""The outer family's construction checks: each argument of DiLoCo (and so LocalSGD, Streaming
DiLoCo) validated before anything is built, with an error naming what was wrong and what is
allowed. The semantics of the arguments are :mod:`distoptim.outer.diloco`'s.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import type_name
from distoptim.comm.groups import check_group_assignment

__all__ = ["check_alpha", "check_group", "check_managed", "check_same_parameters"]


def check_alpha(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(float(value))
        or not 0.0 <= float(value) <= 1.0
    ):
        raise ValueError(f"fragment_update_alpha must be a number in [0, 1], got {value!r}")
    return float(value)


def check_same_parameters(
    owner: str, params: list[torch.Tensor], outer: torch.optim.Optimizer
) -> None:
    """``outer`` must hold exactly the parameter objects of ``inner`` (any grouping, any order)."""
    outer_params = [p for g in outer.param_groups for p in g["params"]]
    mine = {id(p) for p in params}
    theirs = {id(p) for p in outer_params}
    if mine == theirs:
        return
    missing = [tuple(p.shape) for p in params if id(p) not in theirs]
    extra = [tuple(p.shape) for p in outer_params if id(p) not in mine]
    raise ValueError(
        f"{owner}: outer must be built over exactly the inner optimizer's parameters (the same "
        f"tensor objects, e.g. both from model.parameters()); outer lacks {len(missing)} "
        f"of them (shapes {missing[:5]}) and has {len(extra)} others (shapes {extra[:5]})"
    )


def check_managed(owner: str, manager: Any, group: Any) -> None:
    """A torchft manager replaces ``group`` (the replicas are its quorum's)."""
    from distoptim.ft.replicas import check_manager

    check_manager(manager, owner)
    if group is not None:
        raise ValueError(
            f"{owner}: with a torchft manager the replicas are the manager's quorum, so group "
            f"must be None (got {type_name(group)}); a manager's process group must not also "
            "be given as group="
        )


def check_group(
    group: Any,
) -> tuple[list[list[int]] | None, dist.ProcessGroup | None]:
    """``(group_assignment, None)``, ``(None, process_group)`` or ``(None, None)``."""
    if group is None:
        return None, None
    distributed = dist.is_available() and dist.is_initialized()
    if isinstance(group, dist.ProcessGroup):
        if not distributed:
            raise ValueError("group is a ProcessGroup but torch.distributed is not initialized")
        return None, group
    if not distributed:
        raise ValueError(
            "group is a group_assignment, which needs an initialized torch.distributed default "
            "group (init_process_group, torchrun or distoptim.launch.spawn)"
        )
    return check_group_assignment(group, dist.get_world_size()), None
