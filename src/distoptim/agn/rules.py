"""The server rules: how an accepted commit changes a shard's center, and the center guard.

Owns: every rule a parameter-server shard applies to its center variables, and the guard that
refuses a commit whose *result* would not be finite. A rule is small and pure: it receives the
center (per-variable views into the shard's flat buffers, changed in place), the committed
tensors and, for rules that need one, the server optimizer; the shard calls it under the
table's write lock (see :mod:`distoptim.agn.server`). The rules:

* :class:`ApplyOptimizer` -- ``c <- server_opt.step(c, grad=u)``: AGN's default (TF contrib's
  rule). The server optimizer is a fresh instance of the worker's wrapped optimizer class with
  its hyperparameters; its state (momentum, Adam moments, ...) lives on the shard. The same rule
  with an *outer* optimizer (``torch.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)``) applied to
  a pseudo-gradient is asynchronous DiLoCo's server.
* :class:`AddUpdate` -- ``c <- c + u`` (AGN ``update_rule="delta"``, DOWNPOUR).
* :class:`ElasticUpdate` -- ``d = alpha (theta - c)``, ``c <- c + d``; the reply carries the
  center from before the update (EASGD).
* :class:`DelayedNesterov` -- not a rule but the server optimizer :class:`ApplyOptimizer` runs
  for asynchronous DiLoCo with Delayed Nesterov (Liu et al. 2024, arXiv 2401.09135,
  Algorithm 3): momentum updated once every ``N`` pseudo-gradients, plain descent in between.

A new algorithm adds its rule here: subclass :class:`ServerRule`, implement :meth:`apply`, and
declare ``uses_optimizer`` (the shard builds and keeps a server optimizer),
``reply_before_update`` (the reply is the center as it was before this commit) and
``bounded_by_inputs`` (see the guard). Rules travel to the shards pickled inside the chief's
seed, so they must be picklable and compare by value (``__eq__`` on their attributes).

The center guard (:func:`apply_guarded`)
----------------------------------------
A commit is applied only if the center is finite afterwards; otherwise the shard refuses it,
the center (and the server optimizer's state) stay exactly as they were, and the refusal is
counted and reported to the worker with its reason. Two ways, chosen per rule:

* **Bounded rules** (``bounded_by_inputs``, the additive and elastic ones): every new center
  element is a sum of a few terms of the inputs, so ``max|c| + max|u| < FLT_MAX`` (the dtype's
  largest finite value) guarantees a finite result. The shard keeps an upper bound of ``max|c|``
  (exact after seeding, grown by ``max|u|`` per commit, recomputed when it gets large), and a
  commit costs one read pass over the payload (``aminmax``, which also catches NaN/Inf). Only
  when the bound cannot rule out an overflow is the commit applied the general way below.
* **General rules** (a server optimizer): the center and the optimizer state are backed up, the
  rule is applied, and the result is checked with one ``sum`` per buffer (a sum is finite only if
  every term is; a non-finite sum of finite terms, an overflow of the sum itself, is checked
  element-wise). A non-finite result restores the backup. The backup is reused while the center
  has not changed since it was taken (:class:`Backup`), so a shard that can refresh it between
  commits does not pay for it on a commit's critical path.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "AddUpdate",
    "ApplyOptimizer",
    "Backup",
    "DelayedNesterov",
    "ElasticUpdate",
    "Refusal",
    "ServerRule",
    "apply_guarded",
    "elastic_difference",
    "finite",
]


# ---------------------------------------------------------------------------------------------
# rules
# ---------------------------------------------------------------------------------------------
class ServerRule:
    """How an accepted commit changes the center (runs on the shard, under the write lock).

    ``apply(center, update, optimizer)``: ``center`` and ``update`` are per-variable tensors of
    this shard (``center`` are views into the center buffers and must be changed in place);
    ``optimizer`` is the server optimizer when ``uses_optimizer`` else ``None``.
    """

    uses_optimizer = False
    """The shard builds a server optimizer over the center (and keeps its state)."""
    reply_before_update = False
    """The reply carries the center as it was *before* this commit (EASGD)."""
    bounded_by_inputs = False
    """Each new center element is a sum of at most ``max_terms`` terms bounded by ``max|c|`` and
    ``max|u|`` (so the guard can rule out overflow without a backup)."""
    max_terms = 2

    def apply(
        self,
        center: list[torch.Tensor],
        update: list[torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class ApplyOptimizer(ServerRule):
    """``c <- server_optimizer.step(c, grad=u)`` (AGN, TF contrib's rule; an outer optimizer)."""

    uses_optimizer = True

    def apply(self, center, update, optimizer):
        if optimizer is None:
            raise RuntimeError("ApplyOptimizer needs the table's server optimizer")
        for p, g in zip(center, update):
            p.grad = g
        try:
            optimizer.step()
        finally:
            for p in center:
                p.grad = None


class AddUpdate(ServerRule):
    """``c <- c + u`` (AGN ``update_rule="delta"``, DOWNPOUR)."""

    bounded_by_inputs = True

    def apply(self, center, update, optimizer):
        torch._foreach_add_(center, update)


def elastic_difference(
    local: list[torch.Tensor], center: list[torch.Tensor], alpha: float
) -> list[torch.Tensor]:
    """``d = alpha (theta - c)``, by the same ops on worker and shard so they agree bit for bit."""
    return torch._foreach_mul(torch._foreach_sub(local, center), alpha)


class ElasticUpdate(ServerRule):
    """``d = alpha (theta - c)``; ``c <- c + d``; the reply carries ``c`` from before the update.

    ``|c + alpha (theta - c)| <= (1 + 2 alpha) max(|c|, |theta|)`` with ``alpha <= 1``: three
    terms bounded by the inputs.
    """

    reply_before_update = True
    bounded_by_inputs = True
    max_terms = 3

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def apply(self, center, update, optimizer):
        torch._foreach_add_(center, elastic_difference(update, center, self.alpha))


class DelayedNesterov(torch.optim.Optimizer):
    """Delayed Nesterov (DN), Liu et al. 2024, arXiv 2401.09135, Algorithm 3.

    The outer optimizer of asynchronous DiLoCo's server (:mod:`distoptim.agn.async_diloco`).
    Each ``step()`` consumes one pseudo-gradient ``g_t`` (the parameters' ``.grad``; ``t = 0, 1,
    …`` counts this optimizer's steps) and updates every parameter ``θ`` with its momentum ``m``
    (``m_0 = 0``) and its buffer ``Δ`` of the pseudo-gradients since the last momentum update
    (``Δ = 0`` initially)::

        Δ ← Δ + g_t
        if (t + 1) mod N == 0:                                    # a momentum step
            m_{t+1} = β m_t + Δ / N
            θ_{t+1} = θ_t - ε ((1 - cN + c) β m_{t+1} + g_t / N)
            Δ ← 0
        else:                                                     # momentum delayed
            m_{t+1} = m_t
            θ_{t+1} = θ_t - ε (c β m_{t+1} + g_t / N)

    with ``ε = lr``, ``β = momentum`` in ``[0, 1)``, ``N = buffer_size >= 1`` and the momentum
    activation ``c = activation`` in ``[0, 1/N]`` (the paper's default ``c = 0``: plain gradient
    descent at rate ``ε/N`` between momentum steps; ``c = 1/N`` spreads the momentum term evenly
    over the ``N`` steps). Over ``N`` steps the momentum sees the *mean* of the ``N``
    pseudo-gradients, as one synchronous Nesterov step on their average would. With ``N = 1`` and
    ``c = 0`` it is ``torch.optim.SGD(lr=ε, momentum=β, nesterov=True)``, bit for bit.

    State per parameter: ``momentum_buffer`` (``m``), ``pseudo_gradient_sum`` (``Δ``) and
    ``step`` (``t``); all checkpoint with ``state_dict()``.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 0.7,
        momentum: float = 0.9,
        buffer_size: int = 1,
        activation: float = 0.0,
    ) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < math.inf:
            raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
        if (
            isinstance(momentum, bool)
            or not isinstance(momentum, (int, float))
            or not 0 <= momentum < 1
        ):
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        if (
            isinstance(activation, bool)
            or not isinstance(activation, (int, float))
            or not 0 <= activation <= 1 / buffer_size
        ):
            raise ValueError(
                f"activation (the paper's c) must be a number in [0, 1/buffer_size] = "
                f"[0, {1 / buffer_size:g}], got {activation!r}"
            )
        defaults = {
            "lr": float(lr),
            "momentum": float(momentum),
            "buffer_size": buffer_size,
            "activation": float(activation),
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta = group["lr"], group["momentum"]
            n, c = group["buffer_size"], group["activation"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros_like(p)
                    state["pseudo_gradient_sum"] = torch.zeros_like(p)
                m, acc = state["momentum_buffer"], state["pseudo_gradient_sum"]
                acc.add_(g)
                if (state["step"] + 1) % n == 0:
                    m.mul_(beta).add_(acc / n)
                    acc.zero_()
                    d = (g / n).add(m, alpha=(1 - c * n + c) * beta)
                elif c:
                    d = (g / n).add(m, alpha=c * beta)
                else:
                    d = g / n
                p.add_(d, alpha=-lr)
                state["step"] += 1
        return loss


# ---------------------------------------------------------------------------------------------
# the guard
# ---------------------------------------------------------------------------------------------
def finite(flats: Mapping[str, torch.Tensor]) -> bool:
    """True iff every element of every floating buffer is finite.

    Fast path: a sum reduction (no temporary the size of the buffer) is finite only if every
    term is (NaN and Inf propagate); a non-finite sum may also be an overflow of finite terms,
    so only then is the exact element-wise test run.
    """
    for t in flats.values():
        if not t.is_floating_point():
            continue
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            return False
    return True


def _max_abs(flats: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``max|x|`` per buffer (NaN when a NaN is present; Inf when an Inf is)."""
    out = {}
    for k, t in flats.items():
        if t.numel() == 0:
            out[k] = 0.0
            continue
        lo, hi = torch.aminmax(t)
        lo_f, hi_f = float(lo), float(hi)
        out[k] = math.nan if math.isnan(lo_f) or math.isnan(hi_f) else max(-lo_f, hi_f)
    return out


@dataclass
class Refusal:
    """Why a commit was refused: ``"payload"`` (NaN/Inf sent) or ``"result"`` (the center would
    have become non-finite)."""

    reason: str

    def describe(self) -> str:
        if self.reason == "payload":
            return "the commit contained NaN/Inf"
        return "applying the commit would have made the center non-finite (NaN/Inf)"


@dataclass
class Backup:
    """A copy of a table's center (and server-optimizer state) from before a commit.

    ``version``: the table version the copy shows (``None``: stale, retake before use).
    ``center``: flat buffers like the table's; ``state``: per optimizer parameter index, the
    copied state entries (tensors copied into persistent buffers, other values as they were).
    """

    center: dict[str, torch.Tensor]
    version: int | None = None
    state: list[dict[str, Any]] | None = None
    _state_bufs: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)  # upper bound of max|c| per buffer
    bound_lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def like(cls, flats: Mapping[str, torch.Tensor]) -> Backup:
        return cls({k: torch.empty_like(v) for k, v in flats.items()})

    def take(
        self,
        flats: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer | None,
        version: int,
    ) -> None:
        """Copy the center and the optimizer's state (caller holds the table's lock)."""
        if self.version == version:
            return
        torch._foreach_copy_(list(self.center.values()), [flats[k] for k in self.center])
        if optimizer is not None:
            self.state = []
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for i, p in enumerate(params):
                entries = {}
                for name, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        buf = self._state_bufs.get((i, name))
                        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                            buf = torch.empty_like(value)
                            self._state_bufs[(i, name)] = buf
                        buf.copy_(value)
                        entries[name] = buf
                    else:
                        entries[name] = value
                self.state.append(entries)
        self.version = version

    def restore(
        self, flats: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer | None
    ) -> None:
        """Put the copy back into the live center and optimizer state."""
        torch._foreach_copy_([flats[k] for k in self.center], list(self.center.values()))
        if optimizer is not None and self.state is not None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            for p, entries in zip(params, self.state):
                if not entries:
                    optimizer.state.pop(p, None)
                    continue
                live = optimizer.state[p]
                for name, value in entries.items():
                    if isinstance(value, torch.Tensor) and isinstance(live.get(name), torch.Tensor):
                        live[name].copy_(value)
                    elif isinstance(value, torch.Tensor):
                        live[name] = value.clone()
                    else:
                        live[name] = value
                for name in list(live):
                    if name not in entries:
                        del live[name]


