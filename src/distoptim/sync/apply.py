"""How a round's reduced gradients reach the parameters: the apply strategies' interface.

A ``CrossShardOptimizer`` chooses one :class:`ApplyStrategy` at construction and keeps it:

* :class:`~distoptim.sync.packed.PackedApply` -- ``.grad`` tensors of their own; a round
  all-reduces a packed copy and the inner step sees the reduced gradients swapped into
  ``.grad`` (the local ones come back afterwards);
* :class:`~distoptim.sync.views.ViewsApply` -- ``gradient_as_bucket_view=True``: ``.grad``
  lives in the buckets, the all-reduce runs in place and the inner step reads ``.grad``;
* :class:`~distoptim.sync.sharded.ShardedApply` -- ``shard_optimizer_state=True``: each
  bucket is reduce-scattered, the inner optimizer updates this rank's flat slice only, and the
  parameters are all-gathered (with ``.grad`` in tensors of its own or in bucket views).

A strategy answers for three things: the shape of the bucket plan its rounds need
(:meth:`ApplyStrategy.plan_shape`) and the rounds themselves (:meth:`ApplyStrategy.new_round`,
collectives from :class:`~distoptim.sync.collectives.Collectives`); where ``.grad`` lives, as
its :class:`GradSource`; and the update -- :meth:`ApplyStrategy.step` with an agreed round of
``.grad``, :meth:`ApplyStrategy.solo_step` on one shard, :meth:`ApplyStrategy.apply_pairs` for
given ``(grad, var)`` pairs -- with the per-parameter optimizer state it keeps
(:meth:`ApplyStrategy.full_state`, and by the part each rank holds, :meth:`ApplyStrategy.owned`,
for per-rank checkpoints).

The all-reduce strategies split a step in two, so that ``synchronize()`` can stop between them:
:meth:`ApplyStrategy.hold` puts the reduced gradient into ``.grad`` (a :class:`Held`, which user
code may read and edit: clip the *averaged* gradient, as under DDP), and
:meth:`ApplyStrategy.release` runs the inner step on it -- after ``max_grad_norm``'s clip
(:class:`~distoptim.sync.clipping.GradClip`) -- and puts back what ``.grad`` holds outside a
step. ``step = hold + release``. Weight-update sharding cannot hold: each rank receives only its
``1/n`` of the reduced gradient.

Math shared by all: ``present[i]`` (agreed by every rank) says whether *some* rank had a
gradient for plan parameter ``i``; a parameter no rank had one for is not shown to the inner
optimizer (``.grad`` None for its step), exactly as a single process would skip it.
"""

from __future__ import annotations

import abc
import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.reducer import ReduceRound
from distoptim.elementwise_rule import is_per_element
from distoptim.protocol import GradsAndVars, swapped_grads
from distoptim.sync.clipping import GradClip
from distoptim.sync.collectives import Collectives
from distoptim.sync.local_grads import as_grad_of
from distoptim.sync.options import SyncOptions
from distoptim.sync.sharding import State

if TYPE_CHECKING:  # pragma: no cover - the driver hands itself down for one-shard rounds
    from distoptim.sync.rounds import RoundDriver

__all__ = [
    "AllReduceApply",
    "ApplyStrategy",
    "GradPairs",
    "GradSource",
    "Held",
    "Owned",
    "PlanShape",
    "SwappedHeld",
    "State",
    "reduced_pairs",
]

GradPairs = list[tuple[torch.Tensor, torch.Tensor]]
"""``(gradient, parameter)`` pairs for :func:`distoptim.protocol.swapped_grads`."""

BufferOf = Callable[[Bucket], torch.Tensor]


@dataclass(frozen=True)
class PlanShape:
    """What a strategy's rounds need of the bucket plan (see :class:`BucketPlan`)."""

    trailer: int  # sequence-word elements in the last bucket (0: the words travel elsewhere)
    pad_to: int  # gradient regions padded to a multiple of this (shards per bucket)
    flags: bool  # presence flags in the buckets


