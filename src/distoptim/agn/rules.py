"""The server rules: how an accepted commit changes a shard's center.

Owns: every rule a parameter-server shard applies to its center variables. A rule is small
and pure: it receives the center (per-variable views into the shard's flat buffers, changed in
place), the committed tensors and, for rules that need one, the server optimizer; the shard
calls it under the table's write lock (see :mod:`distoptim.agn.server`), guarded by
:mod:`distoptim.agn.center_guard` (a commit whose *result* would not be finite is refused).
The rules:

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
commit chunk by chunk as it arrives) and ``bounded_by_inputs`` (see
:func:`~distoptim.agn.center_guard.apply_unlocked`). Rules travel to
the shards pickled inside the chief's seed, so they must be picklable and compare by value
(``__eq__`` on their attributes).
"""

from __future__ import annotations

from typing import Any

import torch

from distoptim.checks import check_int, check_real
from distoptim.elementwise_rule import elementwise

__all__ = [
    "AddUpdate",
    "ApplyOptimizer",
    "DelayedNesterov",
    "ElasticUpdate",
    "ServerRule",
    "elastic_difference",
]


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
    ``max|u|`` (so a commit can be applied without the lock:
    :func:`~distoptim.agn.center_guard.apply_unlocked`)."""
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
        buffer_size = check_int("buffer_size", buffer_size, 1)
        defaults = {
            "lr": check_real("lr", lr, 0.0),
            "momentum": check_real("momentum", momentum, 0.0, 1.0, high_open=True),
            "buffer_size": buffer_size,
            "activation": check_real(
                "activation (the paper's c, in [0, 1/buffer_size])",
                activation,
                0.0,
                1 / buffer_size,
            ),
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
