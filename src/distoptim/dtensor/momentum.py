"""Keras' momentum kept in torch's buffer units, so that one fused pass does Keras' update.

Owns: the scale ``s`` that relates a variable's stored buffer ``b`` to Keras' momentum
``v = s * b``, how ``s`` moves from step to step, and the exact :class:`KernelParams` that make
the torch-form kernel (:mod:`distoptim.dtensor.kernels`) perform Keras' step.

Keras' step, with learning rate ``lr`` and momentum ``μ``::

    v' = μ v - lr g
    w' = w + μ v' - lr g            (nesterov)       w' = w + v'      (otherwise)

The kernel's step with parameters ``(μk, d, L)``: ``b' = μk b + (1-d) g`` and
``w' = w - L (g + μk b')`` (nesterov) or ``w' = w - L b'``. Writing ``v = s b`` before and
``v' = s' b'`` after the step, Keras' step is the kernel's exactly when

    μk = μ s / s',    1 - d = -lr / s',    and    L = lr, L μk = -μ s'   (nesterov)
                                                  L = -s'                (otherwise)

Nesterov fixes ``s'^2 = -lr s``: the new scale is ``s' = -sqrt(lr * -s)`` (both negative, so
``μk > 0``). For a constant ``lr`` the fixed point is ``s = -lr``, where ``μk = μ``, ``d = 0``,
``L = lr``: torch's own momentum buffer (``v = -lr * b``) and torch's fused Nesterov SGD, bit
for bit. When ``lr`` changes the scale follows it (the geometric mean of the old scale and the
new rate) -- no extra pass over the buffers, and no approximation: the identities above hold
for any ``lr``. The same scale rule serves the plain momentum form (any ``s'`` works there).

Two special cases keep the rule total:

* ``s == 0`` marks a buffer that was never stepped (all zeros, ``v = 0`` whatever ``s``): the
  step starts the buffer at the fixed point ``s' = -lr``.
* ``lr == 0`` keeps the scale (``s' = s``, ``d = 1``); Keras' Nesterov step is then
  ``w' = w + μ v'``, the kernel's plain form with ``L = -μ s``.

The parameters are computed in float64; the kernel rounds them to the tensors' dtype, as it
rounds torch's own hyperparameters. A variable's scale lives in its optimizer state next to
the buffer (:data:`BUFFER`, :data:`SCALE`); :func:`velocity` gives Keras' ``v``.
"""

from __future__ import annotations

import math

import torch

from distoptim.dtensor.kernels import KernelParams

__all__ = ["BUFFER", "INTERNAL_KEYS", "SCALE", "keras_step", "next_scale", "velocity"]

BUFFER = "momentum_buffer"
"""Optimizer-state key of a variable's momentum buffer (torch's units)."""
SCALE = "momentum_scale"
"""Optimizer-state key of the float ``s`` with Keras' ``v = s * buffer``."""
INTERNAL_KEYS = frozenset({BUFFER, SCALE})
"""State keys that are never slots and never appear in a state dict (Keras' ``v`` does)."""


def next_scale(scale: float, lr: float) -> float:
    """The buffer's scale after a step at ``lr`` (see the module docstring)."""
    if lr == 0.0:
        return scale
    if scale == 0.0 or scale == -lr:
        return -lr
    new = -math.sqrt(lr * -scale)
    # Within float64 rounding of the fixed point: land on it (and stay there exactly).
    return -lr if abs(new + lr) <= 4 * math.ulp(lr) else new


def keras_step(
    lr: float, momentum: float, nesterov: bool, scale: float, new_scale: float
) -> KernelParams:
    """The kernel parameters of Keras' step from ``v = scale * b`` to ``v' = new_scale * b'``.

    ``new_scale`` must be :func:`next_scale` ``(scale, lr)``. With ``momentum == 0`` there is
    no buffer: ``w -= lr * g``.
    """
    if momentum == 0.0:
        return KernelParams(momentum=0.0, dampening=0.0, lr=lr, nesterov=False)
    if lr == 0.0:  # b' = μ b, w' = w + μ v' (nesterov) or w + v'
        return KernelParams(
            momentum=momentum,
            dampening=1.0,
            lr=-momentum * scale if nesterov else -scale,
            nesterov=False,
        )
    mu_k = momentum if scale == 0.0 else momentum * (scale / new_scale)
    return KernelParams(
        momentum=mu_k,
        dampening=1.0 + lr / new_scale,
        lr=lr if nesterov else -new_scale,
        nesterov=nesterov,
    )


def velocity(buffer: torch.Tensor, scale: float) -> torch.Tensor:
    """Keras' momentum ``v = scale * buffer`` as a new tensor (DTensor in, DTensor out)."""
    return buffer * scale
