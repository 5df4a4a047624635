"""distoptim's side of a torchft Manager: one round at a time, committed or not, healed live.

Owns :class:`ManagedReplicas`, the object through which CrossShardOptimizer and DiLoCo (and so
LocalSGD and Streaming DiLoCo) use a user's ``torchft.Manager``. Everything goes through the
manager's documented contract; the two things it does not document are read through
:mod:`distoptim.ft._torchft`.

A round (one CrossShard step, one DiLoCo fragment sync):

1. :meth:`ManagedReplicas.start` -- ``manager.start_quorum()`` once per round (idempotent until
   the round ends, so ``zero_grad()`` may start it early, overlapping the quorum with the
   forward pass, and ``step()`` starts it if nobody did).
2. :meth:`ManagedReplicas.quorum` -- who takes part (:class:`Quorum`): the participants (the
   replicas at the newest committed step), this replica's index among them, or ``None`` when it
   is *healing* (it will receive a peer's state at the commit, so it contributes nothing: its
   buffers are zeroed and it is not counted in the mean).
3. collectives (:meth:`all_reduce_sum`, :meth:`all_gather`, :meth:`all_to_all`) over the
   quorum. A failure (a peer died, a timeout) does not raise: torchft records it, the result is
   garbage, and the round will not commit. The replica that sees it drops the quorum's
   process group at once (:func:`~distoptim.ft._torchft.close_quorum_group`), so a member
   blocked in the collective waiting on *this* replica, not on the dead one (the far side of
   a ring), fails within milliseconds too, not at the collective timeout: the failure spreads
   along the ring, and every survivor reaches the next quorum without waiting it out.
4. :meth:`ManagedReplicas.commit` -- ``manager.should_commit()``: True only if every process of
   this replica group saw no error and enough replicas took part. A healing replica loads the
   peer's state here (torchft applies it inside ``should_commit``). The caller applies the
   update only on True; on False it keeps (or restores) the state of the last commit.

State. :meth:`register_state` registers a piece of distoptim's own state with
``manager.register_state_dict_fn`` under ``distoptim/<owner>/<key>``; what is sent is a copy
taken when the quorum asks for it (so later local steps cannot tear it).

A quorum that does not form within the manager's ``quorum_timeout`` raises
:class:`~distoptim.ft.replica.QuorumTimeoutError` naming the replica (torchft's own error is a
bare ``TimeoutError``); in a group of several processes, one whose rank 0 (the group's manager)
died or stopped raises :class:`~distoptim.ft.replica.GroupManagerUnreachableError` naming its
group rank. A quorum that can never be big enough (``min_replica_size`` above the
replicas that exist) does not spin silently: after ``give_up_after`` seconds (the manager's
quorum timeout) of rounds that failed only for lack of replicas, :meth:`commit` raises
:class:`InsufficientReplicasError`.
"""

from __future__ import annotations

import concurrent.futures
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from distoptim.ft import _torchft, inject
from distoptim.ft.replica import quorum_timed_out

__all__ = [
    "InsufficientReplicasError",
    "ManagedReplicas",
    "Quorum",
    "ReplicaStats",
    "check_manager",
]


def check_manager(manager: Any, owner: str) -> None:
    """``TypeError`` unless ``manager`` is a ``torchft.Manager`` (ImportError without torchft)."""
    torchft = _torchft.require()
    if not isinstance(manager, torchft.Manager):
        raise TypeError(
            f"{owner}: manager must be a torchft.Manager (see distoptim.ft.make_manager), "
            f"got {type(manager).__name__}"
        )


class InsufficientReplicasError(RuntimeError):
    """Rounds keep failing because fewer replicas take part than ``min_replica_size``."""


