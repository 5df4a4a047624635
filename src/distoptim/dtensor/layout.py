"""The one rule by which the mesh-aware SGD reaches a DTensor's local shard, and its layout.

Owns: :func:`local_shard` (the tensor the update, the clipping norms and the EMA read and write
in place) and :func:`layout_of` (the ``(mesh, placements)`` key that groups tensors whose
local shards can be updated together and whose norms are reduced over the same mesh).

A DTensor's local shard is ``DTensor.to_local()`` under ``no_grad``: the very tensor the DTensor
stores (``_local_tensor``), so writing into it updates the DTensor. The helper reads that
attribute directly (``to_local`` would wrap an ``nn.Parameter``'s shard in a fresh view on every
call) and, when a redistribute left an ``AsyncCollectiveTensor`` there, waits for the collective
first. ``tests/dtensor/test_layout.py`` pins both facts against the installed torch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["Layout", "layout_of", "local_shard"]

Layout = tuple[DeviceMesh, tuple[Any, ...]] | None
"""``(mesh, placements)`` of a DTensor, or ``None`` for a plain (process-local) tensor."""


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a DTensor (sharing its storage), or ``t`` itself if plain.

    Any collective still in flight for the shard (a redistribute's ``AsyncCollectiveTensor``)
    is completed first, so the returned tensor can be read and written in place.
    """
    if not isinstance(t, DTensor):
        return t
    loc = t._local_tensor
    if type(loc) is not torch.Tensor:
        wait = getattr(loc, "wait", None)
        if callable(wait):
            loc = wait()
    return loc


def layout_of(t: torch.Tensor) -> Layout:
    """``(mesh, placements)`` of a DTensor, ``None`` for a plain tensor."""
    return (t.device_mesh, tuple(t.placements)) if isinstance(t, DTensor) else None