def _unalias_state(optimizer: torch.optim.Optimizer, update: list[torch.Tensor]) -> None:
    """Replace optimizer-state tensors that share storage with ``update`` by copies.

    An optimizer may keep a reference to the gradient it stepped with; the commit's buffers are
    reused by the transport for the next message, so such a reference must own its memory.
    """
    ptrs = {t.untyped_storage().data_ptr() for t in update}
    for state in optimizer.state.values():
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in ptrs:
                state[name] = value.clone()


def _dtype_max(t: torch.Tensor) -> float:
    return float(torch.finfo(t.dtype).max)


def apply_guarded(
    rule: ServerRule,
    center: Mapping[str, torch.Tensor],
    center_views: list[torch.Tensor],
    update: Mapping[str, torch.Tensor],
    update_views: list[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    backup: Backup,
    version: int,
    exclusive: bool = True,
) -> Refusal | None:
    """Apply ``rule`` to the center unless that makes it non-finite (see the module docstring).

    ``center``/``update``: the flat buffers; ``*_views``: the per-variable views into them.
    ``version``: the table version before this commit (keys the backup). Returns ``None`` when
    applied, else the :class:`Refusal` (the center and optimizer state are then unchanged).
    ``exclusive``: the caller holds the table's write lock. Without it (``use_locking=False``,
    bounded rules only) concurrent commits reserve their growth of the bound before applying,
    and a commit whose finiteness the bound cannot prove is refused (no backup is possible
    while others write).
    """
    if rule.bounded_by_inputs:
        m_u = _max_abs(update)
        if any(math.isnan(v) or math.isinf(v) for v in m_u.values()):
            return Refusal("payload")
        with backup.bound_lock:
            if not backup.bound:
                backup.bound = _max_abs(center)
            before = dict(backup.bound)
            safe = all(
                rule.max_terms * max(before[k], m_u[k]) < _dtype_max(center[k]) for k in center
            )
            if safe:  # reserve this commit's growth before applying it
                backup.bound = {k: before[k] + (rule.max_terms - 1) * m_u[k] for k in center}
        if safe:
            rule.apply(center_views, update_views, optimizer)
            if exclusive and any(v > 1e-3 * _dtype_max(center[k]) for k, v in backup.bound.items()):
                backup.bound = _max_abs(center)  # tighten a bound grown loose
            return None
        if not exclusive:
            return Refusal("result")
    if not exclusive:
        raise RuntimeError(f"{type(rule).__name__} needs the table's lock (use_locking=True)")
    backup.take(center, optimizer, version)
    rule.apply(center_views, update_views, optimizer)
    if optimizer is not None:
        _unalias_state(optimizer, update_views)
    if finite(center):
        backup.version = None  # the center moved on
        backup.bound = {}
        return None
    backup.restore(center, optimizer)
    return Refusal("result" if finite(update) else "payload")
