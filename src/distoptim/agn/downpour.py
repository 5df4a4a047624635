"""DownpourOptimizer: asynchronous DOWNPOUR SGD (Dean et al., NeurIPS 2012), a baseline for AGN.

Owns: DOWNPOUR's commit rule (the un-normalized local delta) on the shared PS machinery of
:mod:`distoptim.agn.worker`; the server rule is a plain add.
"""

from __future__ import annotations

import torch

from distoptim.agn.flat import Chunk
from distoptim.agn.getter import AGNCustomGetter
from distoptim.agn.rules import AddUpdate, ServerRule
from distoptim.agn.shard_link import ShardLink
from distoptim.agn.worker import AsyncWorkerOptimizer

__all__ = ["DownpourOptimizer"]


class DownpourOptimizer(AsyncWorkerOptimizer):
    """DOWNPOUR: every λ = ``communication_period`` steps commit ``Δ = θ - θ_pulled``.

    Each step runs the wrapped optimizer on the local parameters θ. When
    ``local_step % λ == 0``: the worker commits ``Δ = θ - θ_pulled`` (``θ_pulled``: the center
    it last received), the shard applies ``c ← c + Δ`` (under a lock when ``use_locking``;
    ``global_step += 1``), and the worker sets ``θ ← c`` and ``θ_pulled ← c``. Unlike AGN's delta
    rule the delta is *not* divided by λ, so with many workers the center takes the sum of their
    progress (the staleness problem AGN's normalization addresses). Placement, initialization
    and read-outs as :class:`~distoptim.agn.agn.AGNOptimizer`.
    """

    algorithm = "DOWNPOUR"
    _keeps_pulled = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_worker: int,
        custom_getter: AGNCustomGetter | None = None,
        communication_period: int = 10,
        use_locking: bool = True,
        name: str = "DownpourOptimizer",
    ) -> None:
        super().__init__(
            optimizer, num_worker, custom_getter, communication_period, use_locking, name
        )

    def _server_rule(self) -> ServerRule:
        return AddUpdate()

    def _payload_part(self, link: ShardLink, chunk: Chunk, dst: dict[str, torch.Tensor]) -> None:
        link.delta_part(chunk, dst)
