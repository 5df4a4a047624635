"""ElasticAverageOptimizer: asynchronous Elastic Averaging SGD, as TF contrib's.

Owns: EASGD's commit rule (send θ, move θ toward the old center); its server rule (move the
center toward θ by the same amount, :class:`~distoptim.agn.rules.ElasticUpdate`) lives with the
other rules — Zhang, Choromanska, LeCun, "Deep learning with Elastic
Averaging SGD", NeurIPS 2015; ``tf.contrib.opt.ElasticAverageOptimizer``.
"""

from __future__ import annotations

import torch

from distoptim.agn.flat import Chunk
from distoptim.agn.getter import AGNCustomGetter
from distoptim.agn.rules import ElasticUpdate, ServerRule, elastic_difference
from distoptim.agn.shard_link import ShardLink
from distoptim.agn.worker import AsyncWorkerOptimizer
from distoptim.checks import check_real

__all__ = ["ElasticAverageOptimizer", "ElasticUpdate"]

BETA = 0.9
"""TF contrib's default ``moving_rate = BETA / communication_period / num_worker``."""


class ElasticAverageOptimizer(AsyncWorkerOptimizer):
    """Asynchronous EASGD with period τ = ``communication_period`` and moving rate alpha.

    Every step runs the wrapped optimizer on the local parameters θ. When
    ``local_step % τ == 0``, in one round trip per shard, with ``c`` the center at the moment
    the shard handles the commit (under its lock when ``use_locking``)::

        d = alpha (θ - c)
        θ ← θ - d        (worker)
        c ← c + d        (shard; global_step += 1)

    ``moving_rate=None`` gives TF contrib's default ``alpha = 0.9 / (τ · num_worker)``. The local
    copy is *not* reset to the center (it is only pulled toward it); ``get_init_op`` sets
    θ := c once at the start. Placement and read-outs as :class:`~distoptim.agn.agn.AGNOptimizer`.
    """

    algorithm = "EASGD"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_worker: int,
        custom_getter: AGNCustomGetter | None = None,
        communication_period: int = 10,
        moving_rate: float | None = None,
        use_locking: bool = True,
        name: str = "ElasticAverageOptimizer",
    ) -> None:
        if moving_rate is not None:
            check_real("moving_rate (None: the default)", moving_rate, 0.0, 1.0, low_open=True)
        super().__init__(
            optimizer, num_worker, custom_getter, communication_period, use_locking, name
        )
        self.moving_rate = (
            BETA / communication_period / num_worker if moving_rate is None else float(moving_rate)
        )

    def _server_rule(self) -> ServerRule:
        return ElasticUpdate(self.moving_rate)

    def _payload_part(self, link: ShardLink, chunk: Chunk, dst: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():  # θ
            torch._foreach_copy_(link.part_views(chunk, dst), link.part_params(chunk))

    def _absorb_part(self, link: ShardLink, chunk: Chunk, reply: dict[str, torch.Tensor]) -> None:
        local = link.part_params(chunk)  # θ <- θ - alpha (θ - c_old), on the parameters
        with torch.no_grad():
            d = elastic_difference(local, link.part_views(chunk, reply), self.moving_rate)
            torch._foreach_sub_(local, d)
