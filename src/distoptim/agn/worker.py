"""The worker side shared by every asynchronous algorithm: accumulate, commit, pull.

Owns: :class:`AsyncWorkerOptimizer`, the ``torch.optim.Optimizer`` a worker trains with, and its
session-run hook. It connects to the cluster of its process, places each parameter's center
variable on a shard (``AGNCustomGetter``), seeds or pulls the centers, runs the wrapped
optimizer locally every step and, every ``communication_period`` (λ) steps, sends **one RPC per
shard** carrying one flat buffer per dtype and receives that shard's center in the same round
trip. The algorithms (:mod:`~distoptim.agn.agn`, :mod:`~distoptim.agn.downpour`,
:mod:`~distoptim.agn.easgd`) differ only in three small pieces a subclass provides:

* ``_payload(link)``: what it commits (e.g. ``a/λ``, ``θ - θ_pulled``, ``θ``);
* ``_absorb(link, sent, reply)``: what the local copy becomes afterwards (default: the center);
* ``_server_rule()``: how the shard applies a commit (:class:`~distoptim.agn.server.ServerRule`).

A worker step, in order: validate (initialized?) → accumulate (AGN: ``a += g``) → the
wrapped optimizer's ``step()`` on the local parameters → ``local_step += 1`` → if
``local_step % λ == 0``: commit and absorb. Nothing waits for other workers.

Non-finite commits: with several shards the worker checks its payload first and, if any value is
NaN/Inf, sends an empty "refused" commit to every shard so that *no* shard applies a part of it;
a single shard checks the payload itself. Either way the center is untouched, the shard counts a
refusal, and the worker warns (``RuntimeWarning``) and takes the center as its local copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.agn import server as _server
from distoptim.agn.cluster import Cluster, current_cluster
from distoptim.agn.flat import FlatLayout, nbytes
from distoptim.agn.getter import AGNCustomGetter
from distoptim.comm.link import transmit
from distoptim.protocol import WrappedOptimizer

__all__ = ["AsyncWorkerOptimizer", "SessionRunHook"]


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@dataclass
class _ShardLink:
    """This worker's view of one shard: its parameters there and the worker-side buffers."""

    shard: int
    positions: list[int]  # indices into the optimizer's parameter list
    params: list[torch.Tensor]
    layout: FlatLayout
    version: int = 0  # the shard's version at this worker's last pull
    acc: dict[str, torch.Tensor] | None = None  # AGN's accumulator a, flat
    acc_views: list[torch.Tensor] = field(default_factory=list)
    acc_is_zero: bool = True  # a == 0 logically; the next accumulate overwrites instead of adding
    pulled: dict[str, torch.Tensor] | None = None  # the center as last pulled, flat
    sent_hparams: dict[int, dict[str, Any]] = field(default_factory=dict)

    def local(self) -> dict[str, torch.Tensor]:
        """Fresh flat copies of the local parameters."""
        return self.layout.flatten(self.params)

    def assign(self, flats: dict[str, torch.Tensor]) -> None:
        """Local parameters := ``flats``."""
        with torch.no_grad():
            for p, v in zip(self.params, self.layout.views(flats)):
                p.copy_(v)


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
    links: list[_ShardLink]
    num_params: int


