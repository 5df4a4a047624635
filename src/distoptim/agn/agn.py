"""AGNOptimizer: Accumulated Gradient Normalization on a parameter server.

Owns: AGN's commit rule and server rule (Hermans, Spanakis, Möckel, "Accumulated Gradient
Normalization", ACML 2017, arXiv 1710.02368; the semantics of ``tf.contrib.opt.AGNOptimizer``).
Everything else (placement, buffers, transport, init hook) is :mod:`distoptim.agn.worker`.
"""

from __future__ import annotations

import torch

from distoptim.agn.flat import Chunk
from distoptim.agn.getter import AGNCustomGetter
from distoptim.agn.rules import AddUpdate, ApplyOptimizer, ServerRule
from distoptim.agn.shard_link import ShardLink
from distoptim.agn.worker import AsyncWorkerOptimizer

__all__ = ["UPDATE_RULES", "AGNOptimizer"]

UPDATE_RULES = ("gradient", "delta")


class AGNOptimizer(AsyncWorkerOptimizer):
    """Wraps ``optimizer`` so that ``num_worker`` workers train one model asynchronously.

    Placement: each parameter's *center variable* lives on one parameter-server shard, chosen
    by ``custom_getter`` (``None``: the cluster's default, round-robin by parameter); the local
    copy is the worker's own parameter. λ = ``communication_period``.

    ``update_rule="gradient"`` (default; TF contrib's rule). On each worker, every step:
    ``θ ← optimizer.step(θ, g)`` (the wrapped optimizer, local), ``a ← a + g`` (the raw
    gradient), ``local_step += 1``. When ``local_step % λ == 0``, in one round trip per shard:

    * the worker commits ``a / λ``;
    * the shard applies a server optimizer — same class and hyperparameters as ``optimizer``,
      with its own state on the PS — to the center: ``c ← server_opt.step(c, grad=a/λ)``,
      under a lock when ``use_locking``; ``global_step += 1`` (it counts commits);
    * the worker sets ``θ ← c`` (the center just computed) and ``a ← 0``.

    For plain SGD with learning rate η, one commit moves the center by ``-η · mean(g over the
    last λ steps)``. Workers never wait for each other; commits apply in arrival order.

    ``update_rule="delta"`` (the paper's / dist-keras form): the worker commits
    ``(θ - θ_pulled) / λ`` where ``θ_pulled`` is the center it last received, the shard adds it
    (``c ← c + (θ - θ_pulled)/λ``, no server optimizer), and the worker sets ``θ ← c``.

    Initialization: ``make_session_run_hook(is_chief, task_index)``; ``begin()`` then
    ``after_create_session()`` (the chief seeds centers and server optimizer, the others wait
    and pull), or ``get_init_op(task_index)()`` once the centers exist. Read-outs:
    ``local_step``, ``global_step`` (last value seen from the PS), ``center_variables()``.
    Slots (``get_slot`` etc.) are the wrapped optimizer's local ones.
    """

    algorithm = "AGN"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_worker: int,
        custom_getter: AGNCustomGetter | None = None,
        communication_period: int = 10,
        use_locking: bool = True,
        name: str = "AGNOptimizer",
        update_rule: str = "gradient",
    ) -> None:
        if update_rule not in UPDATE_RULES:
            raise ValueError(f"update_rule must be one of {UPDATE_RULES}, got {update_rule!r}")
        self.update_rule = update_rule
        self._keeps_accumulator = update_rule == "gradient"
        self._keeps_pulled = update_rule == "delta"
        self.algorithm = f"AGN/{update_rule}"
        super().__init__(
            optimizer, num_worker, custom_getter, communication_period, use_locking, name
        )

    def _server_rule(self) -> ServerRule:
        return ApplyOptimizer() if self.update_rule == "gradient" else AddUpdate()

    def _payload_target(self, link: ShardLink) -> dict[str, torch.Tensor]:
        if self.update_rule == "gradient" and link.out is None:
            assert link.acc is not None
            return link.acc  # a/λ in place: the accumulator is zeroed after the reply
        return super()._payload_target(link)

    def _payload_part(self, link: ShardLink, chunk: Chunk, dst: dict[str, torch.Tensor]) -> None:
        lam = self.communication_period
        if self.update_rule == "delta":
            link.delta_part(chunk, dst, lam)
            return
        assert link.acc is not None
        a, out = chunk.of(link.acc), chunk.of(dst)
        if out.data_ptr() == a.data_ptr():
            if lam != 1:
                a.div_(lam)
        elif lam == 1:
            out.copy_(a)
        else:
            torch.div(a, lam, out=out)  # written where the transport sends it from
