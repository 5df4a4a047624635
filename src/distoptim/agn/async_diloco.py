"""AsyncDiLoCoOptimizer: asynchronous DiLoCo on the parameter server (Liu et al. 2024).

Owns: what an asynchronous DiLoCo worker commits (its pseudo-gradient), the outer optimizer the
shard builds for it (the user's picklable factory, or Delayed Nesterov), and Dynamic Local
Updates (each worker's number of local steps from the measured speeds, shared through the
cluster's store). Everything else -- placement, flat buffers, transports, the init hook, refused
commits, shard restarts -- is :mod:`distoptim.agn.worker`.

Bo Liu, Rachita Chhaparia, Arthur Douillard, Satyen Kale, Andrei A. Rusu, Jiajun Shen, Arthur
Szlam, Marc'Aurelio Ranzato, "Asynchronous Local-SGD Training for Language Modeling",
arXiv 2401.09135 (v2, 2024). Its Algorithm 1 is synchronous DiLoCo
(:class:`distoptim.DiLoCo`), Algorithm 2 the asynchronous schedule -- the server applies
``θ ← sync(θ, w.update)`` for each worker ``w`` as its update arrives -- Algorithm 3 Delayed
Nesterov (:class:`~distoptim.agn.rules.DelayedNesterov`) and Eq. (6) Dynamic Local Updates.
"""

from __future__ import annotations

import functools
import math
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from distoptim.agn.flat import Chunk
from distoptim.agn.getter import AGNCustomGetter
from distoptim.agn.rules import ApplyOptimizer, DelayedNesterov, ServerRule
from distoptim.agn.shard_link import ShardLink
from distoptim.agn.transport.messages import TableSpec
from distoptim.agn.worker import AsyncWorkerOptimizer
from distoptim.checks import (
    check_bool,
    check_finite_hyperparameters,
    check_int,
    check_real,
    type_name,
)

__all__ = ["DEFAULT_OUTER", "AsyncDiLoCoOptimizer", "local_updates"]

DEFAULT_OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
"""DiLoCo's outer optimizer (Douillard et al. 2023): Nesterov SGD, lr 0.7, momentum 0.9."""

_WRAPPER_KEYS = ("local_step", "global_step", "round_steps", "period")


def local_updates(period: int, speed: float, fastest: float) -> int:
    """Dynamic Local Updates, arXiv 2401.09135 Eq. (6): ``H_w = ⌊ v(w) / max_w' v(w') · H ⌋``.

    ``period`` is ``H`` (the fastest worker's steps), ``speed`` this worker's ``v(w)`` and
    ``fastest`` the largest speed of the workers (steps per second, any common unit). Two
    deviations, both at the edges: the result is at least 1 (a worker slower than ``1/H`` of the
    fastest still commits after every step), and ``⌊x + 1e-9⌋`` keeps an exact ratio such as
    ``1/3 · 12`` from rounding down to 3 in floating point.
    """
    if not (speed > 0 and fastest > 0) or speed >= fastest:
        return period
    return max(1, min(period, math.floor(speed / fastest * period + 1e-9)))


