"""What the mesh-aware SGD accepts as variables, gradients, param groups and saved slots.

Owns: the checks :class:`~distoptim.dtensor.sgd.SGD` runs before it changes anything (each
raises ``TypeError``/``ValueError`` naming the offending item and what is allowed), and
:func:`make_slot`, which makes a slot in its variable's layout.

* A variable is a floating-point tensor, given once; a DTensor variable is ``Shard`` or
  ``Replicate`` on every mesh dimension (never ``Partial``); with the optimizer's ``mesh`` set,
  every variable is a DTensor on exactly that mesh.
* A gradient is a dense tensor of its variable's shape, a DTensor exactly when the variable is
  one, on the variable's mesh (any placements: the step redistributes).
* A param group is a dict with ``params`` and only ``lr``, ``momentum``, ``nesterov``,
  ``initial_lr``, ``name`` besides.
* A saved slot (a state dict's per-parameter entry) is a tensor of its parameter's shape, a
  DTensor exactly when the parameter is one; the optimizer's internal keys never appear.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial

from distoptim.checks import check_bool, check_type, type_name
from distoptim.dtensor.config import check_lr, check_momentum
from distoptim.dtensor.momentum import INTERNAL_KEYS

__all__ = [
    "GROUP_KEYS",
    "check_grad",
    "check_grads",
    "check_group",
    "check_saved_state",
    "check_vars",
    "make_slot",
]

GROUP_KEYS = frozenset({"params", "lr", "momentum", "nesterov", "initial_lr", "name"})
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})  # types that are never a DTensor


def check_group(group: Any, mesh: DeviceMesh | None) -> None:
    """A param group: its variables (:func:`check_vars`), its keys and hyperparameters."""
    if not isinstance(group, dict) or "params" not in group:
        raise TypeError("a param group must be a dict with a 'params' entry")
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    check_vars(params, mesh)
    unknown = sorted(set(group) - GROUP_KEYS)
    if unknown:
        raise ValueError(
            f"unknown param group keys {unknown}; SGD groups take {sorted(GROUP_KEYS)}"
        )
    if "lr" in group:
        check_lr(group["lr"], "param group lr")
    if "momentum" in group:
        check_momentum(group["momentum"])
    if "nesterov" in group:
        check_bool("nesterov", group["nesterov"])


def check_vars(vars_: Sequence[Any], mesh: DeviceMesh | None) -> None:
    """Each var must be a floating-point tensor the mesh rule admits, each given once."""
    seen: set[int] = set()
    for i, v in enumerate(vars_):
        check_type(f"variable {i}", v, torch.Tensor, "a torch.Tensor")
        if not v.is_floating_point():
            raise TypeError(
                f"variable {i} has dtype {v.dtype}: SGD updates floating-point tensors only"
            )
        if id(v) in seen:
            raise ValueError(f"variable {i} appears twice in the list")
        seen.add(id(v))
        if isinstance(v, DTensor):
            if any(isinstance(p, Partial) for p in v.placements):
                raise ValueError(
                    f"variable {i} has Partial placements {v.placements}: a parameter must "
                    "be Shard or Replicate on each mesh dimension"
                )
            if mesh is not None and v.device_mesh != mesh:
                raise ValueError(
                    f"variable {i} is on mesh {v.device_mesh}, but this SGD was given "
                    f"mesh={mesh}: every variable must live on that mesh"
                )
        elif mesh is not None:
            raise ValueError(
                f"variable {i} is a plain tensor, but this SGD was given mesh={mesh}: "
                "distribute it first (torch.distributed.tensor.distribute_tensor)"
            )


def check_grad(i: int, g: Any, p: torch.Tensor) -> None:
    """Gradient ``i`` for variable ``p``: dense, same kind (DTensor or not), shape and mesh."""
    if type(g) is torch.Tensor and type(p) in _PLAIN:  # the common case, quickly
        if g.is_sparse:
            raise TypeError(f"gradient {i} is sparse: SGD takes dense gradients only")
        if g.shape != p.shape:
            raise ValueError(
                f"gradient {i} has shape {tuple(g.shape)}, its variable {tuple(p.shape)}"
            )
        return
    check_type(f"gradient {i}", g, torch.Tensor, "a torch.Tensor")
    if g.is_sparse:
        raise TypeError(f"gradient {i} is sparse: SGD takes dense gradients only")
    p_dt = isinstance(p, DTensor)
    if p_dt != isinstance(g, DTensor):
        kind = "a DTensor" if p_dt else "a plain tensor"
        raise TypeError(
            f"gradient {i} must be {kind} like its variable, got {type_name(g)}"
            + (" (DTensor)" if not p_dt else "")
        )
    if g.shape != p.shape:
        raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, its variable {tuple(p.shape)}")
    if p_dt and g.device_mesh is not p.device_mesh and g.device_mesh != p.device_mesh:
        raise ValueError(
            f"gradient {i} is on mesh {g.device_mesh}, its variable on {p.device_mesh}"
        )


def check_grads(params: Sequence[torch.Tensor], grads: Sequence[Any]) -> None:
    """:func:`check_grad` for each ``(grads[i], params[i])``, numbered ``i``."""
    for i, (p, g) in enumerate(zip(params, grads)):
        check_grad(i, g, p)


def check_saved_state(i: int, state: Any, p: torch.Tensor) -> None:
    """One parameter's entry of a state dict: slot tensors shaped (and laid out) like ``p``."""
    check_type(f"state_dict['state'][{i}]", state, dict, "a dict")
    for name, value in state.items():
        where = f"state_dict['state'][{i}][{name!r}]"
        if name in INTERNAL_KEYS:
            raise ValueError(f"{where}: {name!r} is internal to SGD and never in a state dict")
        check_type(where, value, torch.Tensor, "a tensor (a slot)")
        if value.shape != p.shape:
            raise ValueError(
                f"{where} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}"
            )
        if isinstance(value, DTensor) != isinstance(p, DTensor):
            kind = "a DTensor" if isinstance(p, DTensor) else "a plain tensor"
            raise TypeError(f"{where} must be {kind} like its parameter")
    if "m" in state and "momentum" in state:
        raise ValueError(f"state_dict['state'][{i}] has both 'm' and its alias 'momentum'")


def make_slot(ref: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor with ``ref``'s shape, dtype, device and (for DTensor) mesh and placements."""
    with torch.no_grad():
        if initial is None:
            return torch.zeros_like(ref, memory_format=torch.preserve_format).detach()
        return initial.detach().clone(memory_format=torch.preserve_format)
