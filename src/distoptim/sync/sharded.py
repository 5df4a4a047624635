"""The weight-update sharding strategy: reduce-scatter, a ``1/n`` inner step, all-gather.

Owns :class:`ShardedApply` (``shard_optimizer_state=True``; Xu et al. 2020, ZeRO stage 1): a
round reduce-scatters every bucket's gradient region into this rank's shard, and carries the
presence flags and the sequence words in one small control all-reduce
(:mod:`distoptim.comm.shard_reducer`); once every rank agreed on the round, the wrapped
optimizer steps this rank's flat slice only (:class:`~distoptim.sync.sharding.ShardedUpdate`)
and the updated parameters are all-gathered. ``.grad`` keeps the local gradient, in tensors of
its own or in bucket views (the strategy's :class:`~distoptim.sync.apply.GradSource`).

State. The per-parameter optimizer state lives in the shards of the agreed plan; the state of
parameters outside it (frozen ones, or ones a new plan dropped) is *parked* here by parameter,
and a plan change carries the state over (a collective gather of the old layout, then each rank
keeps its new pieces). :meth:`ShardedApply.full_state` gathers it back into the unsharded
per-parameter format, so checkpoints load into a sharded or an unsharded optimizer alike.
:meth:`ShardedApply.owned` gives each rank's own part instead (per-rank checkpoints,
:mod:`distoptim.sync.sharded_checkpoint`).

Memory. Between steps a rank keeps the parameters (the flat buffers are their storage), ``.grad``
(with bucket views the buckets themselves; otherwise tensors of their own plus one persistent
pack buffer per bucket, as the unsharded optimizer and DDP keep), ``1/n`` of the state and the
small control message. Each round allocates the shards it reduces into (``1/n`` of its
buckets); they are freed with the round, at the end of the step.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.reducer import ReduceRound
from distoptim.comm.shard import ShardLayout
from distoptim.comm.shard_reducer import ControlReduce, ShardRound
from distoptim.protocol import GradsAndVars
from distoptim.sync.apply import (
    ApplyStrategy,
    BufferOf,
    GradPairs,
    GradSource,
    Owned,
    PlanShape,
    State,
)
from distoptim.sync.collectives import Collectives
from distoptim.sync.options import SyncOptions
from distoptim.sync.sharding import ShardedUpdate

if TYPE_CHECKING:  # pragma: no cover
    from distoptim.sync.rounds import RoundDriver

__all__ = ["ShardedApply"]


class ShardedApply(ApplyStrategy):
    """Reduce-scatter ``.grad``, step this rank's slice with ``opt``, all-gather the parameters.

    ``update``: the flat buffers, segments and shard state of the agreed plan (None before the
    first step: the parameters' storage moves into the flat buffers then); ``parked``: the
    state of parameters outside that plan, by id: ``(param, state)``.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        params: Callable[[], list[torch.Tensor]],
        options: SyncOptions,
        comm: Collectives,
        grads: GradSource,
    ) -> None:
        super().__init__(opt, params, options, comm, grads)
        self.update: ShardedUpdate | None = None
        self.control: ControlReduce | None = None
        self.parked: dict[int, tuple[torch.Tensor, State]] = {}

    # ---- rounds -------------------------------------------------------------------------
    def plan_shape(self, words: int) -> PlanShape:
        # sharded rounds carry flags and words in a control message
        return PlanShape(trailer=0, pad_to=self.comm.replicas.size, flags=False)

    def reduces_copy(self, overlap: bool) -> bool:
        # a reduce-scatter only reads .grad; an all-reduce standing in for it would not
        return not self.comm.scatter.reads_input_only

    def new_round(
        self,
        plan: BucketPlan,
        grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
        buffer_of: BufferOf,
        divisor: float,
        what: str,
    ) -> ReduceRound:
        update, control = self.update, self.control
        assert update is not None and control is not None and update.plan is plan
        return ShardRound(
            plan,
            self.comm.scatter,
            update.layout,
            control,
            grads_of,
            buffer_of,
            divisor,
            what,
        )

    def follow(self, plan: BucketPlan) -> None:
        """``.grad``, the flat parameters, segments and state follow ``plan``.

        The state moves with its parameters: a collective gather of the old layout's state
        (every rank changes plans at the same point), then each rank keeps its new pieces.
        """
        self.grads.follow(plan)
        if self.update is not None and self.update.plan is plan:
            return
        old = self.update
        carried = dict(self.parked)
        if old is not None:
            for i, state in old.full_state().items():
                p = old.plan.params[i]
                carried[id(p)] = (p, state)
        for p, state in self._absorb_inner_state().items():
            carried[id(p)] = (p, state)
        r = self.comm.replicas
        layout = ShardLayout(plan, r.size, r.rank)
        update = ShardedUpdate(plan, layout, self.opt, self.comm)
        update.load(
            {i: carried.pop(id(p))[1] for i, p in enumerate(plan.params) if id(p) in carried}
        )
        self.parked = carried
        if old is not None:  # parameters that left the plan get storage of their own back
            kept = {id(p) for p in plan.params}
            for p in old.plan.params:
                if id(p) not in kept:
                    p.data = p.data.clone()
        self.control = self.comm.control(plan)
        self.update = update

    # ---- the update ---------------------------------------------------------------------
    def _apply(self, rnd: ReduceRound, buffers: list[torch.Tensor], adopt: bool) -> None:
        """Update this rank's slice from the reduced shards, then all-gather.

        ``adopt``: the round packed ``.grad`` -- with bucket views, gradients it had to copy
        into their slots now point there (their value is unchanged).
        """
        update = self.update
        assert update is not None and update.plan is rnd.plan
        present = rnd.present(buffers)
        if adopt:
            self.grads.adopt_packed()
        if self.clip is not None:  # max_grad_norm: the shards of the reduced gradient
            self.clip.clip_shards(buffers, self.comm.sum_scalar)
        update.ensure_params()
        update.step(self.opt, present, buffers)
        self.comm.all_gather(update.flats)

    def step(self, rnd: ReduceRound, buffers: list[torch.Tensor]) -> None:
        self._apply(rnd, buffers, adopt=True)

    def solo_step(self, rounds: RoundDriver) -> None:
        """One shard: the flat update, without communication."""
        rnd = rounds.grad_round(rounds.solo_plan())
        self._apply(rnd, rnd.wait_all(), adopt=True)

    def apply_pairs(self, pairs: GradsAndVars, rounds: RoundDriver) -> GradPairs | None:
        rnd, buffers = rounds.reduce_pairs({id(v): g for g, v in pairs})
        self._apply(rnd, buffers, adopt=False)
        return None

    # ---- state ----------------------------------------------------------------------------
    def _absorb_inner_state(self) -> dict[torch.Tensor, State]:
        """Take the wrapped optimizer's own per-parameter state out of it (sharding keeps
        state in the shards only): what it built eagerly, or a loaded unsharded checkpoint."""
        state = self.opt.state
        self.opt.state = defaultdict(dict)
        return {p: s for p, s in state.items() if s}

    @property
    def state_is_collective(self) -> bool:
        """The state lives in shards: reading it whole gathers from every rank."""
        return self.update is not None and self.comm.replicas.size > 1

    def full_state(self) -> dict[torch.Tensor, State]:
        """Every parameter's optimizer state, gathered from every rank (a collective)."""
        if self.update is None:
            return dict(self.opt.state)
        update = self.update
        full = {update.plan.params[i]: s for i, s in update.full_state().items()}
        full.update({p: s for p, s in self.parked.values()})
        return full

    @contextlib.contextmanager
    def gathered_state(self) -> Iterator[None]:
        if self.update is None:
            yield
            return
        saved = self.opt.state
        self.opt.state = defaultdict(dict, self.full_state())
        try:
            yield
        finally:
            self.opt.state = saved

    def after_load(self) -> None:
        """Each rank keeps its own slice of every parameter's loaded state (local)."""
        update = self.update
        if update is None:
            return  # the first step takes the state into the shards
        carried = {id(p): (p, s) for p, s in self._absorb_inner_state().items()}
        update.load(
            {i: carried.pop(id(p))[1] for i, p in enumerate(update.plan.params) if id(p) in carried}
        )
        self.parked = carried

    # ---- per-rank checkpoints -------------------------------------------------------------
    def _holders(self) -> dict[int, list[tuple[int, int, int]]]:
        """Per plan member: ``(global rank, first, numel)`` of every rank's piece of it."""
        update = self.update
        assert update is not None
        r = self.comm.replicas
        holders: dict[int, list[tuple[int, int, int]]] = {}
        for q in range(r.size):
            layout = update.layout if q == r.rank else ShardLayout(update.plan, r.size, q)
            for pieces in layout.pieces:
                for piece in pieces:
                    holders.setdefault(piece.member, []).append(
                        (r.ranks[q], piece.first, piece.numel)
                    )
        return holders

    def owned(self) -> dict[torch.Tensor, Owned]:
        """This rank's pieces of the shard state, and the parked state (whole, local)."""
        update = self.update
        if update is None:
            return super().owned()  # no step yet: what opt holds (a loaded checkpoint, or none)
        holders = self._holders()
        out = {p: Owned.whole(p, s) for p, s in self.parked.values() if s}
        for member, (piece, elements, scalars) in update.owned().items():
            out[update.plan.params[member]] = Owned(
                piece.first, piece.numel, elements, scalars, self._shared(holders[member])
            )
        return out

    def _shared(self, holders: list[tuple[int, int, int]]) -> list[tuple[int, int, int]] | None:
        """A parameter's holders, or None on one shard (it holds the whole state: outside a
        process group too, where no ``ShardedTensor`` can be built)."""
        return holders if self.comm.replicas.size > 1 else None

    def slots(self, params: Sequence[torch.Tensor]) -> dict[torch.Tensor, Owned]:
        """This rank's pieces of the agreed plan's parameters; the others whole."""
        update = self.update
        assert update is not None, "the plan is agreed before a per-rank checkpoint loads"
        holders = self._holders()
        out: dict[torch.Tensor, Owned] = {}
        planned = {id(p) for p in update.plan.params}
        for p in params:
            if id(p) not in planned:
                out[p] = Owned(0, p.numel())
        for pieces in update.layout.pieces:
            for piece in pieces:
                p = update.plan.params[piece.member]
                out[p] = Owned(
                    piece.first, piece.numel, holders=self._shared(holders[piece.member])
                )
        return out

    def load_owned(self, owned: dict[torch.Tensor, Owned]) -> None:
        """This rank's pieces go into the shards, the rest is parked (local)."""
        update = self.update
        assert update is not None
        index = {id(p): i for i, p in enumerate(update.plan.params)}
        mine: dict[int, tuple[dict[str, torch.Tensor], State]] = {}
        parked: dict[int, tuple[torch.Tensor, State]] = {}
        for p, o in owned.items():
            if id(p) in index:
                mine[index[id(p)]] = (o.elements, o.scalars)
            else:
                parked[id(p)] = (p, o.as_state(p))
        update.load_owned(mine)
        self.parked = parked
