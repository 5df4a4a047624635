"""Mesh-aware SGD: Keras' ``SGD`` (momentum, Nesterov, clipping, EMA) on tensors and DTensors.

Owns: the optimizer object -- its public face (Keras' ``build``, ``add_variable``,
``add_variable_from_reference``, ``get_slot``, ``variables``; torch's ``step``,
``state_dict``/``load_state_dict``; ``get_config``/``from_config``) and the order of one step.
The rest lives next door: the constructor's checks in :mod:`~distoptim.dtensor.arguments`, what
a step plans (params, buckets, the kept plan) in :mod:`~distoptim.dtensor.plan`, slots and their
saved form in :mod:`~distoptim.dtensor.slots`, the update kernels in
:mod:`~distoptim.dtensor.kernels`, Keras' momentum in torch's buffer units in
:mod:`~distoptim.dtensor.momentum`, clipping in :mod:`~distoptim.dtensor.clip`, the weight
averages in :mod:`~distoptim.dtensor.ema`, hyperparameter checks and (de)serialization (Keras'
configs too) in :mod:`~distoptim.dtensor.config`. ``docs/mesh_sgd.md`` has the whole picture.

One step, in order
------------------
1. ``lr`` = the schedule at ``iterations`` (when ``learning_rate`` is callable), else each param
   group's ``"lr"`` (so torch LR schedulers work).
2. Every gradient is checked (kind, mesh, shape) before anything changes; a DTensor gradient
   whose placements differ from its parameter's (``Partial``, ``Replicate`` for a ``Shard(0)``
   parameter, ...) is redistributed to the parameter's placements.
3. Clipping on the local shards with mesh-correct norms (one rule: the first set of clipnorm,
   global_clipnorm, clipvalue).
4. One kernel call per bucket of local shards sharing (param group, momentum scale, dtype,
   device) -- never per-tensor DTensor dispatch. Keras' rule, ``v`` = slot ``"m"``::

       momentum == 0:  w -= lr * g
       else:           v = momentum * v - lr * g
                       w += v                          (nesterov: w += momentum * v - lr * g)

   done in one fused pass (``v`` is kept as a torch momentum buffer; ``get_slot``,
   ``variables``, ``state_dict`` and ``get_config`` show Keras' ``v``).
5. EMA, for the variables that got a gradient: ``avg = ema_momentum * avg + (1 - ema_momentum)
   * w``; then ``iterations += 1``; when ``ema_overwrite_frequency`` divides ``iterations``,
   ``w = avg`` for those same variables.

With plain tensors, the bookkeeping of steps 2 and 4 (slots, buckets, buffers, which tensors the
fused kernel may take) is kept from one step to the next and reused while everything it depends
on is unchanged -- checked every step, all tensors at once (:mod:`~distoptim.dtensor.plan` says
what is checked and why the rest cannot change unseen). With many small tensors on a GPU, that
Python work, not the kernel, is what a step costs.

``amsgrad`` has no meaning for SGD (it is an Adam variant); Keras accepted and ignored it, here
``amsgrad=True`` is a ``ValueError`` so that nobody believes it is active.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from distoptim.checks import check_type
from distoptim.dtensor import config as _config
from distoptim.dtensor import ema as _ema
from distoptim.dtensor import slots as _slots
from distoptim.dtensor import variables as _vars
from distoptim.dtensor.arguments import DEFAULT_LEARNING_RATE, check_arguments
from distoptim.dtensor.clip import clip_local_gradients
from distoptim.dtensor.config import check_lr, check_momentum
from distoptim.dtensor.kernels import CompiledUpdate
from distoptim.dtensor.layout import local_shard
from distoptim.dtensor.options import EMAOption, GradientsClipOption
from distoptim.dtensor.plan import Bucket, StepPlan, params_with_grads
from distoptim.protocol import (
    GradsAndVars,
    TFOptimizerProtocol,
    check_inner_state_dict,
    run_closure,
    swapped_grads,
)

__all__ = ["SGD"]

_CONTIGUOUS = torch.Tensor.is_contiguous


class SGD(TFOptimizerProtocol, torch.optim.Optimizer):
    """Gradient descent with momentum, Nesterov, clipping and EMA, mesh-aware (Keras' SGD).

    ``SGD(params=None, learning_rate=0.01, momentum=0.0, nesterov=False, amsgrad=False,
    gradients_clip_option=None, ema_option=None, jit_compile=False, name="SGD", mesh=None)``;
    ``lr=`` is an alias of ``learning_rate``.

    * PyTorch style: ``SGD(model.parameters(), lr=0.1)`` then ``loss.backward(); opt.step()``.
      ``params`` may be param-group dicts with their own ``lr``/``momentum``/``nesterov``.
    * Keras style: ``SGD(learning_rate=0.1)`` has no variables until ``build(var_list)``,
      ``minimize(loss, var_list)`` or ``apply_gradients(pairs)`` adopts them (into the first
      param group). ``SGD.from_config`` also takes a Keras 2 ``get_config()`` dict.

    ``learning_rate`` is a number >= 0 or a callable ``schedule(iterations) -> float``,
    evaluated before every step (it then sets every group's ``"lr"``; otherwise torch LR
    schedulers drive ``param_groups[i]["lr"]``). ``momentum`` in [0, 1]; with momentum 0 there
    is no ``"m"`` slot. ``gradients_clip_option``/``ema_option``: see
    :class:`GradientsClipOption`, :class:`EMAOption` (a config dict is accepted too).
    ``jit_compile=True`` runs the update through ``torch.compile`` (with a warning and the
    eager update if compilation is unavailable or fails). ``mesh``: when set, every variable
    must be a DTensor on exactly this mesh.

    Parameters may be plain tensors and DTensors on any meshes (slots take their parameter's
    mesh and placements). A step with DTensor gradients is collective when it redistributes or
    clips: every rank of the meshes must call it (SPMD). ``.grad`` is only read.
    """

    def __init__(
        self,
        params: Iterable[Any] | None = None,
        learning_rate: float | Callable[[int], float] = DEFAULT_LEARNING_RATE,
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
        args = check_arguments(
            params,
            learning_rate,
            momentum,
            nesterov,
            amsgrad,
            gradients_clip_option,
            ema_option,
            jit_compile,
            name,
            mesh,
            lr,
        )  # everything is checked before anything is built
        clip = args.clip
        if clip is not None and clip.ignored:
            ignored = " and ".join(clip.ignored)
            warnings.warn(
                f"gradients_clip_option sets {clip.rule} and {ignored}: as in Keras only the "
                f"first of clipnorm, global_clipnorm, clipvalue applies, so {ignored} will be "
                "ignored",
                UserWarning,
                stacklevel=2,
            )
        self._name = args.name
        self._schedule = args.schedule
        self._learning_rate = args.learning_rate
        self._clip = clip
        self._ema_option = ema = args.ema_option
        self._ema = ema if ema is not None and ema.use_ema else None
        self._mesh = args.mesh
        self._jit = args.jit_compile
        self._compiled = CompiledUpdate() if args.jit_compile else None
        self._extra_variables: list[torch.Tensor] = []
        self.iterations = 0
        self._plan: StepPlan | None = None  # kept between steps: see StepPlan
        if self._compiled is not None and self._compiled.failed:
            warnings.warn(
                "jit_compile=True but torch.compile is not supported here; "
                "SGD uses the eager update",
                RuntimeWarning,
                stacklevel=2,
            )
        torch.optim.Optimizer.__init__(self, args.groups, args.defaults)

    @property
    def _jit_failed(self) -> bool:
        """Whether ``jit_compile`` fell back to the eager update."""
        return self._compiled is not None and self._compiled.failed

    # ---- variables and slots -----------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, validated, creating the new parameters' slots."""
        _vars.check_group(param_group, self._mesh)
        super().add_param_group(param_group)
        self._plan = None
        group = self.param_groups[-1]
        for p in group["params"]:
            self._init_slots(p, group)

    def _init_slots(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        self._plan = None  # (the state may change)
        return _slots.add_missing(self.state[p], p, group["momentum"] != 0, self._ema is not None)

    def build(self, var_list: Iterable[torch.Tensor]) -> None:
        """Adopt the variables not yet owned (into the first group) and create their slots.

        Idempotent for variables already owned. Raises before changing anything.
        """
        if isinstance(var_list, torch.Tensor):
            raise TypeError("var_list must be a list of tensors, not a single tensor")
        vars_ = list(var_list)
        owned = {id(p) for p in self._all_params()}
        new = [v for v in vars_ if id(v) not in owned]
        _vars.check_vars(new, self._mesh)
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
        value = _slots.new_variable(shape, dtype, initializer, name, self._mesh)
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
        slot = _slots.slot_from_reference(self.state, model_variable, variable_name, initial_value)
        self._plan = None
        self.state[model_variable][variable_name] = slot
        return slot

    def get_slot(self, var: torch.Tensor, name: str) -> torch.Tensor | None:
        """The slot ``name`` of ``var`` or None. ``"m"`` (alias ``"momentum"``) is Keras' ``v``,
        returned as a new tensor: writing into it does not change the optimizer."""
        return _slots.read_slot(self.state.get(var, {}), name)

    def get_slot_names(self) -> list[str]:
        """Sorted names of the slots kept for at least one variable (``"m"``, ``"average"``,
        and any added with :meth:`add_variable_from_reference`)."""
        return sorted({n for st in self.state.values() for n in _slots.slot_names(st)})

    def variables(self) -> list[torch.Tensor]:
        """Every slot (parameter order, then slot-name order), then ``add_variable`` ones."""
        out = []
        for p in self._all_params():
            out.extend(self.get_slot(p, n) for n in _slots.slot_names(self.state.get(p, {})))
        return out + list(self._extra_variables)  # type: ignore[arg-type]

    # ---- TF protocol hooks --------------------------------------------------------------------
    def _accept_vars(self, vars_: Sequence[torch.Tensor]) -> None:
        # Keras style: new variables are welcome; adopted in _apply_pairs once the gradients
        # are known to be valid too (a call that raises changes nothing).
        owned = {id(p) for p in self._all_params()}
        _vars.check_vars([v for v in vars_ if id(v) not in owned], self._mesh)

    def _apply_pairs(self, pairs: GradsAndVars) -> None:
        for i, (g, v) in enumerate(pairs):
            _vars.check_grad(i, g, v)
        self._check_step_args()
        self.build([v for _, v in pairs])
        with swapped_grads(self._all_params(), pairs):  # type: ignore[arg-type]
            self.step()

    # ---- the step -----------------------------------------------------------------------------
    def _check_step_args(self) -> float | None:
        """The scheduled lr (or None); raises if any group's lr/momentum is invalid."""
        lr = None
        if self._schedule is not None:
            lr = check_lr(self._schedule(self.iterations), "learning_rate schedule")
        for g in self.param_groups:
            if lr is None:
                check_lr(float(g["lr"]), "param group lr")
            check_momentum(g["momentum"])
        return lr

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update from the parameters' ``.grad`` (params without one are skipped)."""
        loss = run_closure(closure)
        scheduled = self._check_step_args()
        ps, gs, ends = params_with_grads(self.param_groups)
        contiguous = all(map(_CONTIGUOUS, gs))
        if not contiguous:  # a sparse gradient is never contiguous: check them one by one
            _vars.check_grads(ps, gs)
        plan = self._plan
        if plan is None or not plan.fits(ps, gs, ends, self.param_groups, self.state):
            plan = None
            if contiguous:
                _vars.check_grads(ps, gs)
        # ---- nothing has changed so far; from here on the step happens --------------------
        if scheduled is not None:
            for g in self.param_groups:
                g["lr"] = scheduled
        if ps:
            if plan is None:
                plan = StepPlan.build(
                    ps, ends, self.param_groups, self.state, self._init_slots, self._ema is not None
                )
                self._plan = plan if plan.cacheable else None
            self._update(plan, gs, contiguous)
        self.iterations += 1
        if self._ema is not None and ps:
            _ema.update_averages(plan.averages, self._ema.ema_momentum)  # type: ignore[union-attr]
            every = self._ema.ema_overwrite_frequency
            if every is not None and self.iterations % every == 0:
                _ema.overwrite_with_averages(plan.averages)  # type: ignore[union-attr]
        return loss

    def _averages(self, params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, Any]]:
        state = self.state
        return [(p, state[p]["average"]) for p in params if "average" in state.get(p, ())]

    def _update(self, plan: StepPlan, gs: list[torch.Tensor], contiguous: bool) -> None:
        """The update of ``plan.params`` from their (checked) gradients ``gs``; ``contiguous``:
        whether every gradient is contiguous."""
        local_g = plan.local_grads(gs)
        contiguous = contiguous and not plan.sharded  # (a DTensor's local shard may not be)
        if self._clip is not None and self._clip.active:
            local_g = clip_local_gradients(local_g, plan.layouts, self._clip)
            contiguous = contiguous and all(map(_CONTIGUOUS, local_g))
        if type(self).update_step is not SGD.update_step:
            self._custom_updates(plan.params, local_g)
            return
        groups, buckets = self.param_groups, plan.buckets
        for b in buckets:
            group = groups[b.group]
            b.apply(
                local_g if len(buckets) == 1 else [local_g[i] for i in b.idx],
                float(group["lr"]),
                float(group["momentum"]),
                bool(group["nesterov"]),
                self._compiled,
                strided=b.strided if contiguous else None,
            )
        if self._plan is plan and not plan.buckets_distinct():
            self._plan = None  # two buckets' momentum scales met: a fresh plan merges them

    def _custom_updates(self, params: list[torch.Tensor], local_g: list[torch.Tensor]) -> None:
        """A subclass' per-variable rule: ``update_step`` gets each clipped gradient in its
        variable's layout."""
        for p, g in zip(params, local_g):
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

    def update_step(self, gradient: torch.Tensor, variable: torch.Tensor) -> None:
        """Apply the rule to one variable (no clipping, no EMA, ``iterations`` unchanged).

        Public and overridable as in Keras: a subclass that overrides it gets it called once
        per variable (with the clipped gradient, in the variable's layout) from ``step``.
        """
        gi = next(
            (i for i, g in enumerate(self.param_groups) if any(p is variable for p in g["params"])),
            None,
        )
        if gi is None:
            raise ValueError("update_step: the variable is not owned by this optimizer")
        group = self.param_groups[gi]
        _vars.check_grad(0, gradient, variable)
        lr = check_lr(self._schedule(self.iterations) if self._schedule else group["lr"])
        if isinstance(variable, DTensor) and gradient.placements != variable.placements:
            gradient = gradient.redistribute(variable.device_mesh, variable.placements)
        state = self._init_slots(variable, group)
        self._plan = None  # the variable's momentum scale moves outside any plan
        bucket = Bucket.of(
            gi,
            [0],
            [local_shard(variable)],
            [state],
            group["momentum"] != 0,
            sharded=isinstance(variable, DTensor),
        )
        with torch.no_grad():
            bucket.apply(
                [local_shard(gradient).to(variable.dtype)],
                lr,
                float(group["momentum"]),
                bool(group["nesterov"]),
                impl="single",
            )

    @torch.no_grad()
    def finalize_variable_values(self, var_list: Iterable[torch.Tensor]) -> None:
        """With EMA on, write each variable's average into it (else nothing happens)."""
        vars_ = list(var_list)
        owned = {id(p) for p in self._all_params()}
        for i, v in enumerate(vars_):
            if not isinstance(v, torch.Tensor) or id(v) not in owned:
                raise ValueError(f"var_list[{i}] is not a variable of this optimizer")
        if self._ema is not None:
            _ema.overwrite_with_averages(self._averages(vars_))

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
            check_lr(value(self.iterations), "learning_rate schedule")
            self._schedule = value
        else:
            lr = check_lr(value)
            self._schedule = None
            for g in self.param_groups:
                g["lr"] = lr
            self.defaults["lr"] = lr
            value = lr
        self._learning_rate = value

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments as a JSON-serializable dict (no variables, no state).

        A schedule is stored as ``{"class_name": "module.QualName", "config": {...}}`` and must
        offer ``get_config()`` and a classmethod ``from_config``; a plain function or lambda
        cannot be serialized (``ValueError``). A mesh is stored as its device type, rank layout
        and dim names, and rebuilt by ``from_config`` (which then needs the same process group).
        """
        return _config.to_config(
            name=self._name,
            learning_rate=(
                self._schedule if self._schedule is not None else float(self.defaults["lr"])
            ),
            momentum=float(self.defaults["momentum"]),
            nesterov=bool(self.defaults["nesterov"]),
            clip=self._clip,
            ema=self._ema_option,
            jit_compile=self._jit,
            mesh=self._mesh,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SGD:
        """The optimizer a config describes (no variables yet: Keras style).

        Takes :meth:`get_config`'s dict or a Keras 2 ``tf.keras.optimizers.SGD`` one (see
        :mod:`distoptim.dtensor.config` for the mapping and what is refused).
        """
        return cls(**_config.parse_config(config))

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"iterations"``; each momentum slot is Keras' ``v`` (``"m"``).

        The live momentum buffers are first written in Keras' units (``v`` rounds once, to the
        nearest float), so that a run restored from this dict continues bit for bit like the
        run that saved it.
        """
        self._plan = None  # the scales change
        _slots.to_keras_units(self.state.values())
        sd = super().state_dict()
        sd["state"] = _slots.saved_entries(sd["state"])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s dict. Everything is checked before anything changes."""
        check_type("state_dict", state_dict, dict, "a dict")
        sd = {k: v for k, v in state_dict.items() if k != "iterations"}
        check_inner_state_dict(self, sd)
        for i, group in enumerate(sd["param_groups"]):
            try:
                _vars.check_group({**group, "params": []}, None)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"state_dict param group {i}: {exc}") from None
        internal = _slots.loaded_entries(sd["state"], self._all_params())
        # ---- checked (iterations: by the base class, before it loads anything) -------------
        self._plan = None  # new state dicts and param groups
        super().load_state_dict({**state_dict, "state": internal})

    def __repr__(self) -> str:
        return (
            f"SGD(name={self._name!r}, learning_rate={self._learning_rate!r}, "
            f"momentum={self.defaults['momentum']}, nesterov={self.defaults['nesterov']}, "
            f"clip={self._clip}, ema={self._ema_option}, jit_compile={self._jit}, "
            f"variables={len(self._all_params())})"
        )