@dataclass
class Owned:
    """The part of one parameter's optimizer state a rank holds (:meth:`ApplyStrategy.owned`).

    Elements ``[first, first + numel)`` of the parameter's flat (row-major) order.
    ``elements``: the per-element state, 1-D tensors of ``numel`` elements; ``scalars``: the
    rest (Adam's ``step``, ...). ``holders``: ``(global rank, first, numel)`` of every piece of
    the parameter held in this rank's group (this one included), or None when every rank holds
    the whole parameter's state.
    """

    first: int
    numel: int
    elements: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: State = field(default_factory=dict)
    holders: list[tuple[int, int, int]] | None = None

    @staticmethod
    def whole(param: torch.Tensor, state: State) -> Owned:
        """All of ``param``'s ``state`` (per-element values flattened, no copy)."""
        owned = Owned(0, param.numel())
        for key, value in state.items():
            if is_per_element(key, value, param.shape):
                owned.elements[key] = value.reshape(-1)
            else:
                owned.scalars[key] = value
        return owned

    def as_state(self, param: torch.Tensor) -> State:
        """The per-parameter state of a whole parameter (per-element values in its shape)."""
        state = dict(self.scalars)
        for key, value in self.elements.items():
            state[key] = value.view(param.shape)
        return state


def reduced_pairs(rnd: ReduceRound, buffers: Sequence[torch.Tensor]) -> GradPairs:
    """``(reduced grad, param)`` for every param some rank had a grad for (views, no copy)."""
    params = rnd.plan.params
    pairs = []
    for bucket, buffer in zip(rnd.plan.buckets, buffers):
        for i, view, present in zip(bucket.members, bucket.views(buffer), bucket.present(buffer)):
            if present:  # no rank had a gradient: leave it out, the optimizer skips it
                pairs.append((view, params[i]))
    return pairs


class Held(abc.ABC):
    """A reduced gradient sitting in ``.grad``, waiting for the inner step (or for a drop)."""

    @abc.abstractmethod
    def step(self, opt: torch.optim.Optimizer, clip: GradClip | None) -> None:
        """Clip (if asked), run ``opt.step()`` on ``.grad``, then leave ``.grad`` as a step
        leaves it outside a step."""

    @abc.abstractmethod
    def drop(self) -> None:
        """Forget the reduced gradient without stepping (``zero_grad`` follows)."""


