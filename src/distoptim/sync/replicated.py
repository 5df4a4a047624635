"""CrossShardOptimizer across torchft replica groups: a step is a round, committed or not.

Owns the last floor of a managed ``step()`` (``CrossShardOptimizer(manager=...)``): after the
round within the replica group (:mod:`distoptim.sync.rounds`; one process per group: a local
pack), the reduced buckets are averaged over the *replicas* through the user's
``torchft.Manager`` (:class:`~distoptim.ft.replicas.ManagedReplicas`), the replicas agree on
their words (:mod:`distoptim.ft.agreement`), and the step is committed -- the inner optimizer
runs -- only if ``should_commit()`` says so.

Math. A replica group of ``k`` processes ends its own round with ``G_i = sum_r g_r / (k N)``
(MEAN; the same on each of its processes). The ``P`` participants of the quorum then average
``G_i`` -- each divides by ``P`` before a SUM all-reduce in the ``compression`` wire -- so every
participant applies ``mean_i G_i``, the mean over every process of every participating replica
group (groups of equal size). SUM skips both divisions. A replica that is healing this round
(it will receive a peer's state at the commit) contributes zeros and is not counted; it still
takes part in the collective, receives the mean, and after loading the peer's parameters and
optimizer state at ``should_commit()`` applies the same update -- so it leaves the step
bit-for-bit equal to the others, which the next round's words check (the checksum of the
parameters the last commit or heal left).

The state check, amortized. The words carry the checksum of the parameters the last commit
or heal left (:func:`~distoptim.comm.checksum.state_checksum`, computed on their device). A
round checks the *whole* state unless the previous round of this replica was *clean*: in the
same quorum (the same members), committed, with no member healing or void. A clean round's
successor checks only slice ``step mod K`` of ``K`` (:func:`state_slices`: about
:data:`SLICE_LIMBS` 16-bit limbs a round, at most :data:`MAX_SLICES` slices). Why every commit's
members still agree on the whole state: the members of a clean round held equal states
(checked, wholly or by slice, and by induction from the last whole check) and applied the same
committed update, deterministically, so they leave it equal; a state that nevertheless drifts
(a fault outside the protocol: a bad memory, a non-deterministic kernel) differs in some slice,
which a round within the next ``K`` steps compares. What a heal or a membership change brings
in -- a healed replica's loaded state, a new member -- is checked whole in the next round, the
first in which that member's state is judged. Every member takes the same decision (the same
quorum, the same commit vote, the same table of words); if they ever did not, the words say
which slice each checked, and the round is not committed (so the next one is whole again).

In a replica group of ``k > 1`` processes holding full copies (CrossShard's own round inside
the group), every process holds the same reduced buckets; sending them whole from each would
move ``k`` times the bytes of one process across the groups (torchft connects equal group
ranks). Instead process ``r`` averages only slice ``r`` of each bucket with its counterparts,
and the group all-gathers the slices (:mod:`distoptim.sync.group_slices`): ``1/k`` of the
bytes per process across groups, one all-gather inside. A group whose model is sharded (``DTensor``
parameters: FSDP2 inside the group, HSDP across) has no round of its own here: each process
all-reduces only its ``1/k`` piece of the gradient, which FSDP2's reduce-scatter left it, and
the words carry the group's combined state checksum (:mod:`distoptim.sync.managed_shards`).

A failed round (a peer died mid-collective, too few replicas) is not applied: the parameters
and the inner optimizer keep the last commit's state, ``iterations`` does not advance, and
``.grad`` is left as the round left it (with bucket views: whatever the failed collective
wrote; call ``zero_grad()`` before the next backward, as usual).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from distoptim.comm.checksum import MAX_SLICES, SLICE_LIMBS, state_checksum, state_slices
from distoptim.comm.compression import WireFormat
from distoptim.comm.guard import RoundKind
from distoptim.comm.reducer import ReduceRound
from distoptim.comm.stats import CommStats, ring_allreduce_bytes
from distoptim.ft.agreement import ReplicaWords, decode, encode, hparams_digest, judge
from distoptim.ft.replicas import ManagedReplicas
from distoptim.local_shards import local_view
from distoptim.sync.group_slices import GroupSlices
from distoptim.sync.managed_shards import group_checksum

__all__ = ["MAX_SLICES", "SLICE_LIMBS", "ReplicatedRounds", "state_slices"]


class ReplicatedRounds:
    """The replica level of a managed CrossShardOptimizer (see the module docstring).

    ``params()``: the wrapper's parameters; ``opt``: the inner optimizer (its hyperparameters
    are part of the words); ``mean``: divide by the participants (MEAN) or not (SUM);
    ``wire``: the ``compression`` format of the all-reduce; ``within``: the process group
    of this replica group's own processes when each holds its shards of the model
    (:mod:`distoptim.sync.managed_shards`: the words carry the group's combined checksum);
    ``slices``: when each of the group's ``k > 1`` processes holds the whole model, which
    ``1/k`` of every bucket this one averages across the groups
    (:mod:`distoptim.sync.group_slices`).
    """

    def __init__(
        self,
        manager: Any,
        owner: str,
        params: Callable[[], list[torch.Tensor]],
        opt: torch.optim.Optimizer,
        mean: bool,
        wire: WireFormat,
        stats: CommStats,
        within: Any = None,
        slices: GroupSlices | None = None,
    ) -> None:
        self.replicas = ManagedReplicas(manager, owner)
        self.within = within  # the group's own processes: its checksum combines theirs
        self.slices = slices  # full copies in a group of k: each sends its 1/k across
        self.owner = owner
        self.params = params
        self.opt = opt
        self.mean = mean
        self.wire = wire
        self.stats = stats
        self._started_early = False
        self._heals_at_start = 0
        self._agreed_quorum: int | None = None  # the membership whose plans were checked
        self._clean_quorum: int | None = None  # the last round was clean, in this quorum
        self._clean_table = False  # the table this round judged had no healing or void member
        self._slices: tuple[int, int] | None = None  # (parameter count, K), cached

    def start(self, early: bool) -> None:
        """Start this step's quorum (``early``: from ``zero_grad()``, before the forward pass)."""
        if self.replicas.in_round:
            return
        heals = self.replicas.stats.heals
        # early: forward and backward come before the quorum is awaited, and the state a
        # donor sends must not be read while they run (an FSDP2 module's state_dict()
        # reshards it): the round holds the manager's state reads until step() (see
        # ManagedReplicas.start)
        self.replicas.start(hold_reads=early)
        self._started_early = early
        self._heals_at_start = heals

    def _words(self, kind: RoundKind, step: int, plan: int, count: int, q: Any) -> ReplicaWords:
        # a synchronous-quorum manager heals inside start_quorum(): when that happened in
        # step(), after this replica computed its gradient, its contribution is stale
        healed_late = not self._started_early and self.replicas.stats.heals > self._heals_at_start
        healing = not q.contributes
        part, parts, state = 0, 1, 0
        if not healing:  # a healing member's state is about to be replaced: not judged
            params = [local_view(p) for p in self.params()]  # a DTensor: this shard
            if q.quorum_id == self._clean_quorum:  # see the module docstring
                parts = self._num_slices(params)
                part = step % parts
            state = state_checksum(params, part, parts)
            state = group_checksum(state, self.within, self.owner, step)
        return ReplicaWords(
            kind,
            step=step,
            plan=plan,
            params=count,
            hparams=hparams_digest(self.opt.param_groups),
            state=state,
            void=healed_late,
            healing=healing,
            part=part,
            parts=parts,
        )

    def _num_slices(self, params: list[torch.Tensor]) -> int:
        if self._slices is None or self._slices[0] != len(params):
            self._slices = (len(params), state_slices(params))
        return self._slices[1]

    def _agree(self, words: ReplicaWords, q: Any) -> bool:
        """Launch-and-judge one table of every member's ``words``; False: do not commit."""
        table = encode(words, q.group_rank, q.group_size)
        self.stats.send(ring_allreduce_bytes(table.numel() * 4, q.group_size))
        self.replicas.all_reduce_group(table).wait()
        return self._judge(table, q)

    def _judge(self, table: torch.Tensor, q: Any) -> bool:
        if self.replicas.errored() is not None:
            return False
        everyone = decode(table, q.group_size, self.owner)
        self._clean_table = not any(w.healing or w.void for w in everyone)
        verdict = judge(everyone, q.group_rank, self.owner)
        if not verdict.ok:
            self.replicas.manager.report_error(RuntimeError(verdict.reason))
        return verdict.ok

    def reduce_and_commit(
        self,
        rnd: ReduceRound | None,
        buffers: Sequence[torch.Tensor],
        kind: RoundKind,
        step: int,
        plan: int,
    ) -> bool:
        """Average ``buffers`` (the round's, gradients and flags) over the quorum, agree, and
        return ``should_commit()`` (a healing replica loads a peer's state in it)."""
        self.start(early=False)
        replicas = self.replicas
        q = replicas.quorum()
        count = len(rnd.plan.params) if rnd is not None else 0
        words = self._words(kind, step, plan, count, q)
        self._clean_table = False
        if not q.failed and q.quorum_id != self._agreed_quorum:
            # a new membership: agree before any sized collective (see ft.agreement)
            if self._agree(words, q):
                self._agreed_quorum = q.quorum_id
            else:
                q = replace(q, group_size=0)  # no payload: the round will not commit
        heads = [] if rnd is None else [b[: k.head] for k, b in zip(rnd.plan.buckets, buffers)]
        if not q.failed:
            pending = []
            for head in heads:
                if self.mean and q.participants > 1:
                    head.div_(q.participants)  # before the wire: float16 stays in range
                part = head if self.slices is None else self.slices.part(head)
                wire = self.wire.encode(part)
                nbytes = ring_allreduce_bytes(wire.numel() * wire.element_size(), q.group_size)
                self.stats.send(nbytes)
                replicas.stats.payload_bytes += nbytes
                pending.append((part, wire, replicas.all_reduce_sum(wire)))
            table = encode(words, q.group_rank, q.group_size)
            self.stats.send(ring_allreduce_bytes(table.numel() * 4, q.group_size))
            done = replicas.all_reduce_group(table)
            for part, wire, work in pending:
                work.wait()
                self.wire.decode(wire, part)
            done.wait()
            self._judge(table, q)
        if self.slices is not None:  # every process of the group, whatever the quorum did
            self.slices.gather(heads, self.stats)
        committed = replicas.commit()
        clean = committed and self._clean_table and not q.failed
        self._clean_quorum = q.quorum_id if clean else None
        return committed