@dataclass(frozen=True)
class Quorum:
    """Who takes part in the current round.

    ``participants``: replicas whose contributions count (the quorum's members at its newest
    committed step). ``rank``: this replica's index among them, ``None`` if it is healing.
    ``group_rank``/``group_size``: its place in the quorum's process group, healing members
    included (every member takes part in every collective); ``group_size`` is 0 when the
    quorum already failed (its group could not be set up). ``quorum_id``: changes whenever the
    membership does.
    """

    participants: int
    rank: int | None
    group_rank: int
    group_size: int
    quorum_id: int

    @property
    def contributes(self) -> bool:
        return self.rank is not None

    @property
    def failed(self) -> bool:
        return self.group_size == 0


@dataclass
class ReplicaStats:
    """What this replica's rounds did (reported by the CLI and the benchmarks)."""

    rounds: int = 0
    commits: int = 0
    failed: int = 0  # rounds not committed (an error, or too few replicas)
    heals: int = 0  # peer states received
    last_heal_at: float | None = None  # wall clock of the last heal
    quorum_changes: int = 0
    contributed: int = 0  # committed rounds this replica contributed to (not healing)
    caught_up: int = 0  # syncs it stood behind its quorum's step and jumped to it (DiLoCo)
    first_round_at: float | None = None  # wall clock of this replica's first quorum
    first_contribution_at: float | None = None  # ... and of its first contributing commit
    errors: list[str] = field(default_factory=list)  # the last few round failures, as text
    payload_bytes: int = 0  # the update's bytes this process put on the wire across groups