class SwappedHeld(Held):
    """``.grad`` of ``params`` swapped for the given pairs' gradients (None where absent); the
    saved ``.grad`` tensors come back after the step (or the drop)."""

    def __init__(
        self, params: list[torch.Tensor], pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.params = params
        self.saved = [p.grad for p in params]
        by_id = {id(v): g for g, v in pairs}
        for p in params:
            g = by_id.get(id(p))
            p.grad = None if g is None else as_grad_of(g, p)

    def step(self, opt: torch.optim.Optimizer, clip: GradClip | None) -> None:
        try:
            if clip is not None:
                clip.clip(self.params)
            opt.step()
        finally:
            self.drop()

    def drop(self) -> None:
        for p, g in zip(self.params, self.saved):
            p.grad = g


class GradSource(abc.ABC):
    """Where ``.grad`` lives: what a round packs, into which buffers, and what it leaves."""

    @abc.abstractmethod
    def follow(self, plan: BucketPlan) -> None:
        """``.grad`` follows ``plan`` (the agreed one; on one shard, this rank's own)."""

    @abc.abstractmethod
    def grads_of(self, plan: BucketPlan) -> Callable[[Bucket], Sequence[torch.Tensor | None]]:
        """What a round over ``plan`` packs for a bucket: its members' gradients (None where
        absent)."""

    @abc.abstractmethod
    def buffers(
        self, plan: BucketPlan, fresh: bool, copy: bool
    ) -> tuple[BufferOf, BufferOf | None]:
        """``(buffer_of, source_of)`` of a ``.grad`` round over ``plan``.

        ``buffer_of``: the buffers it packs into and reduces -- the persistent ones, new ones
        (``fresh``), or, when ``.grad`` lives in the persistent ones and the round's collective
        would overwrite it while user code may still read it (``copy``), the spare ones.
        ``source_of``: where the gradients may already sit (copied whole), or None.
        """

    @abc.abstractmethod
    def scratch_buffer(self) -> BufferOf:
        """Buffers for a round whose result nobody reads (``finish()``): never ``.grad``."""

    @abc.abstractmethod
    def in_place(self, rnd: ReduceRound) -> bool:
        """Did ``rnd`` overwrite ``.grad`` itself (then :meth:`settle` must follow)?"""

    @abc.abstractmethod
    def settle(self, rnd: ReduceRound, buffers: Sequence[torch.Tensor], factor: float) -> None:
        """After an in-place round: ``.grad`` holds the replica mean (``factor = d / n``)."""

    @abc.abstractmethod
    def adopt_packed(self) -> None:
        """A round packed ``.grad``: gradients it copied into their slots now point there."""

    @abc.abstractmethod
    def zero(self, params: Sequence[torch.Tensor], set_to_none: bool) -> bool:
        """``zero_grad``: True if done here, False to leave it to ``torch.optim``."""


class ApplyStrategy(abc.ABC):
    """One way of applying reduced gradients with the wrapped optimizer ``opt``.

    ``params()``: the wrapper's parameters (every param group); ``grads``: where ``.grad``
    lives. The strategy is chosen once, at construction, from the options.
    """

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        params: Callable[[], list[torch.Tensor]],
        options: SyncOptions,
        comm: Collectives,
        grads: GradSource,
    ) -> None:
        self.opt = opt
        self.params = params
        self.options = options
        self.comm = comm
        self.grads = grads
        clip = options.max_grad_norm
        self.clip = None if clip is None else GradClip(clip)
        self.held: Held | None = None

    @property
    def divisor(self) -> int:
        """The ``.grad`` rounds' divisor ``d`` (``n N`` for MEAN, 1 for SUM)."""
        return self.options.divisor(self.comm.replicas.size)

    # ---- rounds -------------------------------------------------------------------------
    @abc.abstractmethod
    def plan_shape(self, words: int) -> PlanShape:
        """The bucket plan's shape, for rounds whose sequence words take ``words`` elements."""

    @abc.abstractmethod
    def reduces_copy(self, overlap: bool) -> bool:
        """Must a ``.grad`` round reduce a copy when ``.grad`` lives in its buffers?"""

    @abc.abstractmethod
    def new_round(
        self,
        plan: BucketPlan,
        grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
        buffer_of: BufferOf,
        divisor: float,
        what: str,
    ) -> ReduceRound:
        """One round over the agreed ``plan`` (see :class:`~distoptim.comm.reducer.ReduceRound`)."""

    def follow(self, plan: BucketPlan) -> None:
        """Every rank's rounds use ``plan`` from now on: ``.grad`` (and any state) follows."""
        self.grads.follow(plan)

    # ---- the update -----------------------------------------------------------------------
    def step(self, rnd: ReduceRound, buffers: list[torch.Tensor]) -> None:
        """Apply an agreed round of ``.grad`` with one inner ``opt.step()``."""
        self.hold(rnd, buffers)
        self.release()

    def solo_step(self, rounds: RoundDriver) -> None:
        """One shard: one inner step (``.grad`` divided for MEAN with accumulated passes)."""
        self.hold_solo(rounds)
        self.release()

    def hold(self, rnd: ReduceRound, buffers: list[torch.Tensor]) -> None:
        """Put an agreed round's reduced gradient into ``.grad`` until :meth:`release`."""
        self.held = self._hold(rnd, buffers)

    def hold_solo(self, rounds: RoundDriver) -> None:
        """One shard: put what the step will apply into ``.grad`` until :meth:`release`."""
        self.held = self._hold_solo(rounds)

    def release(self) -> None:
        """Run the inner step on the held ``.grad`` (clipped first with ``max_grad_norm``)."""
        held, self.held = self.held, None
        assert held is not None
        held.step(self.opt, self.clip)

    def drop(self) -> None:
        """Forget a held gradient without stepping (``zero_grad`` after ``synchronize()``)."""
        held, self.held = self.held, None
        if held is not None:
            held.drop()

    def _hold(self, rnd: ReduceRound, buffers: list[torch.Tensor]) -> Held:
        raise TypeError(f"{type(self).__name__} cannot hold a reduced gradient in .grad")

    def _hold_solo(self, rounds: RoundDriver) -> Held:
        raise TypeError(f"{type(self).__name__} cannot hold a reduced gradient in .grad")

    def clip_pairs(self, pairs: GradPairs, copy: bool) -> GradPairs:
        """The TF path: the pairs clipped with ``max_grad_norm`` (copies first if ``copy``:
        they are the caller's tensors)."""
        if self.clip is None:
            return pairs
        pairs = [(g.to(dtype=v.dtype, device=v.device, copy=copy), v) for g, v in pairs]
        ids = {id(v) for _, v in pairs}
        params = [p for p in self.params() if id(p) in ids]  # the optimizer's order
        with swapped_grads(params, pairs):
            self.clip.clip(params)
        return pairs

    @abc.abstractmethod
    def apply_pairs(self, pairs: GradsAndVars, rounds: RoundDriver) -> GradPairs | None:
        """The TF path: reduce the given pairs; return the reduced pairs for the caller's inner
        step, or None when the strategy applied them itself."""

    # ---- state ----------------------------------------------------------------------------
    @property
    def state_is_collective(self) -> bool:
        """Is reading the whole state (:meth:`full_state`) a collective of the group?"""
        return False

    def full_state(self) -> dict[torch.Tensor, State]:
        """Every parameter's optimizer state (a collective where the state is sharded)."""
        return dict(self.opt.state)

    @contextlib.contextmanager
    def gathered_state(self) -> Iterator[None]:
        """Within the block ``opt.state`` is the full per-parameter state."""
        yield

    def after_load(self) -> None:  # noqa: B027 - most strategies keep no state of their own
        """``opt`` just loaded a state dict: take what this strategy keeps elsewhere."""

    def owned(self) -> dict[torch.Tensor, Owned]:
        """The optimizer state this rank holds, by parameter (local): unsharded, all of it."""
        return {p: Owned.whole(p, s) for p, s in self.opt.state.items() if s}

    def slots(self, params: Sequence[torch.Tensor]) -> dict[torch.Tensor, Owned]:
        """Which part of each of ``params``' state this rank would hold (empty :class:`Owned`;
        parameters it holds nothing of are left out): unsharded, all of it."""
        return {p: Owned(0, p.numel()) for p in params}

    def load_owned(self, owned: dict[torch.Tensor, Owned]) -> None:
        """Replace the optimizer state by ``owned`` (laid out as :meth:`slots` says; local)."""
        self.opt.state = defaultdict(dict, {p: o.as_state(p) for p, o in owned.items()})


class AllReduceApply(ApplyStrategy):
    """The all-reduce strategies' common rounds: every rank gets every reduced gradient.

    A round's last bucket carries the sequence words; its all-reduce writes the sum into the
    packed buffers, which is ``.grad`` itself when gradients are bucket views -- so with
    overlap (user code runs while the round is in flight) such a round reduces a copy.
    """

    def plan_shape(self, words: int) -> PlanShape:
        return PlanShape(trailer=words, pad_to=1, flags=True)

    def reduces_copy(self, overlap: bool) -> bool:
        return overlap

    def new_round(
        self,
        plan: BucketPlan,
        grads_of: Callable[[Bucket], Sequence[torch.Tensor | None]],
        buffer_of: BufferOf,
        divisor: float,
        what: str,
    ) -> ReduceRound:
        return ReduceRound(plan, self.comm.all_reduce, grads_of, buffer_of, divisor, what)

    def apply_pairs(self, pairs: GradsAndVars, rounds: RoundDriver) -> GradPairs | None:
        if rounds.size == 1:
            return list(pairs)  # type: ignore[arg-type]
        return reduced_pairs(*rounds.reduce_pairs({id(v): g for g, v in pairs}))
