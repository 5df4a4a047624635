"""The outer family's construction checks: each argument of DiLoCo (and so LocalSGD, Streaming
DiLoCo) validated before anything is built, with an error naming what was wrong and what is
allowed (:func:`check_arguments`, which returns them checked as :class:`DiLoCoArguments`). The
semantics of the arguments are :mod:`distoptim.outer.diloco`'s; the replica group's layout
(local shards, ``model=``, a ``DeviceMesh`` as ``group=``) is :mod:`distoptim.outer.groups`'.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import (
    check_bool,
    check_bucket_cap_mb,
    check_finite_hyperparameters,
    check_int,
    type_name,
)
from distoptim.comm.groups import check_group_assignment
from distoptim.comm.wire import Format, parse_wire
from distoptim.outer.groups import (
    GroupLayout,
    check_disjoint,
    check_manager_layout,
    group_layout,
    resolve_group,
)

__all__ = [
    "DiLoCoArguments",
    "check_alpha",
    "check_arguments",
    "check_group",
    "check_managed",
    "check_same_parameters",
]


@dataclass(frozen=True)
class DiLoCoArguments:
    """DiLoCo's arguments once checked (nothing built yet)."""

    sync_every: int
    fragments: int
    delay: int
    alpha: float
    wire: Format
    error_feedback: bool
    cap_mb: float
    params: list[torch.Tensor]
    assignment: list[list[int]] | None
    group: dist.ProcessGroup | None
    layout: GroupLayout


def check_arguments(
    owner: str,
    inner: Any,
    outer: Any,
    group: Any,
    manager: Any,
    model: Any,
    **options: Any,
) -> DiLoCoArguments:
    """Every argument of ``DiLoCo`` checked, before any side effect (subgroup creation is
    collective). ``options``: ``sync_every``, ``fragments``, ``fragment_sync_delay``,
    ``fragment_update_alpha``, ``wire``, ``error_feedback``, ``bucket_cap_mb`` as given."""
    if manager is not None:
        check_managed(owner, manager, group)
    for arg, value in (("inner", inner), ("outer", outer)):
        if not isinstance(value, torch.optim.Optimizer):
            raise TypeError(
                f"{owner}: {arg} must be a torch.optim.Optimizer, got {type_name(value)}"
            )
    if outer is inner:
        raise ValueError(
            f"{owner}: outer must be a separate optimizer over the same parameters as "
            "inner (its state is the global copy's), not the inner optimizer itself"
        )
    sync_every = check_int("sync_every", options["sync_every"], 1)
    fragments = check_int("fragments", options["fragments"], 1)
    delay = check_int("fragment_sync_delay", options["fragment_sync_delay"], 0)
    alpha = check_alpha(options["fragment_update_alpha"])
    wire_format = parse_wire(options["wire"])
    error_feedback = check_bool("error_feedback", options["error_feedback"])
    cap = check_bucket_cap_mb(options["bucket_cap_mb"])
    params = [p for g in inner.param_groups for p in g["params"]]
    check_same_parameters(owner, params, outer)
    if fragments > len(params):
        raise ValueError(
            f"fragments={fragments} is more than the {len(params)} parameters of the inner "
            "optimizer: every fragment needs at least one parameter"
        )
    if sync_every % fragments:
        raise ValueError(
            f"sync_every={sync_every} must be divisible by fragments={fragments} (fragments "
            "sync in turn, one every sync_every/fragments inner steps)"
        )
    if delay >= sync_every // fragments:
        raise ValueError(
            f"fragment_sync_delay={delay} must be < sync_every/fragments = "
            f"{sync_every // fragments}: a fragment's sync must be applied before the next "
            "fragment's starts"
        )
    check_finite_hyperparameters(inner, owner)
    check_finite_hyperparameters(outer, owner)
    assignment, group_obj = check_group(resolve_group(owner, group))
    layout = group_layout(owner, params, inner, model)
    if manager is not None:
        check_manager_layout(owner, layout, manager)
    else:
        check_disjoint(owner, layout, _replica_ranks(assignment, group_obj))
    return DiLoCoArguments(
        sync_every,
        fragments,
        delay,
        alpha,
        wire_format,
        error_feedback,
        cap,
        params,
        assignment,
        group_obj,
        layout,
    )


def _replica_ranks(
    assignment: list[list[int]] | None, group: dist.ProcessGroup | None
) -> list[int] | None:
    """The global ranks this process averages with (itself included); None outside a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is not None:
        return dist.get_process_group_ranks(group)
    if assignment is not None:
        me = dist.get_rank()
        return next(g for g in assignment if me in g)
    return list(range(dist.get_world_size()))


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
