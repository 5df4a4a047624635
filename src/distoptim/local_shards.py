"""What one process holds of a parameter laid out by ``torch.distributed.tensor`` (FSDP2
``fully_shard``, tensor parallelism, any ``DeviceMesh``), and the mesh dimension that runs across
replica groups.

Neutral ground for every wrapper that averages a replica group's model with other groups --
the outer family (:mod:`distoptim.outer.groups`) and ``CrossShardOptimizer`` across replica
groups (HSDP, :mod:`distoptim.sync.local_grads`): the layout lives in the tensor (as torchft's
``local_sgd`` keeps it), so a wrapper works on ``p.to_local()`` / ``p.grad.to_local()`` and
rebuilds a ``DTensor`` of the parameter's mesh and placements around a result
(:func:`like_param`, no communication). A plain tensor is its own local view.

* :func:`is_dtensor`, :func:`local_view`, :func:`like_param` -- the local tensor and back;
* :func:`resolve_group` -- ``group=`` as a ``DeviceMesh``: a 1-D mesh is its group, a mesh of
  several dimensions gives its dimension named ``"replicate"`` (or ``"dp_replicate"``);
* :func:`sharded_ranks` -- the global ranks the parameters' meshes cover (checked: all
  ``DTensor`` or none, one set of ranks), or ``None`` for plain parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "REPLICATE_DIMS",
    "is_dtensor",
    "like_param",
    "local_view",
    "resolve_group",
    "sharded_ranks",
]

REPLICATE_DIMS = ("replicate", "dp_replicate")
"""Names of the mesh dimension across replica groups, when ``group=`` is a mesh of several."""


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a sharded or replicated piece)."""
    if not isinstance(t, torch.Tensor) or not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_view(p: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``p``: a ``DTensor``'s local tensor, else ``p`` itself.

    The result aliases ``p``'s storage (in-place writes change ``p``). Take it anew at each use:
    FSDP2 may replace a parameter's local tensor object (its lazy initialisation re-pads it).
    """
    if is_dtensor(p):
        with torch.no_grad():
            return p.to_local()
    return p


def like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` (shaped like ``local_view(p)``) as ``p``'s kind: a ``DTensor`` of ``p``'s mesh,
    placements, global shape and stride around ``t`` (no communication, no copy), or ``t``."""
    if not is_dtensor(p):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )


def resolve_group(owner: str, group: Any) -> Any:
    """``group=`` as DiLoCo takes it: a ``DeviceMesh`` becomes the process group of its
    cross-group dimension; anything else is returned as it is (checked elsewhere)."""
    if not dist.is_available():
        return group
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(group, DeviceMesh):
        return group
    if group.ndim == 1:
        return group.get_group()
    names = tuple(group.mesh_dim_names or ())
    found = [n for n in names if n in REPLICATE_DIMS]
    if len(found) != 1:
        raise ValueError(
            f"{owner}: group is a {group.ndim}-D DeviceMesh with dimensions {names or 'unnamed'}; "
            "say which dimension runs across the replica groups: name exactly one dimension "
            f"{' or '.join(map(repr, REPLICATE_DIMS))} (init_device_mesh(..., "
            "mesh_dim_names=('replicate', 'shard'))), or pass that dimension's 1-D mesh, "
            "group=mesh['<name>']"
        )
    return group.get_group(found[0])


def sharded_ranks(owner: str, params: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
    """The global ranks the ``DTensor`` parameters' meshes cover (the largest mesh; every other
    one lies inside it), or ``None`` when no parameter is a ``DTensor``.

    Raises ``ValueError`` when some parameters are ``DTensor``s and others plain, or when their
    meshes cover different processes (a replica group's parameters live on one set of ranks).
    """
    sharded = [p for p in params if is_dtensor(p)]
    if not sharded:
        return None
    if len(sharded) != len(params):
        plain = [tuple(p.shape) for p in params if not is_dtensor(p)]
        raise ValueError(
            f"{owner}: {len(sharded)} parameters are DTensors and {len(plain)} are plain "
            f"tensors (shapes {plain[:5]}): inside a replica group every parameter must be "
            "laid out by the same wrapper (fully_shard or parallelize_module over the whole "
            "model)"
        )
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in sharded}
    ranks = max(meshes, key=len)
    if any(not set(m) <= set(ranks) for m in meshes):
        raise ValueError(
            f"{owner}: the parameters' DTensor meshes cover different processes "
            f"({sorted(meshes)}): a replica group's parameters must live on one set of ranks"
        )
    return ranks
