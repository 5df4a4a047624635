"""The state of ``CrossShardOptimizer``: its state dict and its per-rank checkpoints.

Owns the state methods of the optimizer, as the :class:`CrossShardState` mixin it inherits:
the full per-parameter state (gathered when it is sharded: ``state_dict()``, the slots), loading
a state dict, and the per-rank checkpoints through ``torch.distributed.checkpoint``
(``sharded_state_dict`` / ``save_sharded`` / ``load_sharded``; the format is
:mod:`distoptim.sync.sharded_checkpoint`). The semantics are the optimizer's
(``docs/cross_shard.md``, :mod:`distoptim.sync.optimizer`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from distoptim import checks
from distoptim.comm.guard import RoundKind
from distoptim.sync.apply import ApplyStrategy
from distoptim.sync.options import check_saved_hyperparameters
from distoptim.sync.rounds import RoundDriver

__all__ = ["CrossShardState"]


class CrossShardState:
    """The state and checkpoint methods of
    :class:`~distoptim.sync.optimizer.CrossShardOptimizer` (a mixin placed before
    :class:`~distoptim.protocol.WrappedOptimizer`, whose ``state_dict`` / ``load_state_dict``
    it extends; it reads the optimizer's attributes, declared here for type checkers)."""

    iterations: int
    _wrapped: torch.optim.Optimizer
    _apply: ApplyStrategy
    _rounds: RoundDriver

    # ---- state: the full per-parameter state, also when it is sharded ----------------------
    def _announce(self, kind: RoundKind) -> None:
        """Before gathering sharded state: every rank of the group must be in the same call."""
        if self._apply.state_is_collective:
            self._rounds.announce(kind)

    def _slot_state(self) -> Any:
        """The state slots are read from; with sharding, gathered (call on every rank)."""
        self._announce(RoundKind.SLOTS)
        return self._apply.full_state()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``iterations`` (see ``WrappedOptimizer``).

        With ``shard_optimizer_state=True`` the per-parameter state is gathered from every
        rank into the unsharded format (a collective: call it on every rank, then save on
        one); it loads into a sharded or an unsharded optimizer alike. A round of zeros whose
        words say ``state_dict()`` goes first: when only some ranks call it, every rank
        involved raises ``DesyncError`` -- peers in a ``step()`` or ``finish()`` at once, the
        callers as soon as their peers' rounds (or their exit) arrive.
        """
        self._announce(RoundKind.STATE)
        with self._apply.gathered_state():
            return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; everything is checked before anything changes.

        Besides the structure (``WrappedOptimizer``), every hyperparameter in the saved param
        groups must be finite. With ``shard_optimizer_state=True``, each rank keeps its own
        slice of every parameter's state (local: no communication).
        """
        if isinstance(state_dict, dict):
            check_saved_hyperparameters(self._wrapped, state_dict.get("param_groups"))
        super().load_state_dict(state_dict)
        self._apply.after_load()

    # ---- per-rank checkpoints through torch.distributed.checkpoint --------------------------
    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the optimizer state, as a state dict DCP saves per rank.

        Local (no gather): with sharding this rank's ``1/n`` of the per-element state as
        ``ShardedTensor`` pieces, else the whole state (DCP writes it once). Save it with
        ``dcp.save`` on every rank, alone or beside the model's (``{"model": ..., "optim":
        opt.sharded_state_dict()}``); load it with :meth:`load_sharded` on any number of ranks.
        Format: :mod:`distoptim.sync.sharded_checkpoint`.
        """
        from distoptim.sync import sharded_checkpoint  # imports DCP: seconds, on first use

        self._rounds.refresh()
        return sharded_checkpoint.state_dict_of(
            self._wrapped, self._apply, self.iterations, self._rounds.comm.replicas.group
        )

    def save_sharded(self, checkpoint_id: str | os.PathLike[str]) -> None:
        """``torch.distributed.checkpoint.save(self.sharded_state_dict(), checkpoint_id=...)``:
        every rank writes only what it holds. A collective: call it on every rank (announced
        first: a call on some ranks only is a ``DesyncError`` on all, as for ``state_dict()``)."""
        import torch.distributed.checkpoint as dcp

        checks.check_type("checkpoint_id", checkpoint_id, (str, os.PathLike), "a path")
        self._announce_checkpoint()
        dcp.save(self.sharded_state_dict(), checkpoint_id=checkpoint_id)

    def _announce_checkpoint(self) -> None:
        """Before DCP's collectives: every rank in the same call, the parameter list agreed."""
        self._rounds.refresh()
        if self._rounds.size > 1:
            self._rounds.announce(RoundKind.CHECKPOINT)

    def load_sharded(self, checkpoint_id: str | os.PathLike[str], prefix: str = "") -> None:
        """Load a per-rank checkpoint (:meth:`sharded_state_dict`) written by any number of ranks.

        Every rank reads only the state it holds in its current layout (resharding from the
        saved one). ``prefix``: where the optimizer's entries sit when it was saved nested
        (``"optim"`` for ``{"optim": opt.sharded_state_dict()}``). Checks that the
        checkpoint fits (format, parameter groups, hyperparameters, sizes) before anything
        changes. A collective: call it on every rank (announced and the parameter list agreed
        first, as for :meth:`save_sharded`; with sharding, the parameters move into their flat
        buffers).
        """
        from distoptim.sync import sharded_checkpoint

        checks.check_type("checkpoint_id", checkpoint_id, (str, os.PathLike), "a path")
        checks.check_type("prefix", prefix, str, "a str")
        self._announce_checkpoint()
        if self._rounds.size == 1:
            self._rounds.solo_plan()
        group = self._rounds.comm.replicas.group
        iterations, groups, owned = sharded_checkpoint.read(
            self._wrapped, self._apply, group, checkpoint_id, prefix
        )
        # hyperparameters and iterations through the checked path (the state comes next)
        self.load_state_dict({"state": {}, "param_groups": groups, "iterations": iterations})
        self._apply.load_owned(owned)