class AsyncWorkerOptimizer(WrappedOptimizer):
    """Base of the parameter-server optimizers (see the module docstring).

    Read-outs: ``local_step`` (worker steps), ``global_step`` (the center's version as last
    seen from the shards: accepted commits of all workers), ``center_variables()``.
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
        _check_int("num_worker", num_worker, 1)
        _check_int("communication_period", communication_period, 1)
        if custom_getter is not None and not isinstance(custom_getter, AGNCustomGetter):
            raise TypeError(
                "custom_getter must be a distoptim.AGNCustomGetter or None (the cluster's "
                f"default placement), got {type(custom_getter).__name__}"
            )
        if not isinstance(use_locking, bool):
            raise TypeError(f"use_locking must be a bool, got {type(use_locking).__name__}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        super().__init__(optimizer, name=name)
        self.num_worker = num_worker
        self.communication_period = communication_period
        self.custom_getter = custom_getter
        self.use_locking = use_locking
        self.local_step = 0
        self.global_step = 0
        self._conn: _Connection | None = None
        self._ready = False

    # ---- per-algorithm pieces -------------------------------------------------------------------
    def _server_rule(self) -> _server.ServerRule:
        raise NotImplementedError

    def _payload(self, link: _ShardLink) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _absorb(
        self, link: _ShardLink, sent: dict[str, torch.Tensor], reply: dict[str, torch.Tensor]
    ) -> None:
        """After an accepted commit; default: the local copy becomes the received center."""
        self._reset_to(link, reply)

    # ---- shared worker machinery ----------------------------------------------------------------
    def _reset_to(self, link: _ShardLink, center: dict[str, torch.Tensor]) -> None:
        """Local copy := center, accumulator := 0, last pull := center."""
        link.assign(center)
        link.acc_is_zero = True  # saves a pass over a: the next step writes g instead of adding it
        if self._keeps_pulled:
            link.pulled = center

    def _connect(self, task_index: int) -> None:
        """Placement and buffers (``hook.begin()``); no message is sent."""
        _check_int("task_index", task_index, 0)
        if task_index >= self.num_worker:
            raise ValueError(f"task_index must be < num_worker={self.num_worker}, got {task_index}")
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
                f"num_worker={self.num_worker} but the cluster has {cluster.num_worker} workers"
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
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in the optimizer's param_groups")
        for p in params:
            if p.is_sparse or not p.is_floating_point():
                raise TypeError(f"parameters must be dense floating tensors, got {p.dtype}")
        placement = getter.placement(params, cluster.num_ps)
        links = []
        for shard in range(cluster.num_ps):
            pos = [i for i, s in enumerate(placement) if s == shard]
            if not pos:
                continue
            held = [params[i] for i in pos]
            link = _ShardLink(shard, pos, held, FlatLayout([(p.shape, p.dtype) for p in held]))
            if self._keeps_accumulator:
                link.acc = link.layout.zeros(held[0].device)
                link.acc_views = link.layout.views(link.acc)
            links.append(link)
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

    def _spec(self, link: _ShardLink) -> _server.TableSpec:
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
        return _server.TableSpec(
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
        calls = []
        for link in conn.links:
            flats = link.local()
            transmit(nbytes(flats))
            calls.append(
                conn.cluster.call_async(
                    link.shard, _server.rpc_seed, (self._name, self._spec(link), flats)
                )
            )
        for link, call in zip(conn.links, calls):
            conn.cluster.result(call, link.shard, f"seeding optimizer {self._name!r}")

    def _pull(self, wait_s: float) -> list[_server.PullReply]:
        conn = self._require_connected()
        margin = conn.cluster.rpc_timeout
        calls = [
            conn.cluster.call_async(
                link.shard,
                _server.rpc_pull,
                (self._name, conn.task_index, self.algorithm, link.layout.signature(), wait_s),
                timeout=wait_s + margin,
            )
            for link in conn.links
        ]
        replies = [
            conn.cluster.result(c, link.shard, f"pulling optimizer {self._name!r}")
            for link, c in zip(conn.links, calls)
        ]
        for r in replies:
            self.global_step = max(self.global_step, r.version)
        return replies

    def _initialize(self, task_index: int) -> None:
        if self._conn is None or self._conn.task_index != task_index:
            self._connect(task_index)
        conn = self._require_connected()
        replies = self._pull(wait_s=conn.cluster.rpc_timeout)
        for link, r in zip(conn.links, replies):
            link.version = r.version
            self._reset_to(link, r.flats)
        self._ready = True

    # ---- TF API ---------------------------------------------------------------------------------
    def make_session_run_hook(self, is_chief: bool, task_index: int) -> SessionRunHook:
        """The hook that initializes the centers (see :class:`SessionRunHook`)."""
        if not isinstance(is_chief, bool):
            raise TypeError(f"is_chief must be a bool, got {type(is_chief).__name__}")
        _check_int("task_index", task_index, 0)
        return SessionRunHook(self, is_chief, task_index)

    def get_init_op(self, task_index: int) -> Callable[[], None]:
        """A callable: wait (bounded) for the centers, local params := center, accumulators := 0."""
        _check_int("task_index", task_index, 0)
        if task_index >= self.num_worker:
            raise ValueError(f"task_index must be < num_worker={self.num_worker}, got {task_index}")
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

    def _hparams(self, link: _ShardLink) -> dict[int, dict[str, Any]] | None:
        """Numeric hyperparameters that changed since the last commit (LR schedules)."""
        changed: dict[int, dict[str, Any]] = {}
        for gi, g in enumerate(self.param_groups):
            now = {
                k: v
                for k, v in g.items()
                if k != "params" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            if now != link.sent_hparams.get(gi):
                changed[gi] = now
                link.sent_hparams[gi] = now
        return changed or None

    def _commit(self) -> None:
        conn = self._require_connected()
        cluster = conn.cluster
        payloads = [self._payload(link) for link in conn.links]
        refuse = len(conn.links) > 1 and not all(_server._finite(p) for p in payloads)
        uses_opt = self._server_rule().uses_optimizer
        calls = []
        for link, payload in zip(conn.links, payloads):
            send = {} if refuse else payload
            hp = self._hparams(link) if uses_opt and not refuse else None
            transmit(nbytes(send))
            args = (self._name, conn.task_index, link.version, send, hp, refuse)
            calls.append(cluster.call_async(link.shard, _server.rpc_commit, args))
        refused = False
        for link, payload, call in zip(conn.links, payloads, calls):
            r = cluster.result(call, link.shard, f"a commit of optimizer {self._name!r}")
            link.version = r.version
            self.global_step = max(self.global_step, r.version)
            if r.refused:
                refused = True
                link.sent_hparams.clear()
                self._reset_to(link, r.flats)
            else:
                self._absorb(link, payload, r.flats)
        if refused:
            warnings.warn(
                f"{self._name}: worker {conn.task_index}'s commit at local step {self.local_step} "
                "contained NaN/Inf and was refused by the parameter server (the center is "
                "unchanged); the local parameters were reset to the center",
                RuntimeWarning,
                stacklevel=3,
            )

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
                _check_int(k, state[k], 0)

    def _load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        self.local_step = state.get("local_step", self.local_step)
        self.global_step = state.get("global_step", self.global_step)
