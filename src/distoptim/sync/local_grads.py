"""CrossShardOptimizer across replica groups whose model is sharded inside each group (HSDP).

Owns what the synchronous path does with ``DTensor`` parameters (FSDP2 ``fully_shard``'s
``Shard(0)``, tensor parallelism, any mesh), the layout living in the tensor as the outer family
keeps it (:mod:`distoptim.local_shards`):

* after ``backward()`` FSDP2 has reduce-scattered the gradient inside the group, so
  ``p.grad`` is a ``DTensor`` whose local tensor is this process's ``1/k`` piece of the group's
  mean gradient. The buckets are laid out by the parameters' *local* shapes
  (:class:`~distoptim.comm.bucket.BucketPlan` reads :func:`~distoptim.local_shards.local_view`),
  a round packs :func:`local_grad` and all-reduces it over the **cross-group** channel -- this
  process and its counterpart (the process holding the same piece) in every other group -- and
  the inner ``opt.step()`` sees the averaged piece as a ``DTensor`` of the parameter's mesh and
  placements (:func:`as_grad_of`, no communication), so it steps on ``DTensor`` parameters as
  it would under FSDP2 alone. Each process sends ``2 (n - 1) / n`` of its ``1/k`` of the
  gradient bytes: a group of ``k`` sends what one unsharded process sends.
* :func:`cross_group` -- ``group=`` as the constructor takes it: a ``DeviceMesh`` (a 1-D mesh,
  or the dimension named ``"replicate"`` / ``"dp_replicate"`` of a mesh of several) or a
  ``ProcessGroup``; :func:`replica_ranks` -- the global ranks this process would average with,
  known before any subgroup is created, for the construction checks
  (:func:`distoptim.checks.check_cross_group`).

A plain tensor is its own local view: nothing changes for plain parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import type_name
from distoptim.local_shards import is_dtensor, like_param, resolve_group

__all__ = ["as_grad_of", "cross_group", "local_grad", "replica_ranks"]


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """What this process holds of ``p.grad``: a ``DTensor``'s local tensor, else ``p.grad``."""
    g = p.grad
    if g is not None and is_dtensor(g):
        return g.to_local()
    return g


def as_grad_of(g: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A reduced gradient ``g`` (shaped like ``p``'s local tensor) as ``.grad`` of ``p``: in
    the local tensor's dtype and device, wrapped as a ``DTensor`` of ``p``'s layout when ``p``
    is one (a ``DTensor`` ``g`` -- one shard's own ``.grad`` -- is returned as it is)."""
    if is_dtensor(g):
        return g
    if not is_dtensor(p):
        return g.to(dtype=p.dtype, device=p.device)
    local = p.to_local()
    return like_param(g.to(dtype=local.dtype, device=local.device), p)


def cross_group(owner: str, group: Any) -> Any:
    """``group=``: ``None``, a ``ProcessGroup``, or a ``DeviceMesh`` (resolved to its
    cross-group dimension's group). Raises ``TypeError`` / ``ValueError`` (nothing created)."""
    if group is None:
        return None
    if not dist.is_available():
        raise TypeError(f"{owner}: group= needs torch.distributed, got {type_name(group)}")
    resolved = resolve_group(owner, group)
    if not isinstance(resolved, dist.ProcessGroup):
        raise TypeError(
            f"{owner}: group must be a DeviceMesh (its 'replicate' dimension: the cross-group "
            f"channel) or a torch.distributed.ProcessGroup, got {type_name(group)}"
        )
    return resolved


def replica_ranks(groups: Sequence[Sequence[int]] | None, pg: Any) -> list[int] | None:
    """The global ranks this process's gradients are averaged with (itself included): its
    subgroup of ``groups``, ``pg``'s ranks, or the world; ``None`` outside a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if pg is not None:
        return list(dist.get_process_group_ranks(pg))
    if groups is not None:
        me = dist.get_rank()
        return next(list(g) for g in groups if me in g)
    return list(range(dist.get_world_size()))
