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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distoptim import checks
from distoptim.comm.guard import RoundKind
from distoptim.sync.apply import ApplyStrategy
from distoptim.sync.options import check_saved_hyperparameters
from distoptim.sync.rounds import RoundDriver

__all__ = ["Consolidated", "CrossShardState"]


@dataclass(frozen=True)
class Consolidated:
    """A :meth:`CrossShardState.consolidate_state_dict` result: valid for ``version`` (the step
    and the parameter list), consolidated to group rank ``to`` (None: every rank), ``state``
    the unsharded ``state_dict()["state"]`` (None on the ranks that did not keep it)."""

    version: tuple[int, tuple[int, ...]]
    to: int | None
    state: dict[int, Any] | None


class CrossShardState:
    """The state and checkpoint methods of
    :class:`~distoptim.sync.optimizer.CrossShardOptimizer` (a mixin placed before
    :class:`~distoptim.protocol.WrappedOptimizer`, whose ``state_dict`` / ``load_state_dict``
    it extends; it reads the optimizer's attributes, declared here for type checkers)."""

    iterations: int
    _wrapped: torch.optim.Optimizer
    _apply: ApplyStrategy
    _rounds: RoundDriver
    _consolidated: Consolidated | None
    _all_params: Callable[[], list[torch.Tensor]]

    # ---- state: the full per-parameter state, also when it is sharded ----------------------
    def _announce(self, kind: RoundKind) -> None:
        """Before gathering sharded state: every rank of the group must be in the same call."""
        if self._apply.state_is_collective:
            self._rounds.announce(kind)

    def _slot_state(self) -> Any:
        """The state slots are read from; with sharding, gathered (call on every rank)."""
        self._announce(RoundKind.SLOTS)
        return self._apply.full_state()

    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Gather the sharded per-parameter state so that rank ``to`` can call :meth:`state_dict`.

        torch's ``ZeroRedundancyOptimizer.consolidate_state_dict``: a collective, call it on
        every rank of the group, then ``state_dict()`` on rank ``to`` (a rank index within
        this optimizer's group: the global rank without ``group_assignment``; ``None``: every
        rank keeps it). The state is gathered into the unsharded format (every rank receives
        it during the call; only ``to`` keeps it). It stays valid until the next ``step()``,
        load or change of the parameter list; ``state_dict()`` refuses it afterwards. A round
        of zeros whose words say ``consolidate_state_dict()`` goes first: when only some ranks
        call it, every rank involved raises ``DesyncError``. Without sharded state (no
        ``shard_optimizer_state``, one shard, or before the first step) it does nothing:
        ``state_dict()`` is local there anyway.
        """
        if to is not None:
            to = checks.check_int("to", to, 0)
            if to >= self._rounds.size:
                raise ValueError(
                    f"consolidate_state_dict(to={to}): to must be a rank of this optimizer's "
                    f"group, in [0, {self._rounds.size}), or None (every rank keeps the state)"
                )
        self._consolidated = None
        if not self._apply.state_is_collective:
            return
        self._announce(RoundKind.STATE)
        with self._apply.gathered_state():
            state = self._wrapped.state_dict()["state"]
        mine = to is None or to == self._rounds.comm.replicas.rank
        self._consolidated = Consolidated(self._state_version(), to, state if mine else None)

    def _state_version(self) -> tuple[int, tuple[int, ...]]:
        """What a consolidated state is valid for: the step and the parameter list."""
        return self.iterations, tuple(id(p) for p in self._all_params())

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``iterations`` (see ``WrappedOptimizer``).

        Local: no collective, whatever the options. With ``shard_optimizer_state=True`` (and
        more than one shard, after the first step) each rank holds only ``1/n`` of the
        per-parameter state: call :meth:`consolidate_state_dict` on every rank first, then
        ``state_dict()`` on the rank it was consolidated to -- torch's
        ``ZeroRedundancyOptimizer`` protocol::

            opt.consolidate_state_dict(to=0)       # every rank
            if rank == 0:
                torch.save(opt.state_dict(), path)

        It returns the unsharded format (the consolidated per-parameter state, the current
        param groups and ``iterations``), which loads into a sharded or an unsharded optimizer
        alike. Without a valid consolidation on this rank (none, another rank's, or one
        taken before a later ``step()`` or load) it raises ``RuntimeError`` at once, naming
        ``consolidate_state_dict`` -- so ``if rank == 0: opt.state_dict()`` never waits for
        peers, whatever they run. :meth:`save_sharded` writes each rank's part instead.
        """
        if not self._apply.state_is_collective:  # one shard, or nothing sharded yet: local
            with self._apply.gathered_state():
                return super().state_dict()  # type: ignore[misc]
        held = self._consolidated
        problem = None
        if held is None:
            problem = "no consolidate_state_dict() call since its last step or load"
        elif held.version != self._state_version():
            problem = (
                f"its consolidate_state_dict() was at step {held.version[0]}; it has taken "
                f"steps or changed its parameters since (now at step {self.iterations})"
            )
        elif held.state is None:
            problem = f"the state was consolidated to rank {held.to} of the group, not to it"
        if problem is not None:
            rank = self._rounds.comm.replicas.rank
            raise RuntimeError(
                f"CrossShardOptimizer.state_dict() with shard_optimizer_state=True: rank {rank} "
                f"of the group holds only its 1/{self._rounds.size} of the optimizer state, and "
                f"{problem}. Call opt.consolidate_state_dict(to=0) on every rank first (a "
                "collective), then opt.state_dict() on rank 0 -- as torch's "
                "ZeroRedundancyOptimizer -- or write every rank's own part with "
                "opt.save_sharded(path) on every rank."
            )
        assert held is not None and held.state is not None
        sd = super().state_dict()  # type: ignore[misc]  # current param groups, no state
        sd["state"] = held.state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; everything is checked before anything changes.

        Besides the structure (``WrappedOptimizer``), every hyperparameter in the saved param
        groups must be finite. With ``shard_optimizer_state=True``, each rank keeps its own
        slice of every parameter's state (local: no communication).
        """
        self._consolidated = None  # the state it gathered is replaced
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
        from distoptim.sync.sharded_checkpoint import dcp_errors

        self._announce_checkpoint()
        with dcp_errors("save", checkpoint_id):
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
        checkpoint fits (format, optimizer type, param groups and their hyperparameter keys,
        parameter shapes, state keys, sizes:
        :func:`~distoptim.sync.sharded_checkpoint.check_fit`) before anything changes;
        ``ValueError`` names what differs. A collective: call it on every rank (announced and
        the parameter list agreed first, as for :meth:`save_sharded`; with sharding, the
        parameters move into their flat buffers).
        """
        from distoptim.sync import sharded_checkpoint

        checks.check_type("checkpoint_id", checkpoint_id, (str, os.PathLike), "a path")
        checks.check_type("prefix", prefix, str, "a str")
        self._announce_checkpoint()
        if self._rounds.size == 1:
            self._rounds.solo_plan()
        group = self._rounds.comm.replicas.group
        iterations, groups, counts, owned = sharded_checkpoint.read(
            self._wrapped, self._apply, group, checkpoint_id, prefix
        )
        # hyperparameters and step counts through the checked path (the state comes next)
        self.load_state_dict(
            {"state": {}, "param_groups": groups, "iterations": iterations, **counts}
        )
        self._apply.load_owned(owned)
