"""What the mesh-aware SGD's constructor accepts: every argument checked, then normalized.

Owns: :func:`check_arguments`, which checks all of ``SGD(...)``'s arguments before anything is
built (each error names the argument and what is allowed; nothing is created or changed by a
call that raises) and returns them normalized as :class:`Arguments`: the learning rate as a
float or a schedule, the option records built from config dicts, the param groups in torch's
form; and :data:`DEFAULT_LEARNING_RATE`, the constructor's default rate.

* ``learning_rate`` (alias ``lr=``, never both): a number >= 0, or a callable
  ``schedule(iterations) -> float`` whose ``schedule(0)`` is one.
* ``momentum`` in [0, 1]; ``nesterov``, ``amsgrad``, ``jit_compile`` bools (``amsgrad=True``
  is refused: it has no meaning for SGD).
* ``gradients_clip_option`` / ``ema_option``: the option record, its config dict, or None.
* ``params``: None (Keras style: one empty group that ``build`` fills), an iterable of
  tensors, or of param-group dicts (:func:`~distoptim.dtensor.variables.check_group`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from distoptim.checks import check_bool, check_str, check_type
from distoptim.dtensor import variables as _vars
from distoptim.dtensor.config import DEFAULT_LR, check_lr, check_momentum
from distoptim.dtensor.options import EMAOption, GradientsClipOption

__all__ = ["DEFAULT_LEARNING_RATE", "Arguments", "check_arguments"]


class _DefaultRate(float):
    """The float ``0.01`` that :data:`DEFAULT_LEARNING_RATE` is: it reads as ``0.01`` in
    ``help()``, IDEs and arithmetic, and is recognised by identity, so that the constructor
    tells "``learning_rate`` not given" (``lr=`` may stand in) from any rate a caller gives,
    ``0.01`` included. Never stored: the checked rate is a plain float."""

    __slots__ = ()


DEFAULT_LEARNING_RATE: float = _DefaultRate(DEFAULT_LR)
"""The default of ``SGD(learning_rate=...)``: 0.01, as in Keras (``lr=`` replaces it)."""


@dataclasses.dataclass(frozen=True)
class Arguments:
    """``SGD(...)``'s arguments, checked and normalized (see the module docstring).

    ``learning_rate``: the schedule, or the rate as a float; ``schedule``: the schedule or
    None; ``defaults``: torch's per-group defaults (``lr``, the schedule's ``lr`` at 0 when
    there is one, ``momentum``, ``nesterov``); ``groups``: the param groups for
    ``torch.optim.Optimizer.__init__``.
    """

    learning_rate: float | Callable[[int], float]
    schedule: Callable[[int], float] | None
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]
    clip: GradientsClipOption | None
    ema_option: EMAOption | None
    jit_compile: bool
    name: str
    mesh: DeviceMesh | None


def check_arguments(
    params: Iterable[Any] | None,
    learning_rate: float | Callable[[int], float],
    momentum: Any,
    nesterov: Any,
    amsgrad: Any,
    gradients_clip_option: GradientsClipOption | dict[str, Any] | None,
    ema_option: EMAOption | dict[str, Any] | None,
    jit_compile: Any,
    name: Any,
    mesh: Any,
    lr: float | Callable[[int], float] | None,
) -> Arguments:
    """``SGD(...)``'s arguments (same names), checked and normalized; raises ``TypeError`` or
    ``ValueError`` naming the first wrong one. Only a schedule is called (``schedule(0)``)."""
    if lr is not None and learning_rate is not DEFAULT_LEARNING_RATE:
        raise ValueError("give learning_rate or its alias lr, not both")
    if learning_rate is DEFAULT_LEARNING_RATE:
        learning_rate = lr if lr is not None else DEFAULT_LR
    schedule: Callable[[int], float] | None = None
    if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
        schedule = learning_rate
        lr0 = check_lr(schedule(0), "learning_rate schedule(0)")
    else:
        lr0 = check_lr(learning_rate)
        learning_rate = lr0
    momentum = check_momentum(momentum)
    nesterov = check_bool("nesterov", nesterov)
    if check_bool("amsgrad", amsgrad):
        raise ValueError(
            "amsgrad=True has no meaning for SGD (AMSGrad is a variant of Adam's second "
            "moment, which SGD does not keep); use torch.optim.Adam(amsgrad=True), or leave "
            "amsgrad=False"
        )
    if isinstance(gradients_clip_option, dict):
        gradients_clip_option = GradientsClipOption.from_config(gradients_clip_option)
    check_type(
        "gradients_clip_option",
        gradients_clip_option,
        GradientsClipOption,
        "a GradientsClipOption, a dict",
        optional=True,
    )
    if isinstance(ema_option, dict):
        ema_option = EMAOption.from_config(ema_option)
    check_type("ema_option", ema_option, EMAOption, "an EMAOption, a dict", optional=True)
    jit_compile = check_bool("jit_compile", jit_compile)
    check_str("name", name)
    check_type("mesh", mesh, DeviceMesh, "a DeviceMesh", optional=True)
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or param-group dicts, not a single tensor"
        )
    groups = [] if params is None else list(params)
    if not groups:  # Keras style: one empty group that build() fills
        groups = [{"params": []}]
    elif not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    for g in groups:  # every group before torch.optim.Optimizer builds anything
        _vars.check_group(g, mesh)
    return Arguments(
        learning_rate=learning_rate,
        schedule=schedule,
        defaults={"lr": lr0, "momentum": momentum, "nesterov": nesterov},
        groups=groups,
        clip=gradients_clip_option,
        ema_option=ema_option,
        jit_compile=jit_compile,
        name=name,
        mesh=mesh,
    )
