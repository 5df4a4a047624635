"""The worker side shared by every asynchronous algorithm: accumulate, commit, pull.

Owns: :class:`AsyncWorkerOptimizer`, the ``torch.optim.Optimizer`` a worker trains with, and its
session-run hook. It validates its parameters and hyperparameters at construction, connects to
the cluster of its process, places each parameter's center variable on a shard
(``AGNCustomGetter``), seeds or pulls the centers, runs the wrapped optimizer locally every step
and, every ``communication_period`` (λ) steps, sends **one request per shard** carrying one
flat buffer per dtype and receives that shard's center in the same round trip (that round is
:class:`~distoptim.agn.commit_round.CommitRound`, a base of the optimizer). The algorithms
(:mod:`~distoptim.agn.agn`, :mod:`~distoptim.agn.downpour`, :mod:`~distoptim.agn.easgd`)
differ only in three small pieces a subclass provides, per
:class:`~distoptim.agn.shard_link.ShardLink` and per chunk of its plan (the extension point,
documented there):

* ``_payload_part(link, chunk, dst)``: what it commits (e.g. ``a/λ``, ``θ - θ_pulled``, ``θ``);
* ``_absorb_part(link, chunk, reply)``: what the local copy becomes (default: the center);
* ``_server_rule()``: how the shard applies a commit (:mod:`distoptim.agn.rules`).

A worker step, in order: validate (initialized?) → accumulate (AGN: ``a += g``) → the
wrapped optimizer's ``step()`` on the local parameters → ``local_step += 1`` → if
``local_step % λ == 0``: commit and absorb. Nothing waits for other workers.

A commit, per shard, when the shard asks for streaming (p2p, ``DISTOPTIM_AGN_STREAM=1``): the
header goes first; then chunk ``k`` of the payload is written and made ready (the shard applies
it while the worker writes chunk ``k + 1``); once every shard's payload is written the worker
tells each its verdict; then it takes each reply chunk as it arrives (the shard still works on
the next ones) and finally reads the outcome. Otherwise (the default, and rpc) the payload is
written whole, sent, and the reply absorbed chunk by chunk once it is back -- on the same
machine straight from the shard's memory, released once absorbed.

Refused commits: with several shards the worker checks its payload as it writes it (a ``sum`` of
each chunk while in cache) and, if any value is NaN/Inf, tells every shard to refuse it
(verdict ``refuse``, or an empty "refused" commit when not streaming) so that *no* shard applies
a part of it; a shard also refuses a commit whose *result* would not be finite
(:mod:`distoptim.agn.center_guard`). Either way that shard's center is untouched, it counts a
refusal, and the worker warns (``RuntimeWarning``, with the reason) and takes the center as its
local copy.

A restarted shard (p2p, ``reconnect_timeout > 0``): a request that finds the connection broken
reconnects (bounded) and the worker re-pulls that shard's center into its local copy; the
commit in flight is lost. Links of other optimizers on that shard resynchronize before their
next commit (their ``incarnation`` is behind the connection's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distoptim.agn.cluster import Cluster, current_cluster
from distoptim.agn.commit_round import CommitRound
from distoptim.agn.flat import Chunk, FlatLayout, nbytes
from distoptim.agn.getter import AGNCustomGetter
from distoptim.agn.rules import ServerRule
from distoptim.agn.shard_link import ShardLink
from distoptim.agn.transport.base import ShardLostError
from distoptim.agn.transport.messages import (
    Pull,
    PullReply,
    Seed,
    TableSpec,
)
from distoptim.checks import check_bool, check_finite_hyperparameters, check_int
from distoptim.comm.link import transmit
from distoptim.protocol import WrappedOptimizer

__all__ = ["AsyncWorkerOptimizer", "SessionRunHook"]


class SessionRunHook:
    """TF's ``SessionRunHook`` for an async optimizer: initialization of the centers.

    ``begin()`` connects the optimizer to the cluster (placement, buffers; no message).
    ``after_create_session()`` seeds on the chief (center variables and the server optimizer
    from the chief's parameters; a shard resumed from a checkpoint keeps its center) and then
    runs ``get_init_op(task_index)`` everywhere: wait for the seed (bounded by the cluster's
    ``rpc_timeout``), local parameters := center, accumulators := 0.
    """

    def __init__(self, optimizer: AsyncWorkerOptimizer, is_chief: bool, task_index: int) -> None:
        self._opt = optimizer
        self.is_chief = is_chief
        self.task_index = task_index

    def begin(self) -> None:
        self._opt._connect(self.task_index)

    def after_create_session(self, session: Any = None, coord: Any = None) -> None:
        if self._opt._conn is None:
            self.begin()
        if self.is_chief:
            self._opt._seed()
        self._opt.get_init_op(self.task_index)()

    def before_run(self, run_context: Any = None) -> None:
        """Nothing to do before a step (TF hook API)."""

    def after_run(self, run_context: Any = None, run_values: Any = None) -> None:
        """Nothing to do after a step (TF hook API)."""

    def end(self, session: Any = None) -> None:
        """Nothing to do at the end (TF hook API)."""


@dataclass
class _Connection:
    cluster: Cluster
    task_index: int
    links: list[ShardLink]
    num_params: int


def _check_params(owner: str, optimizer: torch.optim.Optimizer) -> None:
    """Dense floating CPU tensors only, named by their place in ``param_groups`` otherwise."""
    seen: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            where = f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}, {p.dtype})"
            if id(p) in seen:
                raise ValueError(f"{owner}: {where} appears twice in the optimizer's param_groups")
            seen.add(id(p))
            if p.is_meta:
                raise TypeError(
                    f"{owner}: {where} is on the meta device (it has no values to serve); "
                    "materialize the model first, e.g. model.to_empty(device='cpu') and "
                    "initialize it, then build the optimizer"
                )
            if p.is_sparse or p.layout != torch.strided:
                raise TypeError(
                    f"{owner}: {where} is a {p.layout} tensor; the parameter server holds "
                    "dense tensors only"
                )
            if not p.is_floating_point():
                raise TypeError(
                    f"{owner}: {where} is not floating point; the parameter server trains "
                    "floating-point parameters only (float16/bfloat16/float32/float64)"
                )
            if p.device.type != "cpu":
                raise TypeError(
                    f"{owner}: {where} is on {p.device}; the parameter server moves CPU "
                    "tensors (keep the model on the CPU, or copy to and from the device "
                    "around the optimizer)"
                )


class AsyncWorkerOptimizer(CommitRound, WrappedOptimizer):
    """Base of the parameter-server optimizers (see the module docstring).

    Read-outs: ``local_step`` (worker steps), ``global_step`` (the center's version as last
    seen from the shards: accepted commits of all workers), ``lost_commits`` (commits whose
    shard died before answering; the worker then resynchronized with the restarted shard),
    ``center_variables()``.
    """

    algorithm = "async"
    _keeps_accumulator = False
    _keeps_pulled = False

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_worker: int,
        custom_getter: AGNCustomGetter | None = None,
        communication_period: int = 10,
        use_locking: bool = True,
        name: str = "AsyncWorkerOptimizer",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer (e.g. torch.optim.SGD), "
                f"got {type(optimizer).__name__}"
            )
        check_int("num_worker", num_worker, 1)
        check_int("communication_period", communication_period, 1)
        if custom_getter is not None and not isinstance(custom_getter, AGNCustomGetter):
            raise TypeError(
                "custom_getter must be a distoptim.AGNCustomGetter or None (the cluster's "
                f"default placement), got {type(custom_getter).__name__}"
            )
        check_bool("use_locking", use_locking)
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        check_finite_hyperparameters(optimizer, type(self).__name__)
        _check_params(type(self).__name__, optimizer)
        super().__init__(optimizer, name=name)
        self.num_worker = int(num_worker)
        self.communication_period = int(communication_period)
        self.custom_getter = custom_getter
        self.use_locking = use_locking
        self.local_step = 0
        self.global_step = 0
        self.lost_commits = 0
        self._conn: _Connection | None = None
        self._ready = False

    # ---- per-algorithm pieces -------------------------------------------------------------------
    def _server_rule(self) -> ServerRule:
        raise NotImplementedError

    def _payload_target(self, link: ShardLink) -> dict[str, torch.Tensor]:
        """Where this commit's payload is written: ``link.out`` (free to send) when set, else
        the link's own send buffers."""
        return link.out if link.out is not None else link.send_buffers()

    def _payload_part(self, link: ShardLink, chunk: Chunk, dst: dict[str, torch.Tensor]) -> None:
        """Write chunk ``chunk`` of this commit's payload into ``dst``."""
        raise NotImplementedError

    def _payload(self, link: ShardLink) -> dict[str, torch.Tensor]:
        """The whole payload (default: every chunk of :meth:`_payload_part`, in
        :meth:`_payload_target`). An algorithm overriding this commits whole buffers."""
        dst = self._payload_target(link)
        for chunk in link.chunks:
            self._payload_part(link, chunk, dst)
        return dst

    def _absorb_part(self, link: ShardLink, chunk: Chunk, reply: dict[str, torch.Tensor]) -> None:
        """Chunk ``chunk`` of the reply is in ``reply`` (provisional until the commit is
        accepted); default: that chunk of the local copy becomes the center's."""
        link.assign_part(chunk, reply)
        if self._keeps_pulled:
            link.keep_part(chunk, reply)

    def _absorbed(self, link: ShardLink, reply: dict[str, torch.Tensor]) -> None:
        """After the last chunk of an accepted commit: the accumulator is zero, the center just
        taken is the last pulled one."""
        link.acc_is_zero = True
        if self._keeps_pulled:
            link.pulled = link.kept(reply)

    def _absorb(
        self, link: ShardLink, sent: dict[str, torch.Tensor], reply: dict[str, torch.Tensor]
    ) -> None:
        """After an accepted commit, whole (default: every chunk of :meth:`_absorb_part`, then
        :meth:`_absorbed`). An algorithm overriding this absorbs replies whole."""
        for chunk in link.chunks:
            self._absorb_part(link, chunk, reply)
        self._absorbed(link, reply)

    def _in_parts(self) -> tuple[bool, bool]:
        """Whether this algorithm writes its payload chunk by chunk (it does not override
        :meth:`_payload`) and absorbs replies chunk by chunk (it does not override
        :meth:`_absorb`)."""
        base = AsyncWorkerOptimizer
        return type(self)._payload is base._payload, type(self)._absorb is base._absorb

    # ---- shared worker machinery ----------------------------------------------------------------
    def _reset_to(self, link: ShardLink, center: dict[str, torch.Tensor]) -> None:
        """Local copy := center, accumulator := 0, last pull := center."""
        link.assign(center)
        link.acc_is_zero = True  # saves a pass over a: the next step writes g instead of adding it
        if self._keeps_pulled:
            link.pulled = link.keep(center)

    def _connect(self, task_index: int) -> None:
        """Placement and buffers (``hook.begin()``); no message is sent."""
        check_int("task_index", task_index, 0)
        cluster = current_cluster()
        if not cluster.is_worker:
            raise RuntimeError(f"{self._name} runs on workers; this process is {cluster.name}")
        if task_index != cluster.task_index:
            raise ValueError(
                f"this process is worker {cluster.task_index} of the cluster, got "
                f"task_index={task_index} (pass ctx.task_index)"
            )
        if self.num_worker != cluster.num_worker:
            raise ValueError(
                f"num_worker={self.num_worker} but the cluster expects {cluster.num_worker} "
                "workers (pass ctx.num_worker)"
            )
        getter = self.custom_getter or cluster.custom_getter
        if getter.num_ps is not None and getter.num_ps != cluster.num_ps:
            raise ValueError(
                f"custom_getter places on {getter.num_ps} shards, the cluster has "
                f"{cluster.num_ps} parameter servers"
            )
        params = self._all_params()
        if not params:
            raise ValueError(f"{self._name} has no parameters to distribute")
        _check_params(type(self).__name__, self.wrapped)
        placement = getter.placement(params, cluster.num_ps)
        links = []
        for shard in range(cluster.num_ps):
            pos = [i for i, s in enumerate(placement) if s == shard]
            if not pos:
                continue
            held = [params[i] for i in pos]
            link = ShardLink(shard, pos, held, FlatLayout([(p.shape, p.dtype) for p in held]))
            if self._keeps_accumulator:
                link.acc = link.layout.zeros(held[0].device)
                link.acc_views = link.layout.views(link.acc)
            links.append(link)
        for link in links:  # same machine: a shared segment for this link's messages
            cluster.transport.reserve(link.shard, link.segment_bytes())
        self._conn = _Connection(cluster, task_index, links, len(params))
        self._ready = False

    def _require_connected(self) -> _Connection:
        if self._conn is None:
            raise RuntimeError(
                f"{self._name} is not connected: call hook = opt.make_session_run_hook(is_chief, "
                "task_index); hook.begin(); hook.after_create_session() first"
            )
        if len(self._all_params()) != self._conn.num_params:
            raise RuntimeError(
                f"{self._name}: parameters were added after initialization; the center "
                "variables cannot follow (build the full model before the hook runs)"
            )
        return self._conn

    def _spec(self, link: ShardLink) -> TableSpec:
        rule = self._server_rule()
        groups: list[tuple[int, dict[str, Any], list[int]]] = []
        if rule.uses_optimizer:
            where = {}
            for gi, g in enumerate(self.param_groups):
                for p in g["params"]:
                    where[id(p)] = gi
            for gi, g in enumerate(self.param_groups):
                pos = [j for j, p in enumerate(link.params) if where[id(p)] == gi]
                if pos:
                    hp = {k: v for k, v in g.items() if k != "params"}
                    groups.append((gi, hp, pos))
        return TableSpec(
            algorithm=self.algorithm,
            rule=rule,
            param_indices=list(link.positions),
            shapes=[tuple(p.shape) for p in link.params],
            dtypes=[p.dtype for p in link.params],
            use_locking=self.use_locking,
            optimizer_cls=type(self.wrapped) if rule.uses_optimizer else None,
            defaults=dict(self.wrapped.defaults) if rule.uses_optimizer else {},
            groups=groups,
        )

    def _seed(self) -> None:
        """Chief: create the center variables (and the server optimizer) on every shard."""
        conn = self._require_connected()
        pending = []
        for link in conn.links:
            flats = link.local()
            transmit(nbytes(flats))
            seed = Seed(self._name, self._spec(link), flats)
            pending.append(conn.cluster.send(link.shard, seed))
        for p in pending:
            conn.cluster.receive(p)

    def _pull_request(self, link: ShardLink, wait_s: float) -> Pull:
        conn = self._require_connected()
        return Pull(self._name, conn.task_index, self.algorithm, link.layout.signature(), wait_s)

    def _pull(self, wait_s: float) -> list[PullReply]:
        conn = self._require_connected()
        timeout = wait_s + conn.cluster.rpc_timeout
        pending = [
            conn.cluster.send(link.shard, self._pull_request(link, wait_s), timeout=timeout)
            for link in conn.links
        ]
        replies = []
        for link, p in zip(conn.links, pending):
            try:
                reply = conn.cluster.receive(p)
            except ShardLostError as exc:
                conn.cluster.reconnect(link.shard, exc)
                reply = conn.cluster.request(
                    link.shard, self._pull_request(link, wait_s), timeout=timeout
                )
            assert isinstance(reply, PullReply)
            replies.append(reply)
            self.global_step = max(self.global_step, reply.version)
        return replies

    def _resync(self, link: ShardLink) -> None:
        """After a shard restart: pull its (resumed) center into the local copy."""
        conn = self._require_connected()
        cluster = conn.cluster
        reply = cluster.request(
            link.shard,
            self._pull_request(link, cluster.rpc_timeout),
            timeout=2 * cluster.rpc_timeout,
        )
        assert isinstance(reply, PullReply)
        link.version = reply.version
        link.incarnation = cluster.incarnation(link.shard)
        link.sent_hparams.clear()
        self._reset_to(link, reply.flats)

    def _initialize(self, task_index: int) -> None:
        if self._conn is None or self._conn.task_index != task_index:
            self._connect(task_index)
        conn = self._require_connected()
        replies = self._pull(wait_s=conn.cluster.rpc_timeout)
        for link, r in zip(conn.links, replies):
            link.version = r.version
            link.incarnation = conn.cluster.incarnation(link.shard)
            self._reset_to(link, r.flats)
        self._ready = True

    # ---- TF API ---------------------------------------------------------------------------------
    def make_session_run_hook(self, is_chief: bool, task_index: int) -> SessionRunHook:
        """The hook that initializes the centers (see :class:`SessionRunHook`)."""
        check_bool("is_chief", is_chief)
        check_int("task_index", task_index, 0)
        return SessionRunHook(self, is_chief, task_index)

    def get_init_op(self, task_index: int) -> Callable[[], None]:
        """A callable: wait (bounded) for the centers, local params := center, accumulators := 0.

        ``task_index`` may exceed ``num_worker - 1`` for a late worker (elastic clusters).
        """
        check_int("task_index", task_index, 0)
        return lambda: self._initialize(task_index)

    def center_variables(self) -> list[torch.Tensor]:
        """Fresh copies of the center variables, pulled now, in parameter order."""
        conn = self._require_connected()
        out: list[torch.Tensor | None] = [None] * conn.num_params
        for link, r in zip(conn.links, self._pull(wait_s=0.0)):
            for i, v in zip(link.positions, link.layout.views(r.flats)):
                out[i] = v.clone()
        return out  # type: ignore[return-value]

    # ---- step -----------------------------------------------------------------------------------
    def _before_inner_step(self) -> None:
        if not self._ready:
            raise RuntimeError(
                f"{self._name} is not initialized: before the first step run "
                "hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index); hook.begin(); "
                "hook.after_create_session()  (or, once the chief has seeded the centers, "
                "opt.get_init_op(task_index)())"
            )
        conn = self._require_connected()
        if any(p.grad is not None and p.grad.is_sparse for link in conn.links for p in link.params):
            raise TypeError(f"{self._name} does not support sparse gradients")
        if self._keeps_accumulator:
            for link in conn.links:
                pairs = [
                    (a, p.grad) for a, p in zip(link.acc_views, link.params) if p.grad is not None
                ]
                accs = [a for a, _ in pairs]
                grads = [g.to(a.dtype) for a, g in pairs]
                if link.acc_is_zero:  # a = 0 + g, written directly; params without grad: 0
                    if len(pairs) < len(link.params):
                        for t in link.acc.values():  # type: ignore[union-attr]
                            t.zero_()
                    if pairs:
                        torch._foreach_copy_(accs, grads)
                    link.acc_is_zero = False
                elif pairs:
                    torch._foreach_add_(accs, grads)

    def _after_inner_step(self) -> None:
        self.local_step += 1
        if self.local_step % self.communication_period == 0:
            self._commit()

    # ---- state ----------------------------------------------------------------------------------
    def _wrapper_state_dict(self) -> dict[str, Any]:
        return {"local_step": self.local_step, "global_step": self.global_step}

    def _check_wrapper_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) - {"local_step", "global_step"}:
            raise ValueError(
                f"{type(self).__name__} wrapper state has keys local_step and global_step, "
                f"got {state!r}"
            )
        for k in ("local_step", "global_step"):
            if k in state:
                check_int(k, state[k], 0)

    def _load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        self.local_step = state.get("local_step", self.local_step)
        self.global_step = state.get("global_step", self.global_step)
