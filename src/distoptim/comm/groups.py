"""Groups of replicas: the ``group_assignment`` rule, and where a group's control messages live.

Owns what every synchronous optimizer (CrossShardOptimizer, DiLoCo and its family) needs to know
about the process group its replicas reduce over: TF's ``group_assignment`` rule (as
``tpu.cross_replica_sum`` states it: equal-size subgroups that partition ``range(world_size)``),
and the device of small control messages (the sequence guard's words, sync headers): the
current GPU under NCCL, the CPU otherwise.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from distoptim import checks

__all__ = ["check_group_assignment", "comm_device"]


def _is_sequence(value: object) -> bool:
    """A list, tuple, range or 1-/2-D numpy array (not a string, not a tensor)."""
    return isinstance(value, (list, tuple, range, np.ndarray)) and not (
        isinstance(value, np.ndarray) and value.ndim == 0
    )


def check_group_assignment(value: object, world_size: int | None) -> list[list[int]] | None:
    """Validate ``group_assignment`` (TF's ``tpu.cross_replica_sum`` rules: equal-size groups
    partitioning ``range(world_size)``); ``world_size=None``: form only.

    Groups may be lists, tuples, ranges or numpy arrays; ranks any integer type (numpy too).
    """
    if value is None:
        return None
    if not _is_sequence(value) or len(value) == 0:  # type: ignore[arg-type]
        raise ValueError(
            "group_assignment must be a non-empty list of lists of ranks, e.g. [[0, 1], [2, 3]]; "
            f"got {value!r}"
        )
    groups: list[list[int]] = []
    for i, g in enumerate(value):  # type: ignore[arg-type]
        if not _is_sequence(g) or len(g) == 0:
            raise ValueError(
                f"group_assignment must be a list of non-empty lists; entry {i} is {g!r}"
            )
        groups.append([checks.check_int(f"group_assignment[{i}] ranks", r, 0) for r in g])
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(
            f"group_assignment subgroups must all have the same size, got sizes "
            f"{[len(g) for g in groups]}"
        )
    flat = [r for g in groups for r in g]
    dupes = sorted({r for r in flat if flat.count(r) > 1})
    if dupes:
        raise ValueError(f"group_assignment lists rank(s) {dupes} more than once")
    expected = world_size if world_size is not None else len(flat)
    bad = sorted(r for r in flat if r >= expected)
    if bad:
        raise ValueError(f"group_assignment has rank(s) {bad} outside range(world_size={expected})")
    missing = sorted(set(range(expected)) - set(flat))
    if missing:
        raise ValueError(
            f"group_assignment must cover every rank of range(world_size={expected}); "
            f"missing {missing}"
        )
    return groups


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where small control messages live: the current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