class ManagedReplicas:
    """A ``torchft.Manager`` as distoptim's optimizers use it (see the module docstring).

    ``owner`` names the optimizer in messages and state keys (e.g. ``"CrossShardOptimizer"``).
    """

    def __init__(self, manager: Any, owner: str) -> None:
        check_manager(manager, owner)
        self.manager = manager
        self.owner = owner
        self.stats = ReplicaStats()
        self.give_up_after = _torchft.quorum_timeout_seconds(manager)
        self._started = False
        self._quorum: Quorum | None = None
        self._short_since: float | None = None
        self._heals_at_start = 0
        self._last_quorum_id: int | None = None
        self._keys: set[str] = set()
        self._holding_reads = False  # this round holds the manager's state reads (start)

    # ---- the round ------------------------------------------------------------------------
    @property
    def in_round(self) -> bool:
        """Whether a round was started and has not been committed (or abandoned) yet."""
        return self._started

    def start(self, hold_reads: bool = False) -> None:
        """Start this round's quorum (once; later calls until :meth:`commit` do nothing).

        ``hold_reads``: the caller's forward and backward passes come before it waits for the
        quorum (CrossShard's ``zero_grad()``). torchft's quorum thread then may not read the
        state it sends a healing peer (the user's ``state_dict`` functions) until this replica
        waits for the quorum itself: an FSDP2 module's ``state_dict()`` reshards it, freeing
        the unsharded parameters its forward or backward is using. The hold is the manager's
        own (``disallow_state_dict_read()``); :meth:`quorum` and :meth:`commit` release it.
        A synchronous-quorum manager reads inside ``start_quorum()``: nothing to hold.
        """
        if self._started:
            return
        if self.stats.first_round_at is None:
            self.stats.first_round_at = time.time()
        self._heals_at_start = self.stats.heals
        if hold_reads and _torchft.uses_async_quorum(self.manager):
            self.manager.disallow_state_dict_read()
            self._holding_reads = True
        try:
            self.manager.start_quorum()
        except BaseException:
            self._release_reads()
            raise
        self._started = True
        self._quorum = None
        self.stats.rounds += 1

    def _release_reads(self) -> None:
        """Let the quorum thread read the state again (before this thread waits for it)."""
        if self._holding_reads:
            self._holding_reads = False
            self.manager.allow_state_dict_read()

    def quorum(self) -> Quorum:
        """The current round's :class:`Quorum` (waits for the quorum; starts it if needed)."""
        self.start()
        if self._quorum is None:
            self._release_reads()  # a donor's quorum reads the state before it completes
            manager = self.manager
            self._wait_quorum()
            # a quorum whose process group could not be set up (a peer gone while it formed)
            # is already failed: no collective is issued, the round will not commit
            rank, size = (0, 0) if manager.errored() else _torchft.quorum_rank_and_size(manager)
            qid = _torchft.quorum_id(manager)
            participating = manager.is_participating()
            self._quorum = Quorum(
                participants=manager.num_participants(),
                rank=manager.participating_rank() if participating else None,
                group_rank=rank,
                group_size=size,
                quorum_id=qid,
            )
            if qid != self._last_quorum_id:
                self.stats.quorum_changes += self._last_quorum_id is not None
                self._last_quorum_id = qid
            if inject.ARMED:
                inject.hit("after_quorum", "contributor" if participating else "joiner")
        return self._quorum

    def _wait_quorum(self) -> None:
        """``manager.wait_quorum()``; with a manager built by ``make_manager``, in slices, each
        asking its :class:`~distoptim.ft.replica.LighthouseWatch` why the quorum does not come
        (a lighthouse gone, or no peer left: raised by name within ``connect_timeout``). A
        quorum that does not come within ``quorum_timeout``: ``QuorumTimeoutError``."""
        watch = getattr(self.manager, "_distoptim_watch", None)
        future = _torchft.quorum_future(self.manager)
        began = time.monotonic()
        if watch is not None and future is not None:
            while not concurrent.futures.wait([future], timeout=1.0).done:
                watch.check(time.monotonic() - began, joining=self._last_quorum_id is None)
            watch.reset()
        try:
            self.manager.wait_quorum()
        except TimeoutError as exc:  # torchft's quorum request ran out its quorum_timeout
            waited = time.monotonic() - began
            if watch is not None:
                raise watch.timed_out(self.give_up_after, waited) from exc
            raise quorum_timed_out(self.owner, self.give_up_after, waited) from exc
        except RuntimeError as exc:  # e.g. this group's rank 0 (its manager) died
            lost = self._lost(watch, exc, began, "a quorum")
            if lost is None:
                raise
            raise lost from exc

    @staticmethod
    def _lost(watch: Any, exc: RuntimeError, began: float, what: str) -> Exception | None:
        """torchft's client error, named when it means this group's rank 0 manager is gone."""
        if watch is None:
            return None
        return watch.group_manager_lost(exc, time.monotonic() - began, what)

    def errored(self) -> BaseException | None:
        """The failure torchft recorded in this round (None: none so far)."""
        err = self.manager.errored()
        return None if err is None else err.original_exception

    def commit(self) -> bool:
        """End the round: ``should_commit()``; a healing replica receives its state here."""
        self.start()  # a round must have a quorum to be judged
        self._release_reads()
        manager = self.manager
        began = time.monotonic()
        try:
            ok = bool(manager.should_commit())
        except RuntimeError as exc:  # e.g. this group's rank 0 (its manager) died
            lost = self._lost(getattr(manager, "_distoptim_watch", None), exc, began, "a commit")
            if lost is None:
                raise
            raise lost from exc
        finally:
            self._started = False
        if ok:
            stats = self.stats
            if inject.ARMED:
                healed = stats.heals > self._heals_at_start
                inject.hit("before_apply", "joiner" if healed else "contributor")
            stats.commits += 1
            quorum = self._quorum
            if quorum is not None and quorum.contributes and stats.heals == self._heals_at_start:
                stats.contributed += 1
                if stats.first_contribution_at is None:
                    stats.first_contribution_at = time.time()
            self._short_since = None
            return True
        self.stats.failed += 1
        err = self.errored()
        if err is not None:
            self.stats.errors = [*self.stats.errors[-4:], f"{type(err).__name__}: {err}"]
            self._short_since = None
            return False
        floor = _torchft.min_replica_size(manager)
        have = manager.num_participants()
        if have < floor:
            now = time.monotonic()
            self._short_since = self._short_since or now
            if now - self._short_since > self.give_up_after:
                raise InsufficientReplicasError(
                    f"{self.owner}: no step could be committed for {now - self._short_since:.0f}"
                    f" s: only {have} replica group(s) took part, fewer than the manager's "
                    f"min_replica_size={floor}. Start more replica groups, or build the "
                    "Manager with a lower min_replica_size."
                )
        return False

    # ---- collectives over the quorum --------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> Any:
        """Start a SUM all-reduce of ``tensor`` in place; returns a work with ``wait()``.

        A healing replica's ``tensor`` is zeroed first (it contributes nothing); a failure is
        recorded by torchft (the round will not commit) instead of raised.
        """
        return _Reported(self, self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM))

    def all_reduce_group(self, tensor: torch.Tensor) -> Any:
        """A SUM all-reduce over the quorum's group as every member sends it (no zeroing)."""
        group = _torchft.quorum_group(self.manager)
        opts = c10d.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        return self._managed(lambda: group.allreduce([tensor], opts))

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> Any:
        """All-gather ``tensor`` from every member of the quorum's group (healing ones too)."""
        group = _torchft.quorum_group(self.manager)
        return self._managed(lambda: group.allgather([outputs], [tensor], c10d.AllgatherOptions()))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Any:
        """``all_to_all_single`` with equal splits over the quorum's group."""
        group = _torchft.quorum_group(self.manager)
        return self._managed(
            lambda: group.alltoall_base(output, input, [], [], c10d.AllToAllOptions())
        )

    def _managed(self, launch: Callable[[], Any]) -> Any:
        """Launch a collective on the quorum's group; errors recorded, never raised."""
        self.quorum()
        if self.manager.errored():
            return _Done()
        try:
            work = launch()
        except Exception as exc:
            self.manager.report_error(exc)
            return _Done()
        return _Reported(self, work)

    def collective_failed(self) -> None:
        """A collective of this round failed here (recorded with the manager): drop the
        quorum's process group now, so the members still blocked in it on this replica fail
        at once (see the module docstring); the next quorum has a new one."""
        _torchft.close_quorum_group(self.manager)

    # ---- state -------------------------------------------------------------------------------
    def register_state(
        self, key: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
    ) -> None:
        """Send ``state_dict()`` (copied) to healing peers; load theirs with ``load_state_dict``."""
        name = f"distoptim/{self.owner}/{key}"
        if name in self._keys:
            raise ValueError(f"{self.owner}: state {key!r} is registered twice with the manager")
        self._keys.add(name)

        def load(state: Any) -> None:
            if inject.ARMED:
                inject.hit("heal_joiner", "joiner")
            load_state_dict(state)
            self.stats.heals += 1
            self.stats.last_heal_at = time.time()

        def serve() -> Any:
            if inject.ARMED:
                inject.hit("heal_donor", "donor")
            return copy.deepcopy(state_dict())

        self.manager.register_state_dict_fn(name, load, serve)


class _Done:
    """A collective that was not launched (the round already failed): nothing to wait for."""

    def wait(self, timeout: Any = None) -> bool:
        return True


class _Reported:
    """A launched collective whose failure is recorded with the manager, never raised, and
    closes the quorum's group (:meth:`ManagedReplicas.collective_failed`). The failure is
    either raised by the work's wait (the quorum group's own collectives: recorded here) or
    recorded by it (torchft's ``manager.allreduce``, which catches it itself)."""

    def __init__(self, replicas: ManagedReplicas, work: Any) -> None:
        self.replicas = replicas
        self.work: Any = work

    def wait(self, timeout: Any = None) -> bool:
        work, self.work = self.work, _Done()  # the group is freed once nothing holds its works
        if isinstance(work, _Done):
            return True
        manager = self.replicas.manager
        clean = manager.errored() is None
        try:
            work.wait()
            failed = clean and manager.errored() is not None
        except Exception as exc:
            manager.report_error(exc)
            failed = True
        del work
        if failed:
            self.replicas.collective_failed()
        return True
