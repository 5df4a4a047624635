"""The optimizer variables of the mesh-aware SGD besides the weights: slots, extra variables,
and their saved form.

Owns: what one variable's optimizer state holds and how it reads from outside -- creating the
slots a variable lacks (:func:`add_missing`), the public slot names (:func:`slot_names`: the
momentum buffer shows as Keras' ``"m"``, alias ``"momentum"``), reading a slot in Keras' units
(:func:`read_slot`), a slot made from a reference variable (:func:`slot_from_reference`), a free
optimizer variable (:func:`new_variable`), and the per-variable entries of a state dict
(:func:`saved_entries`, :func:`loaded_entries`).

Invariants
----------
* A variable's state holds its slots (tensors laid out like the variable: same shape, dtype,
  device, mesh and placements) and, with momentum, the internal pair
  :data:`~distoptim.dtensor.momentum.BUFFER` / :data:`~distoptim.dtensor.momentum.SCALE`
  (Keras' ``v = scale * buffer``). The internal keys are never slots and never saved.
* Saved (and loaded), the momentum slot is Keras' ``v`` under ``"m"``: a state dict reads the
  same whatever scale the live buffers had.
* Every function that takes user input checks all of it before it creates or changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from distoptim.checks import check_int, check_type
from distoptim.dtensor import momentum as _momentum
from distoptim.dtensor import variables as _vars
from distoptim.dtensor.layout import local_shard

__all__ = [
    "MOMENTUM_SLOTS",
    "add_missing",
    "loaded_entries",
    "new_variable",
    "read_slot",
    "saved_entries",
    "slot_from_reference",
    "slot_names",
    "to_keras_units",
]

MOMENTUM_SLOTS = ("m", "momentum")
"""The names of the momentum slot: Keras 2 calls it ``"m"``, Keras 3 ``"momentum"``."""
_INTERNAL = _momentum.INTERNAL_KEYS


def add_missing(
    state: dict[str, Any], p: torch.Tensor, momentum: bool, average: bool
) -> dict[str, Any]:
    """Create in ``state`` (``p``'s) the slots it lacks: the momentum buffer when ``momentum``
    (zeros, scale 0: never stepped, ``v = 0``), the ``"average"`` (a copy of ``p``) when
    ``average``. Returns ``state``."""
    if momentum and _momentum.BUFFER not in state:
        state[_momentum.BUFFER] = _vars.make_slot(p)
        state[_momentum.SCALE] = 0.0  # a buffer never stepped: v = 0
    if average and "average" not in state:
        state["average"] = _vars.make_slot(p, p)
    return state


def slot_names(state: dict[str, Any]) -> list[str]:
    """The public slot names of one variable's state (the buffer shows as ``"m"``), sorted."""
    names = {k for k, v in state.items() if isinstance(v, torch.Tensor) and k not in _INTERNAL}
    if _momentum.BUFFER in state:
        names.add("m")
    return sorted(names)


def read_slot(state: dict[str, Any], name: str) -> torch.Tensor | None:
    """The slot ``name`` of one variable's state, or None. ``"m"`` (alias ``"momentum"``) is
    Keras' ``v``, returned as a new tensor: writing into it does not change the optimizer."""
    if name in MOMENTUM_SLOTS and _momentum.BUFFER in state:
        return _momentum.velocity(state[_momentum.BUFFER], state[_momentum.SCALE])
    value = state.get(name) if name not in _INTERNAL else None
    return value if isinstance(value, torch.Tensor) else None


def new_variable(
    shape: Sequence[int],
    dtype: torch.dtype | None,
    initializer: str | float | Callable[..., torch.Tensor],
    name: str | None,
    mesh: DeviceMesh | None,
) -> torch.Tensor:
    """A new optimizer variable of ``shape`` and ``dtype`` (None: torch's default dtype):
    ``initializer`` is ``"zeros"``, ``"ones"``, a number, or ``fn(shape, dtype) -> tensor``.
    With a ``mesh`` it is a DTensor replicated on the mesh. ``name`` is only checked."""
    check_type("shape", shape, (list, tuple, torch.Size), "a sequence of ints >= 0")
    shape = tuple(check_int(f"shape[{i}]", s, 0) for i, s in enumerate(shape))
    check_type("dtype", dtype, torch.dtype, "a torch.dtype", optional=True)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    check_type("name", name, str, "a str", optional=True)
    if initializer == "zeros":
        value = torch.zeros(shape, dtype=dtype)
    elif initializer == "ones":
        value = torch.ones(shape, dtype=dtype)
    elif isinstance(initializer, (int, float)) and not isinstance(initializer, bool):
        value = torch.full(shape, float(initializer), dtype=dtype)
    elif callable(initializer):
        value = initializer(tuple(shape), dtype)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            raise ValueError(f"initializer must return a tensor of shape {tuple(shape)}")
    else:
        raise ValueError(
            f"initializer must be 'zeros', 'ones', a number or a callable, got {initializer!r}"
        )
    if mesh is not None:
        device = torch.device(mesh.device_type)
        value = distribute_tensor(value.to(device), mesh, [Replicate()] * mesh.ndim)
    return value


def slot_from_reference(
    states: Mapping[torch.Tensor, dict[str, Any]],
    model_variable: torch.Tensor,
    variable_name: str,
    initial_value: torch.Tensor | None,
) -> torch.Tensor:
    """A new slot ``variable_name`` for ``model_variable`` (whose state ``states`` may hold;
    the name must be free there): same shape, dtype, device and layout (mesh and placements)
    as the variable, zeros or a copy of ``initial_value`` (redistributed or distributed to
    the variable's layout). The caller stores it; nothing is changed here."""
    check_type("model_variable", model_variable, torch.Tensor, "a tensor")
    if not isinstance(variable_name, str) or not variable_name:
        raise TypeError("variable_name must be a non-empty str")
    if variable_name in _INTERNAL:
        raise ValueError(f"slot name {variable_name!r} is reserved by SGD")
    if variable_name in slot_names(states.get(model_variable, {})):
        raise ValueError(f"slot {variable_name!r} already exists for this variable")
    check_type("initial_value", initial_value, torch.Tensor, "a tensor", optional=True)
    if initial_value is not None:
        if tuple(initial_value.shape) != tuple(model_variable.shape):
            raise ValueError(
                f"initial_value has shape {tuple(initial_value.shape)}, the variable "
                f"{tuple(model_variable.shape)}"
            )
        if isinstance(model_variable, DTensor):
            if isinstance(initial_value, DTensor):
                initial_value = initial_value.redistribute(
                    model_variable.device_mesh, model_variable.placements
                )
            else:
                initial_value = distribute_tensor(
                    initial_value.to(model_variable.device),
                    model_variable.device_mesh,
                    model_variable.placements,
                )
        initial_value = initial_value.to(dtype=model_variable.dtype, device=model_variable.device)
    return _vars.make_slot(model_variable, initial_value)


@torch.no_grad()
def to_keras_units(states: Iterable[dict[str, Any]]) -> None:
    """Write every live momentum buffer of ``states`` in Keras' units, in place: scale -1, so
    ``buffer = -v`` (``v`` rounds once, to the nearest float). The step goes on from there
    exactly as from any scale."""
    for state in states:
        scale = state.get(_momentum.SCALE)
        if scale is not None and scale != -1.0:
            local_shard(state[_momentum.BUFFER]).mul_(-scale)
            state[_momentum.SCALE] = -1.0


def saved_entries(states: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The per-parameter entries of a state dict from torch's (``state_dict()["state"]``,
    buffers already in Keras' units by :func:`to_keras_units`): the internal keys dropped and
    the momentum shown as Keras' ``v`` under ``"m"``."""
    public = {}
    for key, state in states.items():
        entry = {k: v for k, v in state.items() if k not in _INTERNAL}
        if _momentum.BUFFER in state:
            entry["m"] = torch.neg(state[_momentum.BUFFER])  # v = -1 * buffer
        public[key] = entry
    return public


def loaded_entries(
    states: dict[Any, Any], params: Sequence[torch.Tensor]
) -> dict[int, dict[str, Any]]:
    """The inverse of :func:`saved_entries`, checked: each key a parameter index, each entry
    slots laid out like its parameter (:func:`~distoptim.dtensor.variables.check_saved_state`),
    ``"m"``/``"momentum"`` turned back into a buffer in Keras' units (scale -1)."""
    internal = {}
    for key, state in states.items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(params):
            raise ValueError(
                f"state_dict['state'] key {key!r} is not a parameter index in [0, {len(params)})"
            )
        _vars.check_saved_state(key, state, params[key])
        entry = {k: v for k, v in state.items() if k not in MOMENTUM_SLOTS}
        v = state.get("m", state.get("momentum"))
        if v is not None:
            entry[_momentum.BUFFER] = torch.neg(v)  # v = -1 * buffer
            entry[_momentum.SCALE] = -1.0
        internal[key] = entry
    return internal
