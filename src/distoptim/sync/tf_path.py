"""The TF path of ``CrossShardOptimizer``: ``compute_gradients`` / ``apply_gradients``.

Owns the two hooks :class:`~distoptim.protocol.TFOptimizerProtocol` leaves to a subclass, as
the :class:`CrossShardTFPath` mixin the optimizer inherits: the loss scaling of
``compute_gradients`` (``loss / n`` for MEAN on ``n > 1`` replicas, else the loss itself) and
the application of ``apply_gradients``' pairs (summed across the group into fresh tensors,
applied once). ``DTensor`` parameters (HSDP) are refused here: ``backward()`` and ``step()``
only. The semantics are the optimizer's (``docs/cross_shard.md``,
:mod:`distoptim.sync.optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from distoptim.local_shards import is_dtensor
from distoptim.protocol import GradsAndVars, swapped_grads
from distoptim.sync.apply import ApplyStrategy
from distoptim.sync.options import Reduction
from distoptim.sync.replicated import ReplicatedRounds
from distoptim.sync.rounds import RoundDriver

__all__ = ["CrossShardTFPath"]


class CrossShardTFPath:
    """The TF-path hooks of :class:`~distoptim.sync.optimizer.CrossShardOptimizer` (a mixin:
    it reads the optimizer's attributes, declared here for type checkers, and calls its
    ``step()`` and ``_all_params()``)."""

    iterations: int
    reduction: Reduction
    num_shards: int
    _apply: ApplyStrategy
    _rounds: RoundDriver
    _replicated: ReplicatedRounds | None
    _applying_pairs: bool
    _all_params: Callable[[], list[torch.Tensor]]
    step: Callable[..., Any]

    # ---- TF path: compute_gradients / apply_gradients -----------------------------------------
    def _refuse_dtensors(self, params: Iterable[torch.Tensor]) -> None:
        """The TF path takes plain parameters only: under FSDP2 the sharded parameters are not
        in the autograd graph (FSDP2 reduce-scatters into their ``.grad`` in backward)."""
        if any(is_dtensor(p) for p in params):
            raise TypeError(
                "CrossShardOptimizer: the TF path (compute_gradients / apply_gradients / "
                "minimize) does not take DTensor parameters (FSDP2 or tensor parallelism "
                "inside a replica group): FSDP2 reduces their gradients into .grad during "
                "backward(); use loss.backward() and step()"
            )

    def _scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        self._refuse_dtensors(self._all_params())
        if self.reduction is Reduction.MEAN and self.num_shards > 1:
            return loss / self.num_shards
        return loss

    def _apply_pairs(self, pairs: GradsAndVars) -> None:
        """SUM the given gradients across the group into fresh tensors, then apply them once."""
        if self._replicated is not None:
            raise ValueError(
                "CrossShardOptimizer(manager=...): the TF path (apply_gradients/minimize) is "
                "refused: a managed round averages .grad over the quorum's participants inside "
                "step(), which the TF path's pre-scaled gradients cannot know; use "
                "loss.backward() and step()"
            )
        self._refuse_dtensors(v for _, v in pairs)
        for _, v in pairs:
            if not v.requires_grad:
                raise ValueError(
                    f"CrossShardOptimizer reduces gradients of trainable parameters only; a var "
                    f"of shape {tuple(v.shape)} has requires_grad=False"
                )
        self._rounds.refresh()
        reduced = self._apply.apply_pairs(pairs, self._rounds)
        if reduced is None:  # the strategy applied them (weight-update sharding)
            self.iterations += 1
            return
        # max_grad_norm; on one shard the pairs are the caller's own tensors: clip copies
        reduced = self._apply.clip_pairs(reduced, copy=self.num_shards == 1)
        self._applying_pairs = True
        try:
            with swapped_grads(self._all_params(), reduced):
                self.step()
        finally:
            self._applying_pairs = False