def _check_outer(factory: Any, dtype: torch.dtype) -> torch.optim.Optimizer:
    """The outer optimizer the factory builds over one probe tensor (validated; nothing kept)."""
    if not callable(factory):
        raise TypeError(
            "outer_optimizer must be a factory f(params) -> torch.optim.Optimizer, e.g. "
            "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), got "
            f"{type_name(factory)}"
        )
    try:
        pickle.dumps(factory)
    except Exception as exc:
        raise TypeError(
            "outer_optimizer must be picklable (the parameter server builds it): use "
            "functools.partial(<optimizer class>, lr=..., ...) or a module-level function, not "
            f"a lambda or a local function ({type(exc).__name__}: {exc})"
        ) from exc
    try:
        probe = factory([torch.zeros(1, dtype=dtype)])
    except Exception as exc:
        raise ValueError(
            f"outer_optimizer(params) failed on a probe parameter: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(probe, torch.optim.Optimizer):
        raise TypeError(
            f"outer_optimizer(params) must return a torch.optim.Optimizer, got {type_name(probe)}"
        )
    check_finite_hyperparameters(probe, "AsyncDiLoCoOptimizer's outer_optimizer")
    return probe


def _nesterov_hyperparameters(probe: torch.optim.Optimizer) -> tuple[float, float]:
    """``(ε, β)`` of a Nesterov SGD outer optimizer, the ones Delayed Nesterov runs with."""
    g = probe.param_groups[0]
    plain = (
        type(probe) is torch.optim.SGD
        and g.get("nesterov") is True
        and not g.get("maximize", False)
        and g.get("dampening", 0) == 0
        and g.get("weight_decay", 0) == 0
        and isinstance(g.get("lr"), (int, float))
        and 0 < g.get("momentum", 0) < 1
    )
    if not plain:
        hp = {k: v for k, v in g.items() if k != "params"}
        raise ValueError(
            "delayed_momentum > 0 runs Delayed Nesterov with the outer optimizer's learning rate "
            "and momentum, so outer_optimizer must build torch.optim.SGD(nesterov=True, momentum "
            f"in (0, 1), no dampening, weight decay or maximize); got {type(probe).__name__}({hp})"
        )
    return float(g["lr"]), float(g["momentum"])


class _SpeedTable:
    """The workers' measured speeds, shared through the cluster's store (DyLU).

    Keys, under ``asyncdiloco/<optimizer name>/``: ``speed/<task>`` (a worker's last measured
    steps per second, written by that worker before it registers) and ``members`` (the tasks
    that have published, ``"0,3,1,"``, appended with ``compare_set``). A read costs three store
    round trips plus one to tell whether the fastest worker has left (the cluster's
    ``worker/<task>/end`` key): a worker that left no longer sets the pace.
    """

    def __init__(self, store: dist.Store, name: str, task: int) -> None:
        self._store = store
        self._prefix = f"asyncdiloco/{name}"
        self._task = task
        self._registered = False
        self._left: set[int] = set()

    def publish(self, speed: float) -> None:
        self._store.set(f"{self._prefix}/speed/{self._task}", repr(float(speed)))
        if self._registered:
            return
        key, cur = f"{self._prefix}/members", ""
        while str(self._task) not in cur.split(","):  # append "<task>," unless someone did
            cur = self._store.compare_set(key, cur, f"{cur}{self._task},").decode()
        self._registered = True

    def speeds(self) -> dict[int, float]:
        """``{task: speed}`` of the workers that published and have not left."""
        members = self._store.get(f"{self._prefix}/members").decode()
        tasks = sorted({int(t) for t in members.split(",") if t} - self._left)
        raw = self._store.multi_get([f"{self._prefix}/speed/{t}" for t in tasks])
        table = {t: float(v.decode()) for t, v in zip(tasks, raw)}
        while table:
            fastest = max(table, key=lambda t: table[t])
            if fastest == self._task or not self._store.check([f"worker/{fastest}/end"]):
                break
            self._left.add(fastest)
            del table[fastest]
        return table


class AsyncDiLoCoOptimizer(AsyncWorkerOptimizer):
    """Asynchronous DiLoCo: local inner steps, pseudo-gradients applied by a server outer optimizer.

    Each of the ``num_worker`` workers trains its local copy ``θ`` with ``optimizer`` (the inner
    optimizer; DiLoCo's paper: AdamW) and, after ``H_i`` local steps (``H`` =
    ``communication_period``, or its DyLU share, below), commits its **pseudo-gradient**::

        Δ = θ_pulled - θ                 (θ_pulled: the center it last received)

    the same sign as :class:`distoptim.DiLoCo`'s outer gradient ``θ_global - θ_local`` (and as
    arXiv 2401.09135 Algorithm 1, line 9); not AGN's / DOWNPOUR's ``θ - θ_pulled``. The shard
    holding each parameter applies its **outer optimizer** to the center ``c`` with gradient
    ``Δ``, under its lock, in arrival order (Algorithm 2, ``θ ← sync(θ, w.update)``)::

        c ← OuterOpt(c, grad = Δ)          e.g. Nesterov SGD, lr 0.7, momentum 0.9

    and replies with the new center, which becomes the worker's ``θ`` and ``θ_pulled``. Workers
    never wait for each other. The outer optimizer is built **on the shard**, over its center
    variables, by the picklable factory ``outer_optimizer`` (``factory(param_groups)``, one
    group); its state (momentum) lives there and in the shard's checkpoints. Its hyperparameters
    are fixed by the factory (the inner optimizer's LR schedule does not reach it). With one
    worker this is :class:`distoptim.DiLoCo` on one replica, step for step.

    **Delayed Nesterov** (``delayed_momentum=N >= 1``; arXiv 2401.09135 Section 5, Algorithm 3).
    The shard's outer optimizer becomes :class:`~distoptim.agn.rules.DelayedNesterov` with the
    learning rate ``ε`` and momentum ``β`` of ``outer_optimizer`` (which must then be Nesterov
    SGD) and ``c = momentum_activation``. With ``g_t`` the ``t``-th pseudo-gradient the shard
    receives (any worker; ``t = 0, 1, …``), ``m_0 = 0`` and the buffer ``Δ = 0``::

        Δ ← Δ + g_t
        if (t + 1) mod N == 0:   m_{t+1} = β m_t + Δ/N
                                 θ_{t+1} = θ_t - ε ((1 - cN + c) β m_{t+1} + g_t/N);   Δ ← 0
        else:                    m_{t+1} = m_t
                                 θ_{t+1} = θ_t - ε (c β m_{t+1} + g_t/N)

    ``c ∈ [0, 1/N]`` (the paper's default and ours: 0). ``N = 1, c = 0`` is Nesterov SGD itself;
    the paper's choice is ``N`` = the number of workers. ``delayed_momentum=0`` (default) applies
    ``outer_optimizer`` to every commit as it is (the paper's "Async. DiLoCo" baseline).

    **Dynamic Local Updates** (``dynamic_local_updates=True``; Section 5, Eq. (6)). Each worker
    measures its speed ``v(w)`` in local steps per second of its training loop: a round is timed
    from the end of the step that committed the previous one to the end of its last inner step
    (the commit's round trip excluded; whatever the loop does between steps -- data, forward,
    backward -- included), the first round after initialization from the end of its first step;
    ``v(w)`` = timed steps / timed seconds, accumulated since initialization (the device's
    speed, robust to one noisy round). After each commit it publishes ``v(w)`` in the
    cluster's store and takes ``H_w = ⌊ v(w) / max_w' v(w') · H ⌋`` local steps for the next
    round (:func:`local_updates`; the fastest worker keeps ``H``, every worker at least 1),
    over the workers that have published and not left. The first round is ``H`` everywhere.
    ``clock`` (keyword, default ``time.perf_counter``) is the time source.

    Read-outs: ``period`` (``H_w`` of the current round), ``speed`` (last measured, or None),
    ``commits`` and ``bytes_sent`` (this worker's commits and their payload bytes),
    ``global_parameters()`` (the center as last received, no communication), and the base
    class's ``local_step``, ``global_step``, ``center_variables()``. Initialization as every
    parameter-server optimizer: ``make_session_run_hook(is_chief, task_index)``, ``begin()``,
    ``after_create_session()``; every (re)initialization starts a new round from the pulled
    center.
    """

    algorithm = "AsyncDiLoCo"
    _keeps_pulled = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        num_worker: int,
        custom_getter: AGNCustomGetter | None = None,
        communication_period: int = 50,
        outer_optimizer: Callable[..., torch.optim.Optimizer] = DEFAULT_OUTER,
        delayed_momentum: int = 0,
        dynamic_local_updates: bool = False,
        name: str = "AsyncDiLoCoOptimizer",
        *,
        momentum_activation: float = 0.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        check_int("communication_period", communication_period, 1)
        n = check_int("delayed_momentum", delayed_momentum, 0)
        check_bool("dynamic_local_updates", dynamic_local_updates)
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type_name(clock)}")
        c = check_real("momentum_activation", momentum_activation)
        if n == 0 and c != 0:
            raise ValueError(
                "momentum_activation (Delayed Nesterov's c) needs delayed_momentum >= 1, got "
                f"momentum_activation={c!r} with delayed_momentum=0"
            )
        if n > 0 and not 0 <= c <= 1 / n:
            raise ValueError(
                f"momentum_activation must be in [0, 1/delayed_momentum] = [0, {1 / n:g}], "
                f"got {c!r}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__} wraps a torch.optim.Optimizer (the inner optimizer, "
                f"e.g. torch.optim.AdamW), got {type_name(optimizer)}"
            )
        params = [p for g in optimizer.param_groups for p in g["params"]]
        probe = _check_outer(outer_optimizer, params[0].dtype if params else torch.float32)
        server_factory: Callable[..., torch.optim.Optimizer] = outer_optimizer
        if n > 0:
            lr, beta = _nesterov_hyperparameters(probe)
            server_factory = functools.partial(
                DelayedNesterov, lr=lr, momentum=beta, buffer_size=n, activation=float(c)
            )
        super().__init__(optimizer, num_worker, custom_getter, communication_period, True, name)
        self.outer_optimizer = outer_optimizer
        self.delayed_momentum = n
        self.momentum_activation = float(c)
        self.dynamic_local_updates = dynamic_local_updates
        self.period = self.communication_period
        self.speed: float | None = None
        self.commits = 0
        self.bytes_sent = 0
        self._server_factory = server_factory
        self._clock = clock
        self._round_steps = 0
        self._round_start: float | None = None  # None: the clock starts at the next step's end
        self._untimed = 0  # steps of this round before its clock started
        self._timed_steps = 0  # DyLU: steps and seconds measured since initialization
        self._timed_s = 0.0
        self._speeds: _SpeedTable | None = None

    # ---- what the shard runs ------------------------------------------------------------------
    def _server_rule(self) -> ServerRule:
        return ApplyOptimizer()

    def _spec(self, link: ShardLink) -> TableSpec:
        """The base spec with the outer optimizer's factory instead of the inner's class."""
        return replace(
            super()._spec(link),
            optimizer_cls=self._server_factory,
            defaults={},
            groups=[(0, {}, list(range(len(link.params))))],
        )

    def _hparams(self, link: ShardLink) -> dict[int, dict[str, Any]] | None:
        """Never: the outer optimizer's hyperparameters are the factory's, not the inner's."""
        return None

    # ---- what a worker commits ------------------------------------------------------------------
    def _payload_part(self, link: ShardLink, chunk: Chunk, dst: dict[str, torch.Tensor]) -> None:
        """``Δ = θ_pulled - θ``: :meth:`ShardLink.delta_part` (``θ - θ_pulled``, written where
        the transport sends from when it can) negated in place, which is exact (``fl(a - b) =
        -fl(b - a)`` under round-to-nearest)."""
        part = link.delta_part(chunk, dst)
        part.neg_()
        self.bytes_sent += part.numel() * part.element_size()

    def _commit(self) -> None:
        super()._commit()
        self.commits += 1

    # ---- rounds ---------------------------------------------------------------------------------
    def _initialize(self, task_index: int) -> None:
        super()._initialize(task_index)
        self._round_steps = 0
        self._round_start = None
        if self.dynamic_local_updates:
            conn = self._require_connected()
            self._speeds = _SpeedTable(conn.cluster.store, self._name, conn.task_index)

    def _after_inner_step(self) -> None:
        self.local_step += 1
        self._round_steps += 1
        if self._round_start is None:  # the first step after initialization is not timed
            self._round_start = self._clock()
            self._untimed = self._round_steps
        if self._round_steps < self.period:
            return
        elapsed = self._clock() - self._round_start
        self._commit()
        if self.dynamic_local_updates:
            self._next_period(self._round_steps - self._untimed, elapsed)
        self._round_steps = self._untimed = 0
        self._round_start = self._clock()

    def _next_period(self, steps: int, elapsed: float) -> None:
        """DyLU after a commit: publish the speed, size the next round (Eq. (6))."""
        assert self._speeds is not None
        if steps > 0 and elapsed > 0 and math.isfinite(elapsed):
            self._timed_steps += steps
            self._timed_s += elapsed
            self.speed = self._timed_steps / self._timed_s
            self._speeds.publish(self.speed)
        if self.speed is None:
            return
        table = self._speeds.speeds()
        table[self._require_connected().task_index] = self.speed
        self.period = local_updates(self.communication_period, self.speed, max(table.values()))

    # ---- read-outs ------------------------------------------------------------------------------
    def global_parameters(self) -> list[torch.Tensor]:
        """Copies of the center as this worker last received it (no communication), in
        parameter order: what its current round started from."""
        conn = self._require_connected()
        out: list[torch.Tensor | None] = [None] * conn.num_params
        for link in conn.links:
            assert link.pulled is not None
            for i, v in zip(link.positions, link.layout.views(link.pulled)):
                out[i] = v.clone()
        return out  # type: ignore[return-value]

    # ---- state ----------------------------------------------------------------------------------
    def _wrapper_state_dict(self) -> dict[str, Any]:
        return {
            **super()._wrapper_state_dict(),
            "round_steps": self._round_steps,
            "period": self.period,
        }

    def _check_wrapper_state_dict(self, state: Any) -> None:
        if not isinstance(state, Mapping) or set(state) - set(_WRAPPER_KEYS):
            raise ValueError(
                f"{type(self).__name__} wrapper state has keys {list(_WRAPPER_KEYS)}, got {state!r}"
            )
        super()._check_wrapper_state_dict({k: state[k] for k in _WRAPPER_KEYS[:2] if k in state})
        period = check_int("period", state.get("period", self.period), 1)
        if period > self.communication_period:
            raise ValueError(
                f"period must be <= communication_period={self.communication_period}, got {period}"
            )
        steps = check_int("round_steps", state.get("round_steps", 0), 0)
        if steps >= period:
            raise ValueError(f"round_steps must be < period={period}, got {steps}")

    def _load_wrapper_state_dict(self, state: dict[str, Any]) -> None:
        super()._load_wrapper_state_dict({k: state[k] for k in _WRAPPER_KEYS[:2] if k in state})
        self.period = int(state.get("period", self.period))
        self._round_steps = int(state.get("round_steps", self._round_steps))
