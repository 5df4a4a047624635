"""The TF-style optimizer protocol, written once over ``torch.optim.Optimizer``.

Owns: ``compute_gradients`` / ``apply_gradients`` / ``minimize``, the slot accessors
(``get_slot``, ``get_slot_names``, ``variables``), ``get_name``, the ``iterations`` counter
(kept in ``state_dict``) and the ``GATE_*`` constants; plus :class:`WrappedOptimizer`, the base
of every optimizer that wraps another one (CrossShard, AGN, the baselines).

Invariants
----------
* Every distoptim optimizer *is* a ``torch.optim.Optimizer``: ``step(closure)``, ``zero_grad``,
  ``param_groups``, ``state_dict``/``load_state_dict`` and torch LR schedulers work on it.
* ``compute_gradients`` never touches ``.grad`` and never changes a parameter.
* ``apply_gradients`` applies exactly the given pairs: it swaps the pairs' gradients into
  ``.grad`` for the duration of one ``step()`` and puts every ``.grad`` back afterwards, so
  gradients a user accumulated with ``backward()`` survive a TF-style call.
* A call that raises has changed nothing: every argument is validated before any mutation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from distoptim.checks import check_int, check_type
from distoptim.checks import type_name as _type_name

Loss = torch.Tensor | Callable[[], torch.Tensor]
GradsAndVars = list[tuple[torch.Tensor | None, torch.Tensor]]

__all__ = [
    "GradsAndVars",
    "TFOptimizerProtocol",
    "WrappedOptimizer",
    "check_inner_state_dict",
    "is_step_count",
    "run_closure",
]


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """``closure()`` with gradients enabled (``step`` may run under ``no_grad``), or None.

    ``torch.optim`` optimizers evaluate a ``step(closure)``'s closure this way; every distoptim
    ``step`` does the same before it touches ``.grad``.
    """
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _resolve_loss(loss: Loss) -> torch.Tensor:
    """Evaluate a callable loss and check that the result is a differentiable scalar."""
    if callable(loss) and not isinstance(loss, torch.Tensor):
        loss = run_closure(loss)
    check_type(
        "loss",
        loss,
        torch.Tensor,
        "a scalar torch.Tensor or a zero-argument callable returning one",
    )
    if loss.numel() != 1:
        raise ValueError(
            f"loss must be a scalar (one element), got a tensor of shape {tuple(loss.shape)}; "
            "reduce it first, e.g. loss.mean() or loss.sum()"
        )
    if not loss.requires_grad:
        raise ValueError(
            "loss does not require grad: it was not computed from any parameter that "
            "requires grad (or was computed under torch.no_grad())"
        )
    return loss


def _check_var_list(var_list: Iterable[Any]) -> list[torch.Tensor]:
    if isinstance(var_list, torch.Tensor):
        raise TypeError("var_list must be a list or tuple of tensors, not a single tensor")
    vars_ = list(var_list)
    for i, v in enumerate(vars_):
        check_type(f"var_list[{i}]", v, torch.Tensor, "a torch.Tensor")
    if not vars_:
        raise ValueError("var_list is empty: give at least one tensor to differentiate")
    return vars_


def _check_pairs(grads_and_vars: Iterable[Any]) -> GradsAndVars:
    if isinstance(grads_and_vars, torch.Tensor) or not isinstance(grads_and_vars, Iterable):
        raise TypeError(
            "grads_and_vars must be an iterable of (grad, var) pairs, "
            f"got {_type_name(grads_and_vars)}"
        )
    pairs: GradsAndVars = []
    for i, pair in enumerate(grads_and_vars):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(
                f"grads_and_vars[{i}] must be a (grad, var) pair, got {_type_name(pair)}"
            )
        g, v = pair
        check_type(f"grads_and_vars[{i}]: var", v, torch.Tensor, "a torch.Tensor")
        check_type(f"grads_and_vars[{i}]: grad", g, torch.Tensor, "a torch.Tensor", optional=True)
        if g is not None and g.shape != v.shape:
            raise ValueError(
                f"grads_and_vars[{i}]: grad shape {tuple(g.shape)} does not match "
                f"var shape {tuple(v.shape)}"
            )
        pairs.append((g, v))
    return pairs


def _check_global_step(global_step: Any) -> None:
    if global_step is None:
        return
    if (
        not isinstance(global_step, torch.Tensor)
        or global_step.dim() != 0
        or global_step.dtype.is_floating_point
        or global_step.dtype.is_complex
        or global_step.dtype == torch.bool
    ):
        raise TypeError(
            "global_step must be None or a 0-dim integer tensor (e.g. torch.tensor(0)), "
            f"got {_type_name(global_step)}"
            + (
                f" of shape {tuple(global_step.shape)} and dtype {global_step.dtype}"
                if isinstance(global_step, torch.Tensor)
                else ""
            )
        )


@contextlib.contextmanager
def swapped_grads(
    params: Iterable[torch.Tensor], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[None]:
    """Within the block, ``.grad`` of ``params`` is the pair's grad, or None if not in ``pairs``.

    Every ``.grad`` is restored on exit (also on error). The given gradient tensors are put in
    place as they are (no copy); code inside the block that must not modify the caller's tensors
    copies them itself.
    """
    params = list(params)
    saved = [p.grad for p in params]
    by_id = {id(v): g for g, v in pairs}
    try:
        for p in params:
            g = by_id.get(id(p))
            p.grad = None if g is None else g.to(dtype=p.dtype, device=p.device)
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


class TFOptimizerProtocol:
    """The TF ``Optimizer`` methods, mixed into a ``torch.optim.Optimizer``.

    The semantics are TF 1.x's ``tf.compat.v1.train.Optimizer`` in eager mode; see
    ``docs/protocol.md`` for the exact contract of each method.

    Subclasses are ``torch.optim.Optimizer`` subclasses whose ``step()`` increments
    ``self.iterations`` once per applied update. Hooks a subclass may override:

    * ``_scale_loss(loss)``: the loss actually differentiated by ``compute_gradients``
      (CrossShardOptimizer scales it by ``1/num_shards``).
    * ``_accept_vars(vars)``: called by ``apply_gradients`` before anything changes, with the
      vars of the pairs; the default requires each var to be one of this optimizer's parameters
      (Keras-style optimizers override it to adopt new variables).
    * ``_apply_pairs(pairs)``: perform one update from the (non-None) pairs; the default swaps
      them into ``.grad`` and calls ``step()``.
    * ``_slot_state()``: the ``{param: {slot_name: tensor}}`` mapping slots are read from.
    """

    GATE_NONE = 0
    GATE_OP = 1
    GATE_GRAPH = 2

    iterations: int
    _name: str

    # ---- parameters -------------------------------------------------------------------------
    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]

    def get_name(self) -> str:
        """The ``name`` given at construction."""
        return self._name

    # ---- gradients ----------------------------------------------------------------------------
    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def compute_gradients(
        self,
        loss: Loss,
        var_list: Sequence[torch.Tensor] | None = None,
        grad_loss: torch.Tensor | None = None,
        gate_gradients: int = GATE_OP,
        aggregation_method: Any = None,
        colocate_gradients_with_ops: bool = False,
        *,
        retain_graph: bool | None = None,
    ) -> GradsAndVars:
        """Gradients of ``loss`` with respect to ``var_list``, as ``[(grad, var), ...]``.

        ``loss`` is a scalar tensor with a graph, or a zero-argument callable returning one.
        ``var_list`` defaults to every parameter of the optimizer. A var the loss does not
        reach (or that does not require grad) gets ``None``. ``grad_loss`` is the gradient fed
        into ``loss`` (``d(something)/d(loss)``, default 1). Neither ``.grad`` nor any parameter
        is changed. ``gate_gradients``, ``aggregation_method`` and
        ``colocate_gradients_with_ops`` are accepted and ignored, as in TF's eager mode.
        ``retain_graph`` is passed to ``torch.autograd.grad`` (keep the graph for a second call).
        """
        if var_list is None:
            vars_ = self._all_params()
            if not vars_:
                raise ValueError(
                    f"{type(self).__name__} has no parameters yet: pass var_list explicitly"
                )
        else:
            vars_ = _check_var_list(var_list)
        check_type("grad_loss", grad_loss, torch.Tensor, "a tensor", optional=True)
        loss_t = _resolve_loss(loss)
        if grad_loss is not None and grad_loss.numel() != 1:
            raise ValueError(
                f"grad_loss must have one element like loss, got shape {tuple(grad_loss.shape)}"
            )
        loss_t = self._scale_loss(loss_t)
        wanted = [i for i, v in enumerate(vars_) if v.requires_grad]
        grads: list[torch.Tensor | None] = [None] * len(vars_)
        if wanted:
            outs = torch.autograd.grad(
                loss_t,
                [vars_[i] for i in wanted],
                grad_outputs=None if grad_loss is None else grad_loss.reshape(loss_t.shape),
                retain_graph=retain_graph,
                allow_unused=True,
            )
            for i, g in zip(wanted, outs):
                grads[i] = g
        return list(zip(grads, vars_))

    def _accept_vars(self, vars_: Sequence[torch.Tensor]) -> None:
        owned = {id(p) for p in self._all_params()}
        for v in vars_:
            if id(v) not in owned:
                raise ValueError(
                    f"{type(self).__name__} does not own a variable of shape {tuple(v.shape)}: "
                    "apply_gradients only updates parameters given to the optimizer"
                )

    def _apply_pairs(self, pairs: GradsAndVars) -> None:
        with swapped_grads(self._all_params(), pairs):  # type: ignore[arg-type]
            self.step()  # type: ignore[attr-defined]

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[torch.Tensor | None, torch.Tensor]],
        global_step: torch.Tensor | None = None,
        name: str | None = None,
    ) -> int:
        """Apply ``(grad, var)`` pairs (pairs whose grad is ``None`` are skipped).

        Returns ``iterations`` after the update. A ``global_step`` (0-dim integer tensor) is
        incremented by one in place. ``name`` is accepted for TF compatibility and unused.
        """
        pairs = _check_pairs(grads_and_vars)
        _check_global_step(global_step)
        if not pairs:
            raise ValueError("grads_and_vars is empty: nothing to apply")
        live = [(g, v) for g, v in pairs if g is not None]
        if not live:
            raise ValueError(
                "No gradients provided for any variable (every grad is None): check that the "
                "loss depends on the variables"
            )
        self._accept_vars([v for _, v in pairs])
        self._apply_pairs(live)
        if global_step is not None:
            with torch.no_grad():
                global_step.add_(1)
        return self.iterations

    def minimize(
        self,
        loss: Loss,
        var_list: Sequence[torch.Tensor] | None = None,
        global_step: torch.Tensor | None = None,
        grad_loss: torch.Tensor | None = None,
        gate_gradients: int = GATE_OP,
        aggregation_method: Any = None,
        colocate_gradients_with_ops: bool = False,
        name: str | None = None,
    ) -> int:
        """``compute_gradients`` then ``apply_gradients``; returns ``iterations``."""
        _check_global_step(global_step)
        pairs = self.compute_gradients(loss, var_list=var_list, grad_loss=grad_loss)
        return self.apply_gradients(pairs, global_step=global_step, name=name)

    # ---- slots -------------------------------------------------------------------------------
    def _slot_state(self) -> Any:
        return self.state  # type: ignore[attr-defined]

    def get_slot(self, var: torch.Tensor, name: str) -> torch.Tensor | None:
        """The state tensor ``name`` kept for ``var``, or ``None`` if there is none."""
        value = self._slot_state().get(var, {}).get(name)
        return value if isinstance(value, torch.Tensor) else None

    def get_slot_names(self) -> list[str]:
        """Sorted names of the state tensors kept for at least one variable."""
        names = {
            k
            for s in self._slot_state().values()
            for k, v in s.items()
            if isinstance(v, torch.Tensor)
        }
        return sorted(names)

    def variables(self) -> list[torch.Tensor]:
        """Every state tensor, in parameter order, then slot-name order."""
        state = self._slot_state()
        out = []
        for p in self._all_params():
            s = state.get(p, {})
            out.extend(s[k] for k in sorted(s) if isinstance(s[k], torch.Tensor))
        return out

    # ---- iterations in state_dict ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()  # type: ignore[misc]
        sd["iterations"] = self.iterations
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        iterations = sd.pop("iterations", None)
        if iterations is not None:
            iterations = check_int("state_dict['iterations']", iterations, 0)
        super().load_state_dict(sd)  # type: ignore[misc]
        if iterations is not None:
            self.iterations = iterations


class WrappedOptimizer(TFOptimizerProtocol, torch.optim.Optimizer):
    """Any ``torch.optim.Optimizer`` with the TF protocol; the base of distoptim's wrappers.

    ``WrappedOptimizer(opt)`` shares ``opt.param_groups`` (so LR schedulers and
    ``add_param_group`` reach the wrapped optimizer), delegates ``get_slot``,
    ``get_slot_names`` and ``variables`` to it, and its ``state_dict`` is the wrapped
    optimizer's plus ``"iterations"`` and the wrapper's own ``"wrapper"`` entry. The entries of
    the wrapped optimizer's state dict that a wrapper writes too -- a Keras-style optimizer's
    own ``"iterations"``, a wrapped wrapper's ``"iterations"`` and ``"wrapper"`` -- are kept
    under ``"wrapped_"`` + their key and given back to it on load, so however deep a chain of
    wrappers is, every level's count and state round-trip (DiLoCo over CrossShardOptimizer
    over ``distoptim.dtensor.SGD``: ``"wrapped_iterations"`` is the CrossShardOptimizer's,
    ``"wrapped_wrapped_iterations"`` the SGD's, which its schedule reads).

    ``step(closure)`` evaluates the closure, calls ``_before_inner_step()``, runs the wrapped
    optimizer's ``step()``, calls ``_after_inner_step()`` and counts one iteration. Subclasses
    put their communication in those two hooks (or override ``step`` entirely).
    Used directly, it gives any torch optimizer ``minimize``/``apply_gradients``::

        opt = WrappedOptimizer(torch.optim.Adam(model.parameters()))
        opt.minimize(lambda: model(x).pow(2).mean())
    """

    def __init__(self, opt: torch.optim.Optimizer, name: str | None = None) -> None:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer, got {_type_name(opt)}"
            )
        check_type("name", name, str, "a str", optional=True)
        self._wrapped_ready = False
        super().__init__(opt.param_groups, opt.defaults)
        self._wrapped = opt
        self._wrapped_ready = True
        self.__dict__.pop("_init_param_groups", None)
        self._name = name if name is not None else type(self).__name__
        self.iterations = 0

    # The wrapped optimizer's param_groups *are* ours, read through on every access (its
    # load_state_dict replaces the list object): schedulers and add_param_group act on both.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        if self.__dict__.get("_wrapped_ready"):
            return self._wrapped.param_groups
        return self.__dict__["_init_param_groups"]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        if self.__dict__.get("_wrapped_ready"):
            self._wrapped.param_groups = value
        else:  # torch.optim.Optimizer.__init__ builds a throwaway list first
            self.__dict__["_init_param_groups"] = value

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        """The optimizer that computes the update."""
        return self._wrapped

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_wrapped_ready", False):
            self._wrapped.add_param_group(param_group)
        else:  # during torch.optim.Optimizer.__init__
            super().add_param_group(param_group)

    # ---- step ----------------------------------------------------------------------------------
    def _before_inner_step(self) -> None:
        """Runs before the wrapped optimizer's ``step()`` (e.g. reduce gradients)."""

    def _after_inner_step(self) -> None:
        """Runs after the wrapped optimizer's ``step()`` (e.g. commit to a server)."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = run_closure(closure)
        self._before_inner_step()
        self._wrapped.step()
        self._after_inner_step()
        self.iterations += 1
        return loss

    # ---- slots: delegated ----------------------------------------------------------------------
    def _slot_state(self) -> Any:
        return self._wrapped.state

    def get_slot(self, var: torch.Tensor, name: str) -> torch.Tensor | None:
        if isinstance(self._wrapped, TFOptimizerProtocol):
            return self._wrapped.get_slot(var, name)
        return super().get_slot(var, name)

    def get_slot_names(self) -> list[str]:
        if isinstance(self._wrapped, TFOptimizerProtocol):
            return self._wrapped.get_slot_names()
        return super().get_slot_names()

    def variables(self) -> list[torch.Tensor]:
        if isinstance(self._wrapped, TFOptimizerProtocol):
            return self._wrapped.variables()
        return super().variables()

    # ---- state_dict: the wrapped optimizer's, plus ours ------------------------------------------
    def _wrapper_state_dict(self) -> dict[str, Any]:
        """Extra state of a subclass (tensors allowed); stored under ``"wrapper"``."""
        return {}

    def _check_wrapper_state_dict(self, state: Any) -> None:
        """Raise if ``state`` (the ``"wrapper"`` entry) cannot be loaded; change nothing.

        :meth:`load_state_dict` calls it before it loads anything, so a bad entry leaves the
        optimizer (wrapped one included) untouched. Subclasses with wrapper state override it
        together with :meth:`_load_wrapper_state_dict`.
        """
        check_type("state_dict['wrapper']", state, dict, "a dict")
        if state:
            raise ValueError(
                f"{type(self).__name__} keeps no wrapper state, got keys {sorted(state)}"
            )

    def _load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        """Load the (already checked) ``"wrapper"`` entry; must not raise."""

    def state_dict(self) -> dict[str, Any]:
        # the wrapped optimizer's entries that ours would overwrite (its own count, which a
        # TF-protocol one's schedule and EMA read; a wrapper's state and what it kept of the
        # optimizer it wraps) move one "wrapped_" down: every level of a chain keeps its own
        sd = {
            (_WRAPPED + k if _written_by_wrappers(k) else k): v
            for k, v in self._wrapped.state_dict().items()
        }
        sd["iterations"] = self.iterations
        sd["wrapper"] = self._wrapper_state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_type("state_dict", state_dict, dict, "a dict")
        sd = dict(state_dict)
        iterations = sd.pop("iterations", None)
        wrapper = sd.pop("wrapper", {})
        if iterations is not None:
            iterations = check_int("state_dict['iterations']", iterations, 0)
        sd = {  # the wrapped optimizer's state dict: its entries moved one "wrapped_" up
            (k[len(_WRAPPED) :] if _kept_for_the_wrapped(k) else k): v for k, v in sd.items()
        }
        for key in sd:  # every count of the chain below, named as this dict holds it
            if is_step_count(key):
                sd[key] = check_int(f"state_dict[{_WRAPPED + key!r}]", sd[key], 0)
        self._check_wrapper_state_dict(wrapper)  # validate everything before changing anything
        check_inner_state_dict(self._wrapped, sd)
        self._wrapped.load_state_dict(sd)
        self._load_wrapper_state_dict(wrapper)
        if iterations is not None:
            self.iterations = iterations

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._wrapped!r})"


_WRAPPED = "wrapped_"
"""The prefix of an entry a wrapper keeps for the optimizer it wraps (see WrappedOptimizer)."""


def _own_key(key: Any) -> Any:
    """``key`` without its ``"wrapped_"`` prefixes: the key of the level that wrote it."""
    while isinstance(key, str) and key.startswith(_WRAPPED):
        key = key[len(_WRAPPED) :]
    return key


def _written_by_wrappers(key: Any) -> bool:
    """Whether a state-dict key is one a wrapper writes: its count, its own state, or an entry
    it keeps for the optimizer it wraps (``"wrapped_"`` + a key a wrapper writes)."""
    return isinstance(key, str) and _own_key(key) in ("iterations", "wrapper")


def _kept_for_the_wrapped(key: Any) -> bool:
    """Whether a wrapper's state-dict key is an entry it keeps for the optimizer it wraps."""
    return isinstance(key, str) and key.startswith(_WRAPPED) and _written_by_wrappers(key)


