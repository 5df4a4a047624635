"""Gradient clipping with mesh-correct norms: per-tensor norm, global norm, value.

Owns: the norms of *logical* gradients when each process only holds a local shard, and the
three clipping rules of :class:`~distoptim.dtensor.options.GradientsClipOption` (one applies:
the first set of clipnorm, global_clipnorm, clipvalue -- Keras' order).

How a norm counts every logical element exactly once
----------------------------------------------------
A DTensor's local shard is one block of the logical tensor. Along a ``Shard`` mesh dimension
the blocks are disjoint; along a ``Replicate`` mesh dimension they are copies. So the local
sum of squares is *owned* by a rank only if its coordinate is 0 on every ``Replicate`` mesh
dimension (the other replicas contribute 0); summing the owned contributions over all ranks of
the mesh gives the logical sum of squares exactly -- no division by a replica count, so no
rounding. The per-tensor contributions of one step travel in a single vector:

* all DTensors on one mesh: one ``all_reduce(SUM)`` per mesh dimension (its process group);
* DTensors on several meshes: one ``all_reduce(SUM)`` over the default process group (a rank
  outside a mesh holds an empty shard and contributes 0), so every rank of the default group
  must take part in the step -- the usual SPMD contract.

Plain tensors are local to their process and are never reduced. ``Partial`` gradients must
be redistributed first (the optimizer does it); a ``Partial`` layout here is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from distoptim.dtensor.layout import Layout, layout_of, local_shard
from distoptim.dtensor.options import GradientsClipOption

__all__ = ["clip_gradients", "clip_local_gradients", "squared_norms"]


def _owns(mesh: DeviceMesh, placements: tuple[Any, ...]) -> bool:
    """Whether this rank's local shard is the one counted for the logical tensor."""
    coord = mesh.get_coordinate()
    if coord is None:  # not in the mesh: the shard is empty anyway
        return False
    for dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(
                "cannot take the norm of a Partial DTensor gradient: redistribute it to the "
                "parameter's placements (Shard/Replicate) first"
            )
        if isinstance(p, Replicate) and coord[dim] != 0:
            return False
    return True


def squared_norms(local_grads: Sequence[torch.Tensor], layouts: Sequence[Layout]) -> torch.Tensor:
    """Squared L2 norms of the logical gradients, as one float vector (float64 if any is).

    ``local_grads[i]`` is the local shard of gradient ``i`` (the tensor itself when
    ``layouts[i]`` is None). Collective when any layout is a DTensor one (see the module
    docstring); every rank must call it with the same layouts.
    """
    if len(local_grads) != len(layouts):
        raise ValueError("local_grads and layouts must have the same length")
    n = len(local_grads)
    if n == 0:
        return torch.zeros(0)
    acc = torch.float64 if any(g.dtype == torch.float64 for g in local_grads) else torch.float32
    # Norms with foreach, one call per (device, dtype) bucket.
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(local_grads):
        buckets.setdefault((g.device, g.dtype), []).append(i)
    sq: list[torch.Tensor | None] = [None] * n
    for idx in buckets.values():
        norms = torch._foreach_norm([local_grads[i] for i in idx], 2, dtype=acc)
        for i, v in zip(idx, norms):
            sq[i] = v * v
    dt_idx = [i for i, lay in enumerate(layouts) if lay is not None]
    if not dt_idx:
        return torch.stack([s.to(local_grads[0].device) for s in sq])  # type: ignore[union-attr]
    device = local_grads[dt_idx[0]].device
    owned_cache: dict[tuple[int, tuple[Any, ...]], bool] = {}
    contrib = []
    for i in dt_idx:
        mesh, placements = layouts[i]  # type: ignore[misc]
        key = (id(mesh), tuple(placements))
        if key not in owned_cache:
            owned_cache[key] = _owns(mesh, tuple(placements))
        s = sq[i].to(device)  # type: ignore[union-attr]
        contrib.append(s if owned_cache[key] else torch.zeros_like(s))
    vec = torch.stack(contrib)
    meshes = {layouts[i][0] for i in dt_idx}  # type: ignore[index]
    if len(meshes) == 1:
        (mesh,) = meshes
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    else:
        dist.all_reduce(vec, op=dist.ReduceOp.SUM)
    out = torch.stack([s.to(device) for s in sq])  # type: ignore[union-attr]
    out[torch.tensor(dt_idx, device=device)] = vec
    return out


def _per_tensor_scale(norm: torch.Tensor, clip: float) -> torch.Tensor:
    """``clip / max(norm, clip)`` elementwise: 0 for an infinite norm (so ``g * scale`` is NaN
    only where ``g`` is infinite, Keras' ``t * clip / max(||t||, clip)``), NaN for a NaN norm."""
    return clip / torch.clamp_min(norm, clip)


def _global_scale(norm: torch.Tensor, clip: float) -> torch.Tensor:
    """``tf.clip_by_global_norm``'s factor ``clip * min(1/norm, 1/clip)``; NaN for a non-finite
    norm (``+ (norm - norm)``), so that every gradient it scales becomes NaN."""
    return clip * torch.clamp_max(1.0 / norm, 1.0 / clip) + (norm - norm)


def clip_local_gradients(
    local_grads: Sequence[torch.Tensor],
    layouts: Sequence[Layout],
    option: GradientsClipOption | None,
) -> list[torch.Tensor]:
    """The clipped gradients (new tensors; the inputs are not modified), local shards in/out.

    Rules and their order are those of :class:`GradientsClipOption`. With no active option the
    inputs are returned as they are (same objects).
    """
    grads = list(local_grads)
    if option is None or not option.active or not grads:
        return grads
    if option.rule == "clipvalue":
        c = option.clipvalue
        out = list(torch._foreach_clamp_min(grads, -c))  # type: ignore[operator]
        torch._foreach_clamp_max_(out, c)  # type: ignore[arg-type]
        return out
    sq = squared_norms(grads, layouts)
    if option.rule == "clipnorm":
        per = list(_per_tensor_scale(torch.sqrt(sq), option.clipnorm).unbind())  # type: ignore[arg-type]
    else:
        s = _global_scale(torch.sqrt(sq.sum()), option.global_clipnorm)  # type: ignore[arg-type]
        per = [s] * len(grads)
    per = [p.to(g.device) for p, g in zip(per, grads)]
    return list(torch._foreach_mul(grads, per))


def clip_gradients(
    grads: Sequence[torch.Tensor], option: GradientsClipOption | None
) -> list[torch.Tensor]:
    """:func:`clip_local_gradients` for whole tensors: plain tensors and/or DTensors.

    Returns new tensors of the same kind and layout (DTensors stay DTensors). Gradients must
    not be ``Partial``. Collective when any gradient is a DTensor.
    """
    locals_ = [local_shard(g) for g in grads]
    layouts = [layout_of(g) for g in grads]
    out = clip_local_gradients(locals_, layouts, option)
    result = []
    for g, loc in zip(grads, out):
        if isinstance(g, DTensor):
            result.append(
                DTensor.from_local(
                    loc,
                    g.device_mesh,
                    g.placements,
                    run_check=False,
                    shape=g.shape,
                    stride=g.stride(),
                )
            )
        else:
            result.append(loc)
    return result
