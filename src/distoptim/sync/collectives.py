"""The replicas a ``CrossShardOptimizer`` reduces with, and every collective it issues over them.

Owns two things:

* :class:`Replicas` -- the (sub)group of ``n`` replicas whose gradients are combined: the
  process group (None: the default group), ``n``, this rank's index in it and every member's
  global rank. :meth:`Replicas.join` creates the subgroups of a ``group_assignment``
  (collectively, on every rank) or settles for one shard outside a process group.
* :class:`Collectives` -- the one object through which the optimizer's collectives go: the
  bucket all-reduces (:class:`~distoptim.comm.reducer.BucketAllReduce`), the reduce-scatters of
  weight-update sharding (:class:`~distoptim.comm.shard_reducer.BucketReduceScatter`, over the
  backend's :class:`~distoptim.comm.shard_transport.ShardTransport`) and their control message,
  the parameter all-gather, the gathers of sharded optimizer state, the sequence guard's codec
  (:class:`~distoptim.comm.guard.GuardCodec`), the parameter-list agreement and the bucket-order
  broadcast. Each counts its bytes in one :class:`~distoptim.comm.stats.CommStats`, and a
  collective that fails because a peer left raises :class:`~distoptim.comm.guard.DesyncError`
  naming this rank and what it was waiting for.

Rounds (:mod:`distoptim.sync.rounds`) and the apply strategies (:mod:`distoptim.sync.apply`)
never call ``torch.distributed`` themselves: a different transport (another group per round, a
fault-tolerance manager) replaces this object, not their code.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.fingerprint import MESSAGE_BYTES, check_agreement
from distoptim.comm.groups import comm_device
from distoptim.comm.guard import DesyncError, GuardCodec, ParameterMismatchError
from distoptim.comm.reducer import BucketAllReduce
from distoptim.comm.shard_reducer import BucketReduceScatter, ControlReduce, all_gather_shards
from distoptim.comm.shard_transport import transport_for
from distoptim.comm.stats import CommStats, ring_allreduce_bytes

__all__ = ["Collectives", "Replicas"]


@dataclass(frozen=True)
class Replicas:
    """The replicas whose gradients are combined.

    ``group``: their process group (None: the default group); ``size``: ``n`` (1 outside a
    process group); ``rank``: this rank's index in the group; ``ranks``: the global rank of
    each group index (for messages).
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    ranks: list[int]

    @staticmethod
    def world_size() -> int | None:
        """The default group's size, or None outside an initialized process group."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return None

    @classmethod
    def join(
        cls,
        groups: list[list[int]] | None,
        stacklevel: int,
        quiet: bool = False,
        pg: dist.ProcessGroup | None = None,
        solo: bool = False,
    ) -> Replicas:
        """The replicas of this rank: all ranks, its subgroup of ``groups`` (validated), or the
        given process group ``pg`` (the cross-group channel; ``groups`` is then None).

        Creating subgroups is a collective of the default group: every rank calls this with the
        same ``groups``. Outside a process group, or with world size 1, warns once (at
        ``stacklevel`` from here; not when ``quiet``) and returns one shard. ``solo``: this
        process alone, whatever the world (its shards under a torchft manager, see
        :mod:`distoptim.sync.managed_shards`).
        """
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        if solo:
            return cls(None, 1, 0, [dist.get_rank() if distributed else 0])
        if world == 1:
            if quiet:  # a torchft manager reduces across replica groups of one process
                return cls(None, 1, 0, [0])
            warnings.warn(
                "CrossShardOptimizer: "
                + (
                    "the default process group has world size 1"
                    if distributed
                    else "torch.distributed is not initialized"
                )
                + "; behaving as one shard (gradients are not reduced)",
                UserWarning,
                stacklevel=stacklevel + 1,
            )
            return cls(None, 1, 0, [0])
        group: dist.ProcessGroup | None = pg
        size = world if pg is None else dist.get_world_size(pg)
        if groups is not None:
            group, _ = dist.new_subgroups_by_enumeration(groups)
            size = len(groups[0])
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        return cls(group, size, dist.get_rank(group), ranks)


class Collectives:
    """Every collective of one synchronous optimizer, over ``replicas``, in ``wire`` format.

    Attributes: ``all_reduce`` and ``scatter`` (the bucket reducers rounds launch into),
    ``codec`` (the sequence words' codec; None on one shard), ``stats`` (bytes and counts).
    Sharding's reduce-scatter and all-gather travel over the backend's transport
    (:func:`~distoptim.comm.shard_transport.transport_for`: on gloo, a pairwise exchange of
    point-to-point messages, cheaper in time and memory than gloo's own collectives).
    """

    def __init__(self, replicas: Replicas, wire: WireFormat, stats: CommStats) -> None:
        group, n = replicas.group, replicas.size
        self.replicas = replicas
        self.stats = stats
        self.all_reduce = BucketAllReduce(group, n, wire, stats)
        self.codec = GuardCodec(n, replicas.rank, replicas.ranks) if n > 1 else None
        transport = transport_for(group, n, replicas.rank, replicas.ranks)
        self.scatter = BucketReduceScatter(transport, n, wire, stats)

    @property
    def device(self) -> torch.device:
        """Where small control messages live: the current GPU for NCCL, else the CPU."""
        return comm_device(self.replicas.group)

    @property
    def words(self) -> int:
        """Elements of one round's sequence words (every rank's): 0 on one shard."""
        return self.codec.size if self.codec is not None else 0

    def control(self, plan: BucketPlan) -> ControlReduce:
        """The control message of a sharded round over ``plan``: presence flags and words."""
        device = self.device if self.codec is not None else torch.device("cpu")
        r = self.replicas
        return ControlReduce(plan, self.words, device, r.group, r.size, self.stats)

    def all_gather(
        self, flats: Sequence[torch.Tensor], what: str = "the updated parameters"
    ) -> None:
        """Every rank's range of each flat buffer to every rank, in place (sharding).

        ``what`` the buffers hold, for the error if a peer left.
        """
        try:
            all_gather_shards(flats, self.scatter.transport, self.stats)
        except RuntimeError as exc:
            raise self.peer_lost(f"the all-gather of {what}", exc) from exc

    def sum_scalar(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a few elements) summed over the group, on every rank (``max_grad_norm``'s
        norm of a sharded gradient); ``t`` itself on one shard."""
        r = self.replicas
        if r.size == 1:
            return t
        out = t.to(self.device)
        self.stats.send(ring_allreduce_bytes(out.numel() * out.element_size(), r.size))
        try:
            dist.all_reduce(out, group=r.group)
        except RuntimeError as exc:
            raise self.peer_lost("the gradient-norm all-reduce (max_grad_norm)", exc) from exc
        return out.to(t.device)

    def gather_objects(self, obj: object, what: str) -> list[object]:
        """Every rank's ``obj`` (picklable), in group-rank order, on every rank (a small
        collective: error messages, the shard layout of a per-rank checkpoint).

        ``what`` names the exchange for the error if a peer left.
        """
        out: list[object] = [None] * self.replicas.size
        try:
            dist.all_gather_object(out, obj, group=self.replicas.group)
        except RuntimeError as exc:
            raise self.peer_lost(what, exc) from exc
        return out

    def agree(self, params: Sequence[torch.Tensor], options: Mapping[str, object]) -> None:
        """Check that every rank has the same parameter list and ``options`` (one all-gather).

        Raises :class:`~distoptim.comm.guard.ParameterMismatchError` on every rank if not.
        """
        # all-gather: this rank forwards (n - 1) fixed-size messages
        self.stats.send(MESSAGE_BYTES * (self.replicas.size - 1))
        try:
            check_agreement(params, options, self.replicas.group, self.device)
        except ParameterMismatchError:
            raise
        except RuntimeError as exc:
            raise self.peer_lost("the parameter-list agreement", exc) from exc

    def broadcast_order(self, order: list[int]) -> list[int]:
        """The group's first rank's ``order`` (same length on every rank), on every rank."""
        t = torch.tensor(order, dtype=torch.int64, device=self.device)
        # approximate: a pipelined broadcast forwards the message once per rank
        self.stats.send(t.numel() * t.element_size())
        group = self.replicas.group
        src = 0 if group is None else dist.get_global_rank(group, 0)
        try:
            dist.broadcast(t, src=src, group=group)
        except RuntimeError as exc:
            raise self.peer_lost("the bucket-order broadcast", exc) from exc
        return t.tolist()  # type: ignore[no-any-return]

    @staticmethod
    def peer_lost(what: str, exc: BaseException) -> DesyncError:
        """The error of a collective that failed while this rank waited for its peers."""
        return DesyncError(
            f"CrossShardOptimizer: rank {dist.get_rank()}: {what} failed while waiting for the "
            f"other ranks of its group: {exc}\nA peer stopped taking part in this group's "
            "collectives: it raised (its own error is the real cause), returned, crashed, or "
            "entered a different collective."
        )