def is_step_count(key: Any) -> bool:
    """Whether a key of a distoptim optimizer's state dict is a step count: its own
    ``"iterations"`` or, for a wrapper, one of the optimizers it wraps (``"wrapped_iterations"``,
    ``"wrapped_wrapped_iterations"``, ...: one ``"wrapped_"`` per level down)."""
    return isinstance(key, str) and _own_key(key) == "iterations"


def wrapped_step_counts(opt: torch.optim.Optimizer) -> dict[str, int]:
    """The step counts of ``opt`` and of every optimizer under it, keyed as a wrapper over
    ``opt`` keeps them in its state dict (``"wrapped_iterations"``: ``opt``'s own,
    ``"wrapped_wrapped_iterations"``: that of the optimizer ``opt`` wraps, ...). Reads the
    counts only (no state is packed); a plain torch optimizer keeps none: ``{}``."""
    out: dict[str, int] = {}
    key = _WRAPPED + "iterations"
    while isinstance(opt, TFOptimizerProtocol):
        out[key] = int(opt.iterations)
        if not isinstance(opt, WrappedOptimizer):
            break
        opt, key = opt._wrapped, _WRAPPED + key
    return out


def check_inner_state_dict(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """The checks ``torch.optim.Optimizer.load_state_dict`` makes, without loading anything.

    torch raises only after it may have run load-state-dict pre-hooks; doing its structural
    checks first keeps a failing ``load_state_dict`` free of side effects.
    """
    groups = sd.get("param_groups")
    if not isinstance(groups, list) or not isinstance(sd.get("state"), dict):
        raise ValueError(
            "state_dict must hold the wrapped optimizer's 'state' (dict) and 'param_groups' "
            f"(list), got keys {sorted(sd)}"
        )
    if len(groups) != len(opt.param_groups):
        raise ValueError(
            f"loaded state dict has {len(groups)} parameter groups, the wrapped "
            f"{type(opt).__name__} has {len(opt.param_groups)}"
        )
    for i, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(saved, dict) or len(saved.get("params", ())) != len(mine["params"]):
            raise ValueError(
                f"loaded state dict's parameter group {i} does not match the size of the "
                f"wrapped {type(opt).__name__}'s group {i} ({len(mine['params'])} parameters)"
            )
