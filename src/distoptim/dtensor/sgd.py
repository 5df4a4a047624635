"""Mesh-aware SGD: the Keras DTensor ``SGD`` (momentum, Nesterov, clipping, EMA) on DTensor.

Owns: the update rule, its slots (``"m"`` momentum, ``"average"`` EMA), the layout-grouped
foreach update on local shards, the ``torch.compile`` path, and Keras' variable/config API
(``build``, ``add_variable``, ``add_variable_from_reference``, ``update_step``,
``finalize_variable_values``, ``get_config``/``from_config``).

One step, in order
------------------
1. ``lr`` = the schedule at ``iterations`` (when ``learning_rate`` is callable), else each param
   group's ``"lr"`` (so torch LR schedulers work).
2. Every gradient is checked (kind, mesh, shape) before anything changes; a DTensor gradient
   whose placements differ from its parameter's (``Partial``, ``Replicate`` for a ``Shard(0)``
   parameter, ...) is redistributed to the parameter's placements.
3. Clipping (:mod:`distoptim.dtensor.clip`) on the local shards with mesh-correct norms.
4. One update per bucket of local shards sharing (param group, mesh, placements, dtype,
   device) -- never per-tensor DTensor dispatch: torch's fused multi-tensor SGD kernel on CPU
   and CUDA (see :func:`_fused_update` for how the Keras form maps onto it), ``torch._foreach_*``
   elsewhere, or the ``torch.compile``-fused body with ``jit_compile=True``. Keras form,
   ``v`` = slot ``"m"``::

       momentum == 0:  w -= lr * g
       else:           v = momentum * v - lr * g
                       w += v                          (nesterov: w += momentum * v - lr * g)

5. EMA: ``avg = ema_momentum * avg + (1 - ema_momentum) * w`` for every variable; then
   ``iterations += 1``; when ``ema_overwrite_frequency`` divides ``iterations``, ``w = avg``.

``amsgrad`` has no meaning for SGD (it is an Adam variant); Keras accepted and ignored it, here
``amsgrad=True`` is a ``ValueError`` so that nobody believes it is active.
"""

from __future__ import annotations

import importlib
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from distoptim.dtensor.clip import Layout, clip_local_gradients
from distoptim.dtensor.options import EMAOption, GradientsClipOption
from distoptim.protocol import GradsAndVars, TFOptimizerProtocol, swapped_grads

__all__ = ["SGD"]

_UNSET: Any = object()
_DEFAULT_LR = 0.01
_CONFIG_KEYS = (
    "name",
    "learning_rate",
    "momentum",
    "nesterov",
    "amsgrad",
    "gradients_clip_option",
    "ema_option",
    "jit_compile",
    "mesh",
)


def _type_name(x: object) -> str:
    return torch.typename(x) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_lr(value: Any, what: str = "learning_rate") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{what} must be a number >= 0 or a callable schedule of iterations, "
            f"got {_type_name(value)}"
        )
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


