"""LocalSGD: every replica steps on its own, and every ``H`` steps the replicas average parameters.

Owns LocalSGD's definition as the simplest member of the outer-optimizer family (Stich 2019,
"Local SGD Converges Fast and Communicates Little", arXiv 1805.09767; Lin et al. 2020, "Don't
Use Large Mini-Batches, Use Local SGD", arXiv 1808.07217): DiLoCo whose outer optimizer is
plain SGD with learning rate 1, since

    θ_g' = θ_g - 1 · mean_r (θ_g - θ_r) = mean_r θ_r

(up to floating-point rounding), so after each sync every replica holds the average of the
replicas' parameters. Sending ``θ_g - θ_r`` costs the same bytes as sending ``θ_r``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from distoptim.checks import type_name
from distoptim.outer.diloco import DiLoCo

__all__ = ["LocalSGD"]


class LocalSGD(DiLoCo):
    """Run ``inner`` locally; every ``sync_every`` steps replace the parameters by their mean.

    ``group``, ``manager`` (a torchft manager: fault-tolerant replicas) and ``model`` (what
    keeps a replica group of several processes one model) as in :class:`DiLoCo` (default:
    all ranks, each a replica of its own; see ``docs/groups.md``). DTensor parameters (FSDP2,
    tensor parallelism) average their local shards. The global copy DiLoCo keeps is the
    last average (one extra copy of the parameters); ``outer`` is an internal
    ``torch.optim.SGD(lr=1.0)`` without state.
    """

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        sync_every: int,
        group: Sequence[Sequence[int]] | dist.ProcessGroup | None = None,
        name: str = "LocalSGD",
        *,
        manager: Any = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"LocalSGD wraps a torch.optim.Optimizer, got {type_name(inner)}")
        params = [p for g in inner.param_groups for p in g["params"]]
        outer = torch.optim.SGD(params, lr=1.0)
        super().__init__(
            inner, outer, sync_every, group=group, name=name, manager=manager, model=model
        )

    def __repr__(self) -> str:
        return (
            f"LocalSGD({self.wrapped!r}, sync_every={self.sync_every}, "
            f"num_replicas={self.num_replicas})"
        )
