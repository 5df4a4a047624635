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
``reply_before_update`` (the reply is the center as it was before this commit), ``elementwise``
(``apply`` may be called on any part of the variables separately: the shard then applies a
commit chunk by chunk as it arrives) and ``bounded_by_inputs`` (see the guard). Rules travel to
the shards pickled inside the chief's seed, so they must be picklable and compare by value
(``__eq__`` on their attributes).

The center guard
----------------
A commit is applied only if the center is finite afterwards; otherwise the shard refuses it,
the center (and the server optimizer's state) stay exactly as they were, and the refusal is
counted and reported to the worker with its reason.

* **Under the table's lock** (``use_locking=True``, and always with a server optimizer): the
  shard applies a commit chunk by chunk (:mod:`distoptim.agn.server`). Before a chunk is
  updated its :class:`Backup` unit -- that range of the center and the server-optimizer state of
  its pieces -- is current: taken ahead, between requests, while the shard is idle, or else
  copied just before the update while the chunk is in the cache. After the update the chunk is
  checked with one ``sum`` while it is still in the cache (:func:`finite_tensor`: a sum is finite
  only if every term is; a non-finite sum of finite terms, an overflow of the sum itself, is
  checked element-wise), so the check costs no extra pass over memory. A non-finite chunk
  refuses the commit: every chunk updated so far is restored from the backup.
* **Without the lock** (``use_locking=False``, bounded rules only): :func:`apply_unlocked`
  applies a commit only when a bound of ``max|c|`` proves its result finite (no backup is
  possible while others write).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.elementwise_rule import elementwise

__all__ = [
    "AddUpdate",
    "ApplyOptimizer",
    "Backup",
    "BackupUnit",
    "Bound",
    "DelayedNesterov",
    "ElasticUpdate",
    "Refusal",
    "ServerRule",
    "apply_unlocked",
    "elastic_difference",
    "finite",
    "finite_tensor",
    "unalias_state",
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
    elementwise = False
    """``apply`` may be called on any part of the variables separately (its pieces, 1-D) and gives
    the same elements as on the whole: the shard then applies a commit chunk by chunk. With
    ``uses_optimizer``, the server optimizer must also be element-wise (else it is stepped
    whole)."""
    bounded_by_inputs = False
    """Each new center element is a sum of at most ``max_terms`` terms bounded by ``max|c|`` and
    ``max|u|`` (so a commit can be applied without the lock: :func:`apply_unlocked`)."""
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
    """``c <- server_optimizer.step(c, grad=u)`` (AGN, TF contrib's rule; an outer optimizer).

    Applied chunk by chunk when the server optimizer is element-wise
    (:mod:`distoptim.agn.server_optimizer`), whole otherwise."""

    uses_optimizer = True
    elementwise = True

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

    elementwise = True
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
    elementwise = True
    bounded_by_inputs = True
    max_terms = 3

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def apply(self, center, update, optimizer):
        torch._foreach_add_(center, elastic_difference(update, center, self.alpha))


@elementwise
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
def finite_tensor(t: torch.Tensor) -> bool:
    """True iff every element of ``t`` is finite (non-floating tensors are).

    Fast path: a sum reduction (no temporary the size of ``t``) is finite only if every term is
    (NaN and Inf propagate); a non-finite sum may also be an overflow of finite terms, so only
    then is the exact element-wise test run. On a chunk that was just written the sum reads it
    from the cache: the check costs no extra pass over memory.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def finite(flats: Mapping[str, torch.Tensor]) -> bool:
    """True iff every element of every buffer is finite (:func:`finite_tensor`)."""
    return all(finite_tensor(t) for t in flats.values())


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
    """Why a commit was not applied: ``"payload"`` (NaN/Inf sent, found by the shard or by the
    worker), ``"result"`` (the center would have become non-finite) or ``"abandoned"`` (the
    worker stopped in the middle of sending it; not counted as a refusal)."""

    reason: str

    def describe(self) -> str:
        if self.reason == "payload":
            return "the commit contained NaN/Inf"
        if self.reason == "abandoned":
            return "the worker abandoned the commit while sending it"
        return "applying the commit would have made the center non-finite (NaN/Inf)"


@dataclass
class BackupUnit:
    """What one piece of a :class:`Backup` covers: ranges ``(key, start, stop)`` of the center
    and the server-optimizer parameters whose state goes with them."""

    ranges: list[tuple[str, int, int]]
    params: list[torch.Tensor] = field(default_factory=list)


class Backup:
    """A copy of a table's center and server-optimizer state, unit by unit, each tagged with the
    table version it shows (``None``: stale).

    A unit is a chunk of the center with the optimizer state of its pieces (so a chunk can be
    backed up just before it is updated, while it is in the cache, or ahead, between requests),
    plus, for an optimizer stepped whole, one unit holding all of its state. Restoring a unit
    puts the center range and the state back exactly, including state that did not exist yet
    (it is removed).
    """

    def __init__(
        self,
        flats: Mapping[str, torch.Tensor],
        units: list[BackupUnit],
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.center = {k: torch.empty_like(v) for k, v in flats.items()}
        self.units = units
        self.versions: list[int | None] = [None] * len(units)
        self._optimizer = optimizer
        self._state: dict[int, dict[str, Any] | None] = {}  # id(param) -> entries (None: none)
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, unit: int, flats: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy unit ``unit`` as of ``version`` (the caller holds the table's lock)."""
        u = self.units[unit]
        for key, lo, hi in u.ranges:
            self.center[key][lo:hi].copy_(flats[key][lo:hi])
        opt = self._optimizer
        if opt is not None:
            for p in u.params:
                live = opt.state.get(p)
                if not live:
                    self._state[id(p)] = None
                    continue
                entries: dict[str, Any] = {}
                for name, value in live.items():
                    if isinstance(value, torch.Tensor):
                        buf = self._bufs.get((id(p), name))
                        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                            buf = self._bufs[id(p), name] = torch.empty_like(value)
                        buf.copy_(value)
                        entries[name] = buf
                    else:
                        entries[name] = value
                self._state[id(p)] = entries
        self.versions[unit] = version

    def restore(self, unit: int, flats: Mapping[str, torch.Tensor]) -> None:
        """Put unit ``unit`` back into the live center and optimizer state."""
        u = self.units[unit]
        for key, lo, hi in u.ranges:
            flats[key][lo:hi].copy_(self.center[key][lo:hi])
        opt = self._optimizer
        if opt is None:
            return
        for p in u.params:
            entries = self._state.get(id(p))
            if not entries:
                opt.state.pop(p, None)
                continue
            live = opt.state[p]
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


def unalias_state(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], storages: set[int]
) -> None:
    """Replace state tensors of ``params`` that share one of ``storages`` (storage data
    pointers of a commit's buffers) by copies.

    An optimizer may keep a reference to the gradient it stepped with; the commit's buffers are
    reused by the transport for the next message, so such a reference must own its memory.
    """
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            continue
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                state[name] = value.clone()


def _dtype_max(t: torch.Tensor) -> float:
    return float(torch.finfo(t.dtype).max)


@dataclass
class Bound:
    """An upper bound of ``max|c|`` per center buffer, for commits applied without the lock."""

    value: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def apply_unlocked(
    rule: ServerRule,
    center: Mapping[str, torch.Tensor],
    center_views: list[torch.Tensor],
    update: Mapping[str, torch.Tensor],
    update_views: list[torch.Tensor],
    bound: Bound,
) -> Refusal | None:
    """Apply a bounded rule without the table's lock (``use_locking=False``), guarded.

    No backup is possible while others write, so the commit is applied only when a bound proves
    the result finite: every new element is a sum of at most ``rule.max_terms`` terms bounded by
    ``max|c|`` and ``max|u|``, so ``terms * max(max|c|, max|u|) < FLT_MAX`` (the dtype's largest
    finite value) guarantees it. The shard keeps an upper bound of ``max|c|`` (exact after
    seeding, grown by ``max|u|`` per commit -- reserved before applying, so concurrent commits
    see each other's growth); one read pass over the payload (``aminmax``, which also catches
    NaN/Inf) per commit. A commit the bound cannot prove safe is refused.
    """
    if not rule.bounded_by_inputs:
        raise RuntimeError(f"{type(rule).__name__} needs the table's lock (use_locking=True)")
    m_u = _max_abs(update)
    if any(math.isnan(v) or math.isinf(v) for v in m_u.values()):
        return Refusal("payload")
    with bound.lock:
        if not bound.value:
            bound.value = _max_abs(center)
        before = dict(bound.value)
        safe = all(rule.max_terms * max(before[k], m_u[k]) < _dtype_max(center[k]) for k in center)
        if safe:
            bound.value = {k: before[k] + (rule.max_terms - 1) * m_u[k] for k in center}
    if not safe:
        return Refusal("result")
    rule.apply(center_views, update_views, None)
    return None