def _check_momentum(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"momentum must be a number in [0, 1], got {_type_name(value)}")
    if not 0.0 <= float(value) <= 1.0:  # also rejects NaN
        raise ValueError(f"momentum must be in [0, 1], got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {_type_name(value)}")
    return value


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), collectives completed."""
    if not isinstance(t, DTensor):
        return t
    loc = t._local_tensor
    wait = getattr(loc, "wait", None)  # AsyncCollectiveTensor from a redistribute
    if wait is not None and callable(wait) and type(loc) is not torch.Tensor:
        loc = wait()
    return loc


def _layout(t: torch.Tensor) -> Layout:
    return (t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else None


# --------------------------------------------------------------------------------------------
# the update math (eager foreach, and the body torch.compile fuses)
# --------------------------------------------------------------------------------------------
def _foreach_update(
    ws: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor] | None,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> None:
    """In place: Keras SGD on lists of same-device, same-dtype local tensors."""
    if ms is None:
        torch._foreach_add_(ws, gs, alpha=-lr)
        return
    torch._foreach_mul_(ms, momentum)
    torch._foreach_add_(ms, gs, alpha=-lr)
    if nesterov:
        torch._foreach_add_(ws, ms, alpha=momentum)
        torch._foreach_add_(ws, gs, alpha=-lr)
    else:
        torch._foreach_add_(ws, ms)


_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fused_update(
    ws: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor] | None,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> None:
    """The same math with torch's fused SGD kernel (one pass per call, CPU and CUDA).

    ``torch._fused_sgd_`` computes ``buf = mu*buf + (1 - dampening)*g; w -= lr_t*buf``
    (no Nesterov, no weight decay). With ``dampening = 1 + lr`` the first line is exactly
    Keras' ``v = mu*v - lr*g`` on the slot itself, and ``lr_t = -1`` gives ``w += v``.
    Nesterov ``w += mu*v - lr*g`` is two calls: ``w -= lr*g`` (no buffer), then the buffer
    call with ``lr_t = -mu``. Memory traffic: 20 B/element (fp32) without Nesterov, 32 with --
    against 44 for the four foreach passes.
    """
    kw = {"weight_decay": 0.0, "nesterov": False, "maximize": False, "is_first_step": False}
    if ms is None or nesterov:
        torch._fused_sgd_(ws, gs, [], momentum=0.0, lr=lr, dampening=0.0, **kw)
    if ms is not None:
        torch._fused_sgd_(
            ws,
            gs,
            ms,
            momentum=momentum,
            lr=-momentum if nesterov else -1.0,
            dampening=1.0 + lr,
            **kw,
        )


def _jit_body(
    ws: list[torch.Tensor],
    gs: list[torch.Tensor],
    ms: list[torch.Tensor],
    lr: torch.Tensor,
    momentum: float,
    nesterov: bool,
) -> None:
    """The same math for ``torch.compile``, which fuses it per tensor (read w, g, v; write w,
    v: 20 bytes per fp32 element). ``lr`` is a 0-dim tensor so that a schedule does not
    recompile; foreach ops keep the traced graph small for hundreds of tensors."""
    steps = torch._foreach_mul(gs, lr)
    if not ms:
        torch._foreach_sub_(ws, steps)
        return
    torch._foreach_mul_(ms, momentum)
    torch._foreach_sub_(ms, steps)
    if nesterov:
        torch._foreach_add_(ws, torch._foreach_sub(torch._foreach_mul(ms, momentum), steps))
    else:
        torch._foreach_add_(ws, ms)


class SGD(TFOptimizerProtocol, torch.optim.Optimizer):
    """Gradient descent with momentum, Nesterov, clipping and EMA, mesh-aware (Keras' DTensor SGD).

    ``SGD(params=None, learning_rate=0.01, momentum=0.0, nesterov=False, amsgrad=False,
    gradients_clip_option=None, ema_option=None, jit_compile=False, name="SGD", mesh=None)``;
    ``lr=`` is an alias of ``learning_rate``.

    * PyTorch style: ``SGD(model.parameters(), lr=0.1)`` then ``loss.backward(); opt.step()``.
      ``params`` may be param-group dicts with their own ``lr``/``momentum``/``nesterov``.
    * Keras style: ``SGD(learning_rate=0.1)`` has no variables until ``build(var_list)``,
      ``minimize(loss, var_list)`` or ``apply_gradients(pairs)`` adopts them (into the first
      param group).

    ``learning_rate`` is a number >= 0 or a callable ``schedule(iterations) -> float``,
    evaluated before every step (it then sets every group's ``"lr"``; otherwise torch LR
    schedulers drive ``param_groups[i]["lr"]``). ``momentum`` in [0, 1]; with momentum 0 there
    is no ``"m"`` slot. ``gradients_clip_option``/``ema_option``: see
    :class:`GradientsClipOption`, :class:`EMAOption` (a config dict is accepted too).
    ``jit_compile=True`` runs the update through ``torch.compile`` (with a warning and the
    eager foreach path if compilation is unavailable or fails). ``mesh``: when set, every
    variable must be a DTensor on exactly this mesh.

    Parameters may be plain tensors and DTensors on any meshes (slots take their parameter's
    mesh and placements). A step with DTensor gradients is collective when it redistributes or
    clips: every rank of the meshes must call it (SPMD).
    """

    def __init__(
        self,
        params: Iterable[Any] | None = None,
        learning_rate: float | Callable[[int], float] = _UNSET,
        momentum: float = 0.0,
        nesterov: bool = False,
        amsgrad: bool = False,
        gradients_clip_option: GradientsClipOption | dict[str, Any] | None = None,
        ema_option: EMAOption | dict[str, Any] | None = None,
        jit_compile: bool = False,
        name: str = "SGD",
        mesh: DeviceMesh | None = None,
        *,
        lr: float | Callable[[int], float] | None = None,
    ) -> None:
        # ---- validate everything first --------------------------------------------------------
        if lr is not None and learning_rate is not _UNSET:
            raise ValueError("give learning_rate or its alias lr, not both")
        if learning_rate is _UNSET:
            learning_rate = lr if lr is not None else _DEFAULT_LR
        schedule: Callable[[int], float] | None = None
        if callable(learning_rate) and not isinstance(learning_rate, torch.Tensor):
            schedule = learning_rate
            lr0 = _check_lr(schedule(0), "learning_rate schedule(0)")
        else:
            lr0 = _check_lr(learning_rate)
        momentum = _check_momentum(momentum)
        nesterov = _check_bool("nesterov", nesterov)
        if _check_bool("amsgrad", amsgrad):
            raise ValueError(
                "amsgrad=True has no meaning for SGD (AMSGrad is a variant of Adam's second "
                "moment, which SGD does not keep); use torch.optim.Adam(amsgrad=True), or leave "
                "amsgrad=False"
            )
        if isinstance(gradients_clip_option, dict):
            gradients_clip_option = GradientsClipOption.from_config(gradients_clip_option)
        if gradients_clip_option is not None and not isinstance(
            gradients_clip_option, GradientsClipOption
        ):
            raise TypeError(
                "gradients_clip_option must be a GradientsClipOption, a dict or None, got "
                f"{_type_name(gradients_clip_option)}"
            )
        if isinstance(ema_option, dict):
            ema_option = EMAOption.from_config(ema_option)
        if ema_option is not None and not isinstance(ema_option, EMAOption):
            raise TypeError(
                f"ema_option must be an EMAOption, a dict or None, got {_type_name(ema_option)}"
            )
        jit_compile = _check_bool("jit_compile", jit_compile)
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {_type_name(name)}")
        if mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a DeviceMesh or None, got {_type_name(mesh)}")
        if isinstance(params, torch.Tensor):
            raise TypeError(
                "params must be an iterable of tensors or param-group dicts, not a single tensor"
            )

        self._name = name
        self._schedule = schedule
        self._learning_rate = learning_rate
        self._clip = gradients_clip_option
        self._ema = ema_option if ema_option is not None and ema_option.use_ema else None
        self._ema_option = ema_option
        self._mesh = mesh
        self._jit = jit_compile
        self._jit_fn: Callable[..., Any] | None = None
        self._jit_failed = False
        self._lr_tensors: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._extra_variables: list[torch.Tensor] = []
        self.iterations = 0
        if jit_compile and not self._dynamo_supported():
            warnings.warn(
                "jit_compile=True but torch.compile is not supported here; "
                "SGD uses the eager foreach update",
                RuntimeWarning,
                stacklevel=2,
            )
            self._jit_failed = True

        defaults = {"lr": lr0, "momentum": momentum, "nesterov": nesterov}
        groups = [] if params is None else list(params)
        if not groups:  # Keras style: one empty group that build() fills
            groups = [{"params": []}]
        elif not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        # Validate every group before torch.optim.Optimizer builds anything.
        for g in groups:
            self._check_group(g, defaults)
        torch.optim.Optimizer.__init__(self, groups, defaults)

    # ---- validation --------------------------------------------------------------------------
    @staticmethod
    def _dynamo_supported() -> bool:
        try:
            import torch._dynamo

            return bool(torch._dynamo.is_dynamo_supported())
        except Exception:
            return False

    def _check_group(self, group: Any, defaults: dict[str, Any]) -> None:
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError("a param group must be a dict with a 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._check_new_vars(params)
        allowed = {"params", "lr", "momentum", "nesterov", "initial_lr", "name"}
        unknown = sorted(set(group) - allowed)
        if unknown:
            raise ValueError(
                f"unknown param group keys {unknown}; SGD groups take {sorted(allowed)}"
            )
        if "lr" in group:
            _check_lr(group["lr"], "param group lr")
        if "momentum" in group:
            _check_momentum(group["momentum"])
        if "nesterov" in group:
            _check_bool("nesterov", group["nesterov"])

    def _check_new_vars(self, vars_: Sequence[Any]) -> None:
        """Each var must be a floating-point leaf tensor the mesh rule admits."""
        seen: set[int] = set()
        for i, v in enumerate(vars_):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"variable {i} must be a torch.Tensor, got {_type_name(v)}")
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
                if self._mesh is not None and v.device_mesh != self._mesh:
                    raise ValueError(
                        f"variable {i} is on mesh {v.device_mesh}, but this SGD was given "
                        f"mesh={self._mesh}: every variable must live on that mesh"
                    )
            elif self._mesh is not None:
                raise ValueError(
                    f"variable {i} is a plain tensor, but this SGD was given mesh={self._mesh}: "
                    "distribute it first (torch.distributed.tensor.distribute_tensor)"
                )

    def _check_grad(self, i: int, g: Any, p: torch.Tensor) -> None:
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"gradient {i} must be a torch.Tensor, got {_type_name(g)}")
        if g.is_sparse:
            raise TypeError(f"gradient {i} is sparse: SGD takes dense gradients only")
        if isinstance(p, DTensor) != isinstance(g, DTensor):
            kind = "a DTensor" if isinstance(p, DTensor) else "a plain tensor"
            raise TypeError(
                f"gradient {i} must be {kind} like its variable, got {_type_name(g)}"
                + (" (DTensor)" if isinstance(g, DTensor) else "")
            )
        if tuple(g.shape) != tuple(p.shape):
            raise ValueError(
                f"gradient {i} has shape {tuple(g.shape)}, its variable {tuple(p.shape)}"
            )
        if isinstance(p, DTensor) and g.device_mesh != p.device_mesh:
            raise ValueError(
                f"gradient {i} is on mesh {g.device_mesh}, its variable on {p.device_mesh}"
            )

    # ---- variables and slots -----------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, validated, creating the new parameters' slots."""
        self._check_group(param_group, self.defaults)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            self._init_slots(p, group)

    def _init_slots(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if group["momentum"] != 0 and "m" not in state:
            state["m"] = self._make_slot(p)
        if self._ema is not None and "average" not in state:
            state["average"] = self._make_slot(p, p)

    @staticmethod
    def _make_slot(ref: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor with ``ref``'s shape, dtype, device and (for DTensor) mesh and placements."""
        with torch.no_grad():
            if initial is None:
                return torch.zeros_like(ref, memory_format=torch.preserve_format).detach()
            return initial.detach().clone(memory_format=torch.preserve_format)

    def build(self, var_list: Iterable[torch.Tensor]) -> None:
        """Adopt the variables not yet owned (into the first group) and create their slots.

        Idempotent for variables already owned. Raises before changing anything.
        """
        if isinstance(var_list, torch.Tensor):
            raise TypeError("var_list must be a list of tensors, not a single tensor")
        vars_ = list(var_list)
        owned = {id(p) for p in self._all_params()}
        new = [v for v in vars_ if id(v) not in owned]
        self._check_new_vars(new)
        for i, v in enumerate(new):
            if not v.is_leaf:
                raise ValueError(f"variable {i} is not a leaf tensor: SGD can only update leaves")
        if not new:
            return
        group = self.param_groups[0]
        group["params"].extend(new)
        for v in new:
            self._init_slots(v, group)

    def add_variable(
        self,
        shape: Sequence[int],
        dtype: torch.dtype | None = None,
        initializer: str | float | Callable[..., torch.Tensor] = "zeros",
        name: str | None = None,
    ) -> torch.Tensor:
        """A new optimizer variable (kept in :meth:`variables`): ``initializer`` is ``"zeros"``,
        ``"ones"``, a number, or ``fn(shape, dtype) -> tensor``. With ``mesh`` set it is a
        DTensor replicated on the mesh."""
        if isinstance(shape, torch.Size):
            shape = tuple(shape)
        if not isinstance(shape, (list, tuple)) or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape
        ):
            raise TypeError(f"shape must be a sequence of ints >= 0, got {shape!r}")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {_type_name(dtype)}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {_type_name(name)}")
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
        if self._mesh is not None:
            device = torch.device(self._mesh.device_type)
            value = distribute_tensor(value.to(device), self._mesh, [Replicate()] * self._mesh.ndim)
        self._extra_variables.append(value)
        return value

    def add_variable_from_reference(
        self,
        model_variable: torch.Tensor,
        variable_name: str,
        initial_value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A slot ``variable_name`` for ``model_variable``: same shape, dtype, device and layout
        (mesh and placements), zeros or a copy of ``initial_value``; ``get_slot`` finds it."""
        if not isinstance(model_variable, torch.Tensor):
            raise TypeError(f"model_variable must be a tensor, got {_type_name(model_variable)}")
        if not isinstance(variable_name, str) or not variable_name:
            raise TypeError("variable_name must be a non-empty str")
        if variable_name in self.state.get(model_variable, {}):
            raise ValueError(f"slot {variable_name!r} already exists for this variable")
        if initial_value is not None:
            if not isinstance(initial_value, torch.Tensor):
                raise TypeError(
                    f"initial_value must be a tensor or None, got {_type_name(initial_value)}"
                )
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
            initial_value = initial_value.to(
                dtype=model_variable.dtype, device=model_variable.device
            )
        slot = self._make_slot(model_variable, initial_value)
        self.state[model_variable][variable_name] = slot
        return slot

    def variables(self) -> list[torch.Tensor]:
        """Every slot (parameter order, then slot-name order), then ``add_variable`` ones."""
        return super().variables() + list(self._extra_variables)

    # ---- TF protocol hooks --------------------------------------------------------------------
    def _accept_vars(self, vars_: Sequence[torch.Tensor]) -> None:
        # Keras style: new variables are welcome; adopted in _apply_pairs once the gradients
        # are known to be valid too (a call that raises changes nothing).
        owned = {id(p) for p in self._all_params()}
        self._check_new_vars([v for v in vars_ if id(v) not in owned])

    def _apply_pairs(self, pairs: GradsAndVars) -> None:
        for i, (g, v) in enumerate(pairs):
            self._check_grad(i, g, v)
        self._check_step_args()
        self.build([v for _, v in pairs])
        with swapped_grads(self._all_params(), pairs):  # type: ignore[arg-type]
            self.step()

    # ---- the step -----------------------------------------------------------------------------
    def _check_step_args(self) -> float | None:
        """The scheduled lr (or None); raises if any group's lr/momentum is invalid."""
        lr = None
        if self._schedule is not None:
            lr = _check_lr(self._schedule(self.iterations), "learning_rate schedule")
        for g in self.param_groups:
            if lr is None:
                _check_lr(float(g["lr"]), "param group lr")
            _check_momentum(g["momentum"])
        return lr

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update from the parameters' ``.grad`` (params without one are skipped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scheduled = self._check_step_args()
        items: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    self._check_grad(len(items), p.grad, p)
                    items.append((gi, p, p.grad))
        # ---- nothing has changed so far; from here on the step happens --------------------
        if scheduled is not None:
            for g in self.param_groups:
                g["lr"] = scheduled
        if items:
            self._update(items)
        if self._ema is not None:
            self._apply_ema()
        self.iterations += 1
        if (
            self._ema is not None
            and self._ema.ema_overwrite_frequency is not None
            and self.iterations % self._ema.ema_overwrite_frequency == 0
        ):
            self._overwrite_with_average(self._all_params())
        return loss

    def _update(self, items: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        local_w, local_g, layouts = [], [], []
        for _, p, g in items:
            if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                g = g.redistribute(p.device_mesh, p.placements)
            if g.dtype != p.dtype:
                g = g.to(p.dtype)
            local_w.append(_local(p))
            local_g.append(_local(g))
            layouts.append(_layout(p))
        local_g = clip_local_gradients(local_g, layouts, self._clip)
        custom = type(self).update_step is not SGD.update_step
        buckets: dict[tuple[Any, ...], list[int]] = {}
        for i, (gi, p, _) in enumerate(items):
            group = self.param_groups[gi]
            self._init_slots(p, group)  # a group whose momentum became > 0 later
            if custom:
                continue
            lay = layouts[i]
            key = (
                gi,
                None if lay is None else id(lay[0]),
                None if lay is None else lay[1],
                local_w[i].dtype,
                local_w[i].device,
            )
            buckets.setdefault(key, []).append(i)
        if custom:  # a subclass' per-variable rule; it receives the clipped local gradients
            for i, (_, p, _) in enumerate(items):
                g = local_g[i]
                if isinstance(p, DTensor):
                    g = DTensor.from_local(
                        g,
                        p.device_mesh,
                        p.placements,
                        run_check=False,
                        shape=p.shape,
                        stride=p.stride(),
                    )
                self.update_step(g, p)
            return
        for key, idx in buckets.items():
            group = self.param_groups[key[0]]
            mom = float(group["momentum"])
            ms = [_local(self.state[items[i][1]]["m"]) for i in idx] if mom != 0 else None
            self._run_update(
                [local_w[i] for i in idx],
                [local_g[i] for i in idx],
                ms,
                float(group["lr"]),
                mom,
                bool(group["nesterov"]),
            )

    def _run_update(
        self,
        ws: list[torch.Tensor],
        gs: list[torch.Tensor],
        ms: list[torch.Tensor] | None,
        lr: float,
        momentum: float,
        nesterov: bool,
    ) -> None:
        if self._jit and not self._jit_failed:
            if self._jit_fn is None:
                self._jit_fn = torch.compile(_jit_body, dynamic=False, fullgraph=True)
            key = (ws[0].device, ws[0].dtype)
            lr_t = self._lr_tensors.get(key)
            if lr_t is None:
                lr_dtype = torch.float64 if ws[0].dtype == torch.float64 else torch.float32
                lr_t = self._lr_tensors[key] = torch.empty((), dtype=lr_dtype, device=key[0])
            lr_t.fill_(lr)
            try:
                self._jit_fn(ws, gs, ms or [], lr_t, momentum, nesterov)
                return
            except Exception as exc:  # compile failure: compilation runs before any kernel
                self._jit_failed = True
                warnings.warn(
                    f"jit_compile: torch.compile failed ({type(exc).__name__}: {exc}); "
                    "SGD falls back to the eager foreach update",
                    RuntimeWarning,
                    stacklevel=4,
                )
        if ws[0].device.type not in _FUSED_DEVICES or ws[0].dtype not in _FUSED_DTYPES:
            _foreach_update(ws, gs, ms, lr, momentum, nesterov)
            return
        # The fused kernel walks raw memory: it is only right for contiguous tensors (a
        # transposed parameter with a contiguous gradient would be updated elementwise wrong).
        # Anything else takes the stride-aware foreach path.
        odd = [
            i
            for i in range(len(ws))
            if not (
                ws[i].is_contiguous()
                and gs[i].is_contiguous()
                and (ms is None or ms[i].is_contiguous())
            )
        ]
        if not odd:
            _fused_update(ws, gs, ms, lr, momentum, nesterov)
            return
        skip = set(odd)
        keep = [i for i in range(len(ws)) if i not in skip]
        for idx, fn in ((keep, _fused_update), (odd, _foreach_update)):
            if idx:
                fn(
                    [ws[i] for i in idx],
                    [gs[i] for i in idx],
                    None if ms is None else [ms[i] for i in idx],
                    lr,
                    momentum,
                    nesterov,
                )

    def update_step(self, gradient: torch.Tensor, variable: torch.Tensor) -> None:
        """Apply the rule to one variable (no clipping, no EMA, ``iterations`` unchanged).

        Public and overridable as in Keras: a subclass that overrides it gets it called once
        per variable (with the clipped gradient, in the variable's layout) from ``step``.
        """
        group = next(
            (g for g in self.param_groups if any(p is variable for p in g["params"])), None
        )
        if group is None:
            raise ValueError("update_step: the variable is not owned by this optimizer")
        self._check_grad(0, gradient, variable)
        if isinstance(variable, DTensor) and gradient.placements != variable.placements:
            gradient = gradient.redistribute(variable.device_mesh, variable.placements)
        lr = self._schedule(self.iterations) if self._schedule else float(group["lr"])
        self._init_slots(variable, group)
        mom = float(group["momentum"])
        with torch.no_grad():
            ms = [_local(self.state[variable]["m"])] if mom != 0 else None
            _foreach_update(
                [_local(variable)],
                [_local(gradient).to(variable.dtype)],
                ms,
                float(lr),
                mom,
                bool(group["nesterov"]),
            )

    # ---- EMA ----------------------------------------------------------------------------------
    def _ema_pairs(self, var_list: Iterable[torch.Tensor]) -> dict[Any, tuple[list, list]]:
        buckets: dict[Any, tuple[list, list]] = {}
        for p in var_list:
            avg = self.state.get(p, {}).get("average")
            if avg is None:
                continue
            w = _local(p)
            ws, avgs = buckets.setdefault((w.device, w.dtype), ([], []))
            ws.append(w)
            avgs.append(_local(avg))
        return buckets

    def _apply_ema(self) -> None:
        weight = 1.0 - self._ema.ema_momentum  # type: ignore[union-attr]
        for ws, avgs in self._ema_pairs(self._all_params()).values():
            torch._foreach_lerp_(avgs, ws, weight)  # avg + (1-mu)(w - avg)

    def _overwrite_with_average(self, var_list: Iterable[torch.Tensor]) -> None:
        for ws, avgs in self._ema_pairs(var_list).values():
            torch._foreach_copy_(ws, avgs)

    @torch.no_grad()
    def finalize_variable_values(self, var_list: Iterable[torch.Tensor]) -> None:
        """With EMA on, write each variable's average into it (else nothing happens)."""
        vars_ = list(var_list)
        owned = {id(p) for p in self._all_params()}
        for i, v in enumerate(vars_):
            if not isinstance(v, torch.Tensor) or id(v) not in owned:
                raise ValueError(f"var_list[{i}] is not a variable of this optimizer")
        if self._ema is not None:
            self._overwrite_with_average(vars_)

    # ---- config -------------------------------------------------------------------------------
    @property
    def learning_rate(self) -> float | Callable[[int], float]:
        """The schedule, or the first group's current ``lr``."""
        if self._schedule is not None:
            return self._schedule
        return float(self.param_groups[0]["lr"])

    @learning_rate.setter
    def learning_rate(self, value: float | Callable[[int], float]) -> None:
        """Keras' ``opt.learning_rate = x``: a number sets every group's ``lr``; a callable
        becomes the schedule. ``get_config`` reports the new value."""
        if callable(value) and not isinstance(value, torch.Tensor):
            _check_lr(value(self.iterations), "learning_rate schedule")
            self._schedule = value
        else:
            lr = _check_lr(value)
            self._schedule = None
            for g in self.param_groups:
                g["lr"] = lr
            self.defaults["lr"] = lr
        self._learning_rate = value

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments as a JSON-serializable dict (no variables, no state).

        A schedule is stored as ``{"class_name": "module.QualName", "config": {...}}`` and must
        offer ``get_config()`` and a classmethod ``from_config``; a plain function or lambda
        cannot be serialized (``ValueError``). A mesh is stored as its device type, rank layout
        and dim names, and rebuilt by ``from_config`` (which then needs the same process group).
        """
        lr: Any = self._learning_rate
        if self._schedule is not None:
            sched = self._schedule
            if not (hasattr(sched, "get_config") and hasattr(type(sched), "from_config")):
                raise ValueError(
                    f"learning_rate is a {type(sched).__name__} without get_config/from_config: "
                    "it cannot be serialized; use a schedule from distoptim.dtensor.schedules "
                    "or give yours get_config() and a from_config classmethod"
                )
            cls = type(sched)
            lr = {
                "class_name": f"{cls.__module__}.{cls.__qualname__}",
                "config": sched.get_config(),
            }
        else:
            lr = float(self.defaults["lr"])
        mesh = None
        if self._mesh is not None:
            mesh = {
                "device_type": self._mesh.device_type,
                "mesh": self._mesh.mesh.tolist(),
                "mesh_dim_names": (
                    list(self._mesh.mesh_dim_names) if self._mesh.mesh_dim_names else None
                ),
            }
        return {
            "name": self._name,
            "learning_rate": lr,
            "momentum": float(self.defaults["momentum"]),
            "nesterov": bool(self.defaults["nesterov"]),
            "amsgrad": False,
            "gradients_clip_option": None if self._clip is None else self._clip.get_config(),
            "ema_option": None if self._ema_option is None else self._ema_option.get_config(),
            "jit_compile": self._jit,
            "mesh": mesh,
        }

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SGD:
        """The optimizer ``get_config`` described (no variables yet: Keras style)."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {_type_name(config)}")
        unknown = sorted(set(config) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; allowed: {list(_CONFIG_KEYS)}")
        kwargs = dict(config)
        lr = kwargs.get("learning_rate", _DEFAULT_LR)
        if isinstance(lr, dict):
            kwargs["learning_rate"] = _schedule_from_config(lr)
        mesh = kwargs.get("mesh")
        if isinstance(mesh, dict):
            kwargs["mesh"] = _mesh_from_config(mesh)
        elif mesh is not None and not isinstance(mesh, DeviceMesh):
            raise TypeError(f"config['mesh'] must be a dict or None, got {_type_name(mesh)}")
        return cls(**kwargs)

    # ---- state --------------------------------------------------------------------------------
    def __repr__(self) -> str:
        return (
            f"SGD(name={self._name!r}, learning_rate={self._learning_rate!r}, "
            f"momentum={self.defaults['momentum']}, nesterov={self.defaults['nesterov']}, "
            f"clip={self._clip}, ema={self._ema_option}, jit_compile={self._jit}, "
            f"variables={len(self._all_params())})"
        )


def _schedule_from_config(spec: dict[str, Any]) -> Callable[[int], float]:
    if set(spec) != {"class_name", "config"} or not isinstance(spec["class_name"], str):
        raise ValueError(
            "a serialized learning_rate schedule is {'class_name': 'module.Class', 'config': {...}}"
        )
    module_name, _, qualname = spec["class_name"].rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot find schedule class {spec['class_name']!r}: {exc}") from exc
    if not (isinstance(obj, type) and callable(getattr(obj, "from_config", None))):
        raise ValueError(f"{spec['class_name']!r} is not a class with a from_config classmethod")
    return obj.from_config(spec["config"])


def _mesh_from_config(spec: dict[str, Any]) -> DeviceMesh:
    allowed = {"device_type", "mesh", "mesh_dim_names"}
    if set(spec) - allowed or "device_type" not in spec or "mesh" not in spec:
        raise ValueError(f"config['mesh'] must have keys {sorted(allowed)}, got {sorted(spec)}")
    names = spec.get("mesh_dim_names")
    return DeviceMesh(
        spec["device_type"],
        torch.tensor(spec["mesh"], dtype=torch.int64),
        mesh_dim_names=tuple(names) if names else None,
    )
