"""Replica groups of many processes: what one process holds of its group's model, and how the
outer family learns the group's size and what keeps the group one model.

Owns the layout side of DiLoCo / LocalSGD / Streaming DiLoCo (``docs/groups.md``):

* **local shards** -- a parameter that is a ``DTensor`` (FSDP2 ``fully_shard``: ``Shard(0)``;
  tensor parallelism: ``Shard(1)`` / ``Replicate``; any mesh) is held by this process as its
  local tensor (:func:`local_view`, which aliases the parameter's storage: writing it writes the
  parameter); everything the outer family keeps per parameter -- the global copy, the bucket
  buffers, the error-feedback residuals -- is shaped like that local tensor, and a gradient
  handed to the outer optimizer is rebuilt as a ``DTensor`` of the parameter's mesh and
  placements around the averaged local tensor (:func:`like_param`, no communication), so the
  outer optimizer's state is a local-shard ``DTensor`` too. A plain tensor is its own local
  view: nothing changes for it. (These helpers live in :mod:`distoptim.local_shards`, shared
  with ``CrossShardOptimizer`` across replica groups; re-exported here.)
* **the cross-group channel** -- :func:`resolve_group`: ``group=`` may be a ``DeviceMesh``; a
  1-D mesh is its group, a mesh of several dimensions gives its dimension named ``"replicate"``
  (or ``"dp_replicate"``, torchtitan's name).
* **the group's layout** -- :func:`group_layout`: how many processes hold one replica (``k``)
  and what keeps them one model, learned from, in this order: the parameters' ``DTensor``
  meshes (the group shards the model: every process holds its own piece); ``model=`` a
  ``DistributedDataParallel`` module (its process group all-reduces the gradients); ``inner``
  a ``CrossShardOptimizer`` (its group does). Nothing of these: ``k = 1``, each process is a
  replica of its own. Under a torchft manager the replica group has the manager's
  ``WORLD_SIZE`` processes (:func:`manager_group_size`), and a layout of another size fails at
  construction, naming what to wrap -- DiLoCo over a plain model on a group of ``k > 1``
  processes that nothing reduces inside would end with ``k`` different models. Without a
  manager, the processes of one group must not be among the replicas a process averages with
  (:func:`check_disjoint`): averaging one process's shard with another shard of the same
  model mixes different parameters.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import type_name
from distoptim.local_shards import (
    REPLICATE_DIMS,
    is_dtensor,
    like_param,
    local_view,
    resolve_group,
    sharded_ranks,
)

__all__ = [
    "REPLICATE_DIMS",
    "GroupLayout",
    "check_disjoint",
    "combine_checksums",
    "group_layout",
    "is_dtensor",
    "like_param",
    "local_view",
    "manager_group_size",
    "resolve_group",
    "within_group",
]


@dataclass(frozen=True)
class GroupLayout:
    """How one replica group holds its model.

    ``size``: ``k``, the processes holding one replica; ``kind``: what keeps them one model --
    ``"sharded"`` (``DTensor`` parameters: each process its own piece), ``"ddp"``,
    ``"cross-shard"`` (both: full copies, gradients all-reduced inside the group) or
    ``"single"`` (``k = 1``); ``ranks``: the group's global ranks (``None``: unknown, e.g.
    outside ``torch.distributed``).
    """

    size: int
    kind: str
    ranks: tuple[int, ...] | None

    @property
    def sharded(self) -> bool:
        """Whether processes of the group hold different pieces of each parameter."""
        return self.kind == "sharded"

    def options(self, local: Sequence[torch.Tensor]) -> dict[str, str]:
        """What the sync header's plan fingerprint adds for a group of several processes: the
        layout and a digest of this process's local shapes, so counterparts laid out
        differently (their payloads would not pair) fail the header by name. Nothing for
        ``k = 1`` (a one-process replica's fingerprint is unchanged)."""
        if self.size == 1:
            return {}
        shapes = hashlib.blake2b(repr([tuple(t.shape) for t in local]).encode(), digest_size=8)
        return {"group_layout": f"{self.kind} over {self.size}, local {shapes.hexdigest()}"}


def manager_group_size(manager: Any) -> int:
    """The processes of this torchft replica group (``torchft.Manager``'s ``world_size``, read
    from ``WORLD_SIZE`` when not given; torchft keeps it as ``_group_world_size``)."""
    size = getattr(manager, "_group_world_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise TypeError(
            f"this torchft.Manager has no usable replica-group size (_group_world_size = "
            f"{size!r}): the installed torchft is not one distoptim knows"
        )
    return size


def _world_ranks(pg: Any) -> tuple[int, ...] | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return (
        tuple(dist.get_process_group_ranks(pg))
        if pg is not None
        else tuple(range(dist.get_world_size()))
    )


def group_layout(owner: str, params: Sequence[torch.Tensor], inner: Any, model: Any) -> GroupLayout:
    """The layout of this process's replica group (see the module), checked.

    Raises ``TypeError`` for a ``model`` that is not an ``nn.Module``, ``ValueError`` for a
    ``model`` that does not hold ``inner``'s parameters or whose parameters are not all laid
    out alike (``DTensor`` and plain mixed; meshes of different ranks).
    """
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{owner}: model must be a torch.nn.Module, got {type_name(model)}")
        held = {id(p) for p in model.parameters()}
        missing = [tuple(p.shape) for p in params if id(p) not in held]
        if missing:
            raise ValueError(
                f"{owner}: model must hold the inner optimizer's parameters; {len(missing)} of "
                f"them (shapes {missing[:5]}) are not model.parameters()"
            )
    ranks = sharded_ranks(owner, params)
    if ranks is not None:
        return GroupLayout(len(ranks), "sharded", ranks)
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        pg = model.process_group
        ranks = _world_ranks(pg)
        return GroupLayout(dist.get_world_size(pg), "ddp", ranks)
    from distoptim.sync.optimizer import CrossShardOptimizer

    if isinstance(inner, CrossShardOptimizer) and inner.num_shards > 1:
        assignment = inner.group_assignment
        ranks: tuple[int, ...] | None = None
        if dist.is_available() and dist.is_initialized():
            me = dist.get_rank()
            ranks = (
                tuple(range(dist.get_world_size()))
                if assignment is None
                else next(tuple(g) for g in assignment if me in g)
            )
        return GroupLayout(inner.num_shards, "cross-shard", ranks)
    me = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return GroupLayout(1, "single", (me,))


_WRAP = (
    "shard it with FSDP2 (fully_shard(model, mesh=<the group's mesh>)) or tensor parallelism "
    "(parallelize_module), or wrap it in DistributedDataParallel over the group and pass "
    "model=<the DDP module>, or use a CrossShardOptimizer over the group as inner"
)


def check_manager_layout(owner: str, layout: GroupLayout, manager: Any) -> None:
    """Under a torchft manager the replica group is the manager's ``WORLD_SIZE`` processes: the
    layout must hold exactly one model over them."""
    k = manager_group_size(manager)
    if layout.size == k:
        return
    if layout.size == 1:
        raise ValueError(
            f"{owner}: this torchft replica group has {k} processes (the manager's "
            f"WORLD_SIZE), but nothing makes them one model: the parameters are plain tensors "
            f"and nothing reduces gradients inside the group, so the group would end with {k} "
            f"different models. To train one model per group, {_WRAP}; or run one process per "
            "replica group"
        )
    raise ValueError(
        f"{owner}: this torchft replica group has {k} processes (the manager's WORLD_SIZE), but "
        f"the model is held by {layout.size} ({layout.kind}, ranks {layout.ranks}): the "
        f"wrapper inside the group must span the whole group ({_WRAP})"
    )


def check_disjoint(owner: str, layout: GroupLayout, replicas: Sequence[int] | None) -> None:
    """Without a manager: the processes this one averages with (``replicas``, global ranks,
    itself included) must hold the same piece in other groups, never another piece of its own
    group's model."""
    if layout.ranks is None or replicas is None or layout.size == 1:
        return
    me = dist.get_rank()
    shared = sorted((set(layout.ranks) & set(replicas)) - {me})
    if not shared:
        return
    raise ValueError(
        f"{owner}: rank {me} would average with ranks {shared}, which hold the same replica "
        f"(its {layout.kind} group is ranks {list(layout.ranks)}): group= must be the "
        "cross-group process group -- this process and its counterpart in every other replica "
        "group -- e.g. group=mesh with mesh_dim_names=('replicate', 'shard') and the model "
        "sharded over mesh['shard'], or a group_assignment like [[0, 2], [1, 3]] for 2 groups "
        "of 2 processes"
    )


def within_group(layout: GroupLayout) -> Any:
    """The process group of the replica group's own processes (``None`` for ``k = 1``).

    Made by those processes only (``use_local_synchronization``): it is collective over the
    group, as DiLoCo's construction is. The default group when the group is the whole world
    (one torchrun job per replica group, as torchft runs them).
    """
    if layout.size == 1 or layout.ranks is None:
        return None
    if len(layout.ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(ranks=list(layout.ranks), use_local_synchronization=True)


def combine_checksums(state: int, group: Any, owner: str = "DiLoCo", step: int = -1) -> int:
    """The replica group's state checksum: the 64-bit checksum of its processes' checksums in
    group-rank order (all-gathered over ``group``, bounded by its timeout). Equal in two groups
    iff every process equals its counterpart (up to checksum collisions); the same on every
    process of a group.

    Raises ``DesyncError`` naming this process's group rank when the all-gather fails: another
    process of this replica group died or stopped (the other replica groups are not part of
    this collective), and a group that lost a process cannot go on -- it must be restarted
    whole (``docs/fault_tolerance.md``)."""
    from distoptim.comm.checksum import state_checksum
    from distoptim.comm.groups import comm_device
    from distoptim.comm.guard import DesyncError

    words = torch.tensor([state >> 32, state & 0xFFFFFFFF], dtype=torch.int64)
    words = words.to(comm_device(group))
    size = dist.get_world_size(group)
    table = words.new_empty(2 * size)
    try:
        dist.all_gather_single(table, words, group=group)
    except RuntimeError as exc:
        raise DesyncError(
            f"{owner}: rank {dist.get_rank(group)} of its replica group ({size} processes): "
            f"the group's state checksum of step {step} (an all-gather over the group's own "
            "processes, before the sync's header) failed: another process of this replica "
            "group died or stopped. A replica group that lost a process is dead: end its "
            "other processes and start the whole group again (under torchrun, kill its "
            "workers by their process ids); the other groups go on, and the restarted "
            "group's processes heal from their counterparts.\n(the collective said: "
            f"{type(exc).__name__}: {str(exc).strip()})"
        ) from exc
    return state_checksum([table.cpu()])
