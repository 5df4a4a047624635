"""The step plan of the mesh-aware SGD: what a step works out from its params before the math.

Owns: :func:`params_with_grads` (which params a step updates), :class:`StepPlan` (their
slots, local weights, buckets, momentum buffers, averages and layouts) and :class:`Bucket`
(the local shards one kernel call updates, and Keras' step on them: :meth:`Bucket.apply`).
:class:`~distoptim.dtensor.sgd.SGD` keeps a plan between steps of plain tensors;
:class:`StepPlan` says what is checked every step and why the rest cannot change unseen.

The rule a bucket applies is step 4 of :mod:`~distoptim.dtensor.sgd`'s order (Keras' momentum
kept as a torch buffer times the bucket's scale: :mod:`~distoptim.dtensor.momentum`); the
kernels are :mod:`~distoptim.dtensor.kernels`'.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from distoptim.dtensor import momentum as _momentum
from distoptim.dtensor.kernels import CompiledUpdate, sgd_update, strided_positions
from distoptim.dtensor.layout import Layout, layout_of, local_shard

__all__ = ["Bucket", "StepPlan", "params_with_grads"]

_NONE_TYPE = type(None)
_NONE_TYPE = type(None)
_CONTIGUOUS = torch.Tensor.is_contiguous
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")


def params_with_grads(
    groups: list[dict[str, Any]],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """The params of ``groups`` that have a ``.grad`` (group order), those grads, and after
    each group the number of such params so far (``ends``: group ``i``'s params with a gradient
    are ``params[ends[i-1]:ends[i]]``)."""
    ps: list[torch.Tensor] = []
    gs: list[torch.Tensor] = []
    ends: list[int] = []
    for group in groups:
        params = group["params"]
        grads = [p.grad for p in params]
        if _NONE_TYPE in map(type, grads):
            params = [p for p, g in zip(params, grads) if g is not None]
            grads = [g for g in grads if g is not None]
        ps += params
        gs += grads
        ends.append(len(ps))
    return ps, gs, ends


@dataclasses.dataclass(eq=False)
class Bucket:
    """The local shards one kernel call updates: one param group, momentum scale, dtype, device
    and kind (DTensor shards or plain tensors).

    ``idx``: their positions among the step's params with a gradient. With momentum in the
    group, ``states`` are their optimizer states, every one with ``SCALE == scale``, and
    ``bufs`` those states' local momentum buffers; without, ``states`` is empty and ``bufs``
    None. ``strided``: the positions, in the bucket, of the weights or buffers that are not
    contiguous (the fused kernel must not see them).
    """

    group: int
    idx: list[int]
    ws: list[torch.Tensor]
    states: list[dict[str, Any]]
    bufs: list[torch.Tensor] | None
    scale: float | None
    kind: tuple[torch.dtype, torch.device, bool]
    strided: list[int]

    @classmethod
    def of(
        cls,
        group: int,
        idx: list[int],
        ws: list[torch.Tensor],
        states: list[dict[str, Any]],
        with_buffer: bool,
        sharded: bool = False,
    ) -> Bucket:
        """The bucket of local weights ``ws`` whose states are ``states`` (scales all equal)."""
        bufs = [local_shard(st[_momentum.BUFFER]) for st in states] if with_buffer else None
        return cls(
            group=group,
            idx=idx,
            ws=ws,
            states=states if with_buffer else [],
            bufs=bufs,
            scale=states[0].get(_momentum.SCALE),
            kind=(ws[0].dtype, ws[0].device, sharded),
            strided=strided_positions(ws, bufs),
        )

    def apply(
        self,
        gs: list[torch.Tensor],
        lr: float,
        momentum: float,
        nesterov: bool,
        compiled: CompiledUpdate | None = None,
        impl: str = "auto",
        strided: list[int] | None = None,
    ) -> None:
        """Keras' step on the bucket's local shards, from their local gradients ``gs``; moves
        the bucket's momentum scale (here and in every state of the bucket).

        ``compiled``: the ``torch.compile``'d update to try first (``jit_compile``); ``impl``
        and ``strided``: as in :func:`~distoptim.dtensor.kernels.sgd_update`.
        """
        scale = new_scale = 0.0
        if momentum != 0.0:
            scale = self.scale  # type: ignore[assignment]
            new_scale = _momentum.next_scale(scale, lr)
        kp = _momentum.keras_step(lr, momentum, nesterov, scale, new_scale)
        ws, bufs = self.ws, self.bufs
        if impl != "auto" or compiled is None or not compiled(ws, gs, bufs, kp):
            sgd_update(ws, gs, bufs, kp, impl, strided)
        if new_scale != scale:
            for st in self.states:
                st[_momentum.SCALE] = new_scale
            self.scale = new_scale


@dataclasses.dataclass(eq=False)
class StepPlan:
    """What a step works out from its params before any arithmetic: their slots (created on
    first need), local weights, buckets, momentum buffers, averages and layouts.

    A step of plain tensors keeps its plan (``SGD._plan``) and reuses it while :meth:`fits`
    holds, so that a training loop's step pays no per-parameter dict lookups or contiguity
    checks of weights and buffers (on a GPU, with many small tensors, the step is bound by
    exactly this Python work). A step with DTensors builds a fresh plan each time.

    Why a kept plan is never stale:

    * It holds its params, states and buffers (never a gradient), so ``is`` comparisons on
      them cannot be fooled by a reused id.
    * ``SGD`` drops it whenever it changes slots or momentum scales outside a step:
      ``_init_slots`` (hence ``add_param_group``, ``build``), ``add_variable_from_reference``,
      ``update_step``, ``state_dict``, ``load_state_dict``; and after a step in which two
      buckets' scales became equal (a fresh plan would merge them: :meth:`buckets_distinct`).
    * A step moves each bucket's ``scale`` together with its states' scales.
    * :meth:`fits` checks, every step, all that can change behind SGD's back: which params
      have a gradient and in which group, whether each group's momentum is zero, the state
      mapping (the same params mapped to the same dicts in the same order, so ``opt.state``
      replaced, cleared or edited is seen), each weight's shape, dtype, device and contiguity
      (``p.data = ...``), and that every gradient is a plain tensor of its weight's shape
      (anything else takes the fully checked path and a fresh plan).

    Not seen: hand edits of the internal entries of one parameter's state dict (its
    ``momentum_buffer`` or ``momentum_scale``); those entries are SGD's own.
    """

    params: list[torch.Tensor]
    ends: list[int]
    with_buffer: tuple[bool, ...]
    state_keys: list[torch.Tensor]
    state_values: list[dict[str, Any]]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    devices: list[torch.device]
    contiguous: list[bool]
    buckets: list[Bucket]
    averages: list[tuple[torch.Tensor, torch.Tensor]]
    layouts: list[Layout]
    sharded: bool

    @property
    def cacheable(self) -> bool:
        """Whether the plan may serve later steps (no DTensor among its params)."""
        return not self.sharded

    @classmethod
    def build(
        cls,
        params: list[torch.Tensor],
        ends: list[int],
        groups: list[dict[str, Any]],
        state: dict[torch.Tensor, dict[str, Any]],
        init_slots: Callable[[torch.Tensor, dict[str, Any]], Any],
        ema: bool,
    ) -> StepPlan:
        """The plan for ``params`` (those of ``groups`` with a gradient, in group order;
        ``ends`` as :func:`params_with_grads` gives them), whose optimizer states ``state``
        holds. ``init_slots(p, group)`` creates the slots ``p`` lacks (a momentum buffer where
        the group has momentum, an ``"average"`` when ``ema``): the only change it makes."""
        with_buffer = tuple(g["momentum"] != 0 for g in groups)
        ws, states = [], []
        keyed: dict[tuple[Any, ...], list[int]] = {}
        gi = 0
        for i, p in enumerate(params):
            while i >= ends[gi]:
                gi += 1
            st = state[p]
            if (with_buffer[gi] and _momentum.SCALE not in st) or (ema and "average" not in st):
                init_slots(p, groups[gi])  # new, or its group's momentum became > 0
            w = local_shard(p)
            key = (gi, st.get(_momentum.SCALE), w.dtype, w.device, isinstance(p, DTensor))
            keyed.setdefault(key, []).append(i)
            ws.append(w)
            states.append(st)
        buckets = [
            Bucket.of(
                key[0],
                idx,
                [ws[i] for i in idx],
                [states[i] for i in idx],
                with_buffer[key[0]],
                sharded=key[4],
            )
            for key, idx in keyed.items()
        ]
        return cls(
            params=params,
            ends=ends,
            with_buffer=with_buffer,
            state_keys=list(state),
            state_values=list(state.values()),
            shapes=list(map(_SHAPE, ws)),
            dtypes=list(map(_DTYPE, ws)),
            devices=list(map(_DEVICE, ws)),
            contiguous=list(map(_CONTIGUOUS, ws)),
            buckets=buckets,
            averages=[(p, st["average"]) for p, st in zip(params, states) if "average" in st],
            layouts=[layout_of(p) for p in params],
            sharded=any(isinstance(p, DTensor) for p in params),
        )

    def fits(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        ends: list[int],
        groups: list[dict[str, Any]],
        state: dict[torch.Tensor, dict[str, Any]],
    ) -> bool:
        """Whether this (kept) plan is what :meth:`build` would make now, and ``grads`` are
        plain tensors of their weights' shapes: with sparse gradients ruled out by the caller
        (a contiguous tensor is never sparse), the checks of ``check_grad`` for all gradients at
        once. False changes nothing."""
        n = len(self.params)
        return (
            ends == self.ends
            and len(params) == n
            and all(map(operator.is_, params, self.params))
            and tuple(g["momentum"] != 0 for g in groups) == self.with_buffer
            and len(state) == len(self.state_keys)
            and all(map(operator.is_, state, self.state_keys))
            and all(map(operator.is_, state.values(), self.state_values))
            and list(map(_SHAPE, params)) == self.shapes
            and list(map(_DTYPE, params)) == self.dtypes
            and list(map(_DEVICE, params)) == self.devices
            and list(map(_CONTIGUOUS, params)) == self.contiguous
            and list(map(type, grads)).count(torch.Tensor) == n
            and list(map(_SHAPE, grads)) == self.shapes
        )

    def local_grads(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients as the kernels read them: a DTensor's redistributed to its param's
        placements and reduced to the local shard, each in its weight's dtype."""
        if self.sharded:
            out = []
            for p, g, dtype in zip(self.params, grads, self.dtypes):
                if isinstance(p, DTensor):
                    if g.placements != p.placements:  # type: ignore[attr-defined]
                        g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
                    g = local_shard(g)
                out.append(g if g.dtype == dtype else g.to(dtype))
            return out
        if list(map(_DTYPE, grads)) == self.dtypes:
            return grads
        return [g if g.dtype == dtype else g.to(dtype) for g, dtype in zip(grads, self.dtypes)]

    def buckets_distinct(self) -> bool:
        """Whether no two buckets share their key (group, momentum scale, dtype, device, kind)."""
        keys = {(b.group, b.scale, b.kind) for b in self.buckets}
        return len(keys) == len(self.buckets)
