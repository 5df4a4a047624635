"""The weight averages of the mesh-aware SGD (:class:`~distoptim.dtensor.options.EMAOption`).

Owns: updating the ``"average"`` slots and writing them into the weights, on local shards,
one foreach call per (device, dtype):

* :func:`update_averages`: ``avg = avg + (1 - μ) (w - avg)`` (= ``μ avg + (1 - μ) w``, as a
  lerp) for the given pairs;
* :func:`overwrite_with_averages`: ``w = avg`` for the given pairs.

The optimizer passes exactly the variables that got a gradient in the step (Keras' rule: a
variable without one keeps its average and is not overwritten), and every variable for
``finalize_variable_values``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from distoptim.dtensor.layout import local_shard

__all__ = ["overwrite_with_averages", "update_averages"]

Pairs = Iterable[tuple[torch.Tensor, torch.Tensor]]
"""``(weight, average)`` pairs: tensors or DTensors with the same layout."""


def _buckets(pairs: Pairs) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    out: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
    for w, avg in pairs:
        lw = local_shard(w)
        ws, avgs = out.setdefault((lw.device, lw.dtype), ([], []))
        ws.append(lw)
        avgs.append(local_shard(avg))
    return list(out.values())


def update_averages(pairs: Pairs, ema_momentum: float) -> None:
    """``avg += (1 - ema_momentum) * (w - avg)`` in place, for every pair."""
    for ws, avgs in _buckets(pairs):
        torch._foreach_lerp_(avgs, ws, 1.0 - ema_momentum)


def overwrite_with_averages(pairs: Pairs) -> None:
    """``w = avg`` in place, for every pair."""
    for ws, avgs in _buckets(pairs):
        torch._foreach_copy_(ws, avgs)
