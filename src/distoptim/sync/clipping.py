"""Clipping the *reduced* gradient by its global norm: ``CrossShardOptimizer(max_grad_norm=)``.

Owns :class:`GradClip`, the rule of ``torch.nn.utils.clip_grad_norm_`` applied to the gradient
every replica agreed on, right before the wrapped optimizer's step -- where DDP users call
``clip_grad_norm_`` (after ``backward()``, whose reduction DDP already ran). For the gradients
``g_1 .. g_k`` the step will apply (parameters without one are left out)::

    total = || (||g_1||_2, ..., ||g_k||_2) ||_2          (torch.nn.utils.get_total_norm)
    coef  = min(1, max_norm / (total + 1e-6))
    g_i  <- g_i * coef                                    (torch.nn.utils.clip_grads_with_norm_)

* **Whole gradients** (the default and bucket views): :meth:`GradClip.clip` calls
  ``clip_grad_norm_`` itself on the parameters in the optimizer's order, so ``backward();
  step()`` with ``max_grad_norm=c`` equals DDP's ``backward(); clip_grad_norm_(params, c);
  step()`` bit for bit (the reduced gradients are DDP's, and the same kernels clip them).
* **Shards** (weight-update sharding): each rank holds ``1/n`` of every bucket's reduced
  gradient, padding zeros included. :meth:`GradClip.clip_shards` sums the squared norms of this
  rank's shards, adds every rank's with one scalar all-reduce (``total^2 = sum_r sum_b
  ||shard_rb||^2``), and scales every shard by the same ``coef`` -- the unsharded clip up to the
  summation order of the norm.

Like ``clip_grad_norm_`` (``error_if_nonfinite=False``), a non-finite total norm makes the
gradients non-finite; nothing else is checked here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["EPS", "GradClip"]

EPS = 1e-6
"""Added to the total norm before dividing (``clip_grad_norm_``'s constant)."""


class GradClip:
    """Clip reduced gradients to a global L2 norm of at most ``max_norm``."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def clip(self, params: Sequence[torch.Tensor]) -> None:
        """``clip_grad_norm_(params, max_norm)`` on their ``.grad`` (None skipped)."""
        if any(p.grad is not None for p in params):
            torch.nn.utils.clip_grad_norm_(params, self.max_norm)

    def clip_shards(
        self,
        shards: Sequence[torch.Tensor],
        sum_across: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Scale this rank's reduced ``shards`` so the whole gradient's norm is ``<= max_norm``.

        ``sum_across(t)``: ``t`` (one float64 element) summed over every rank of the group (a
        collective: every rank calls this in the same round).
        """
        live = [s for s in shards if s.numel()]
        device = live[0].device if live else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for s in live:
            squares += torch.linalg.vector_norm(s, dtype=torch.float64).to(device).square()
        total = sum_across(squares.reshape(1)).sqrt()
        coef = torch.clamp(self.max_norm / (total + EPS), max=1.0)
        for s in live:
            s.mul_(coef.to(device=s.device, dtype=s.dtype))
