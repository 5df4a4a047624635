"""CrossShardOptimizer under a torchft manager across replica groups of FSDP2 shards (HSDP).

Owns what ``CrossShardOptimizer(opt, manager=m)`` does when ``opt``'s parameters are
``DTensor``s -- the layout torchtitan trains with under torchft: FSDP2 (or any mesh) inside a
replica group of ``k`` processes, the manager's replicate dimension across the groups. Each
process of a group has its own ``torchft.Manager`` (the group's ``replica_id``, its group
rank, the group's ``world_size``), as torchft runs them, and torchft connects equal group ranks
across groups, so the manager's collectives pair each process with its counterparts: the
processes holding the same piece of the model.

* **no round inside the group** -- FSDP2 already reduce-scattered the gradient inside the group
  in ``backward()``: ``p.grad``'s local tensor is this process's ``1/k`` piece of the group's
  mean gradient. The optimizer's replicas are this process alone; a step packs
  the local shards of ``.grad`` (:mod:`distoptim.sync.local_grads`), the manager averages them
  with the counterparts' (:mod:`distoptim.sync.replicated`), and the inner step runs on the
  averaged pieces as ``DTensor`` gradients -- the arithmetic of ``group=mesh`` without a
  manager (see ``docs/cross_shard.md``).
* **the group's state check** -- every commit's words carry the state checksum of the
  *group*: each process's checksum of its shards, all-gathered over the group's own processes
  in group-rank order and checksummed again
  (:func:`~distoptim.outer.groups.combine_checksums`, DiLoCo's rule). Two groups' words agree
  iff every process equals its counterpart, and every process of a group carries the same
  word, so a process whose shard drifted is refused on every process of every group alike (not
  only on its counterparts) (:func:`group_checksum` over :func:`group_of_shards`).
* **checks** (:func:`distoptim.checks.check_managed_shards`) -- the manager's replica group
  must hold exactly the processes the parameters' meshes cover (``k``), and
  ``group_assignment=`` (a channel inside the group) cannot be combined with it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["group_checksum", "group_of_shards"]


def group_of_shards(ranks: tuple[int, ...] | None) -> Any:
    """The process group of this replica group's own processes (``None``: one process, or
    plain parameters): the default group when it is the whole world (one job per group, as
    torchft runs them), else a new group of those ranks only (collective over them)."""
    if ranks is None or len(ranks) == 1:
        return None
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(ranks=list(ranks), use_local_synchronization=True)


def group_checksum(state: int, group: Any, owner: str, step: int) -> int:
    """This process's state checksum combined with its group's (``group``: from
    :func:`group_of_shards`; ``None``: ``state`` as it is). A collective over the group: every
    process of it calls this in the same round. Raises ``DesyncError`` when another process of
    the group died or stopped (the group must then be restarted whole)."""
    if group is None:
        return state
    from distoptim.outer.groups import combine_checksums

    return combine_checksums(state, group, owner, step)
