"""Replica processes for the fault-tolerance tests: a small model trained under torchft.

Module-level functions (the local runner starts processes with the ``spawn`` method). Each
replica builds a torchft manager with the user's state (model and optimizer, copied as the
manager asks for them: it logs ``serving`` then, which a scenario uses to kill a donor in the
middle of a heal), trains on the data of its slot (:class:`~distoptim.ft.data.SlotShards`: the
batch follows the committed step) until the scenario says where to stop, and logs every
commit with the checksum of the state the replicas must agree on and the round's quorum.
"""

from __future__ import annotations

import copy
import os
import signal
from collections import defaultdict
from typing import Any

import torch

from distoptim import CrossShardOptimizer, DiLoCo, LocalSGD
from distoptim.comm.checksum import state_checksum
from distoptim.comm.guard import ParameterMismatchError
from distoptim.ft import _torchft, inject
from distoptim.ft.data import SlotShards
from distoptim.ft.local import ReplicaContext, ReplicaRun
from distoptim.ft.replica import make_manager

MAX_STEPS = 20_000  # a bound, in case a scenario never says where to stop
_N, _DIM, _CLASSES, _BATCH = 512, 8, 3, 8


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(_N, _DIM, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    return x, y


def _model(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(_DIM, width), torch.nn.Tanh(), torch.nn.Linear(width, _CLASSES)
    )


def _manager(ctx: ReplicaContext, state: Any, load: Any) -> Any:
    def serve() -> Any:
        ctx.log("serving")
        return copy.deepcopy(state())

    return make_manager(
        ctx.lighthouse,
        replica_id=ctx.replica_id,
        state_dict=serve,
        load_state_dict=load,
        timeout=15,
        quorum_timeout=120,
        connect_timeout=30,
        init_sync=False,
    )


def _quorum(manager: Any) -> dict[str, int]:
    """What a ``commit`` event says about the round's quorum: its id (the lighthouse numbers
    quorums in increasing order and gives a new number whenever the members change, so a quorum
    numbered above the one a frozen replica was frozen in was formed without it) and how many
    replicas took part in it (healing ones not counted)."""
    return {"quorum": _torchft.quorum_id(manager), "participants": manager.num_participants()}


def _arm(ctx: ReplicaContext, faults: dict[str, str] | None, stats: Any, manager: Any) -> None:
    """Arm this process's fault triggers (:mod:`distoptim.ft.inject`): ``faults`` maps
    ``"SLOT"`` (first incarnation) or ``"SLOT.INC"`` to a trigger spec. At the point the
    replica logs ``inject`` (with its contributions so far and the id of its latest quorum:
    read, not waited for, as a donor stops inside torchft's quorum thread) and stops itself
    (SIGSTOP): the scenario then kills or thaws it."""
    spec = (faults or {}).get(f"{ctx.slot}.{ctx.incarnation}")
    if spec is None and ctx.incarnation == 0:
        spec = (faults or {}).get(str(ctx.slot))
    if not spec:
        return

    def stop_here(point: str, role: str) -> None:
        contributed, quorum = stats().contributed, _torchft.quorum_id(manager)
        ctx.log("inject", point=point, role=role, contributed=contributed, quorum=quorum)
        os.kill(os.getpid(), signal.SIGSTOP)

    inject.arm(spec, action=stop_here)


_END_SEEN: list[int] = []  # this process saw the scenario's end (it logged ``end_seen``)


def _stop(ctx: ReplicaContext, step: int, committed: int, waits: bool = False) -> bool:
    """Stop at the scenario's step; a restarted replica that never joined stops at the end
    (unless it ``waits``: an odd replica started to be refused after another returned). Logs
    ``end_seen`` with its step when it first reads the end (how much of the margin the
    scenario left it was used up on the way)."""
    if ctx.incarnation and committed == 0 and ctx.ending() and not waits:
        return True
    end = ctx.finish_at()
    if end is not None and not _END_SEEN:
        _END_SEEN.append(end)
        ctx.log("end_seen", step=step, end=end)
    return (end is not None and step >= end) or step >= MAX_STEPS


def cross_shard(
    ctx: ReplicaContext, width: int = 16, faults: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """CrossShardOptimizer (Adam, gradients as bucket views) under a torchft manager."""
    model = _model(width)
    x, y = _data()
    opt: CrossShardOptimizer | None = None

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}  # type: ignore[union-attr]

    def load(s: dict[str, Any]) -> None:
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])  # type: ignore[union-attr]

    manager = _manager(ctx, state, load)
    try:
        opt = CrossShardOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-2),
            manager=manager,
            gradient_as_bucket_view=True,
        )
    except Exception as exc:  # a replica refused at construction says why
        return {"refused": f"{type(exc).__name__}: {exc}"}
    shards = SlotShards(_N, ctx.num_slots, ctx.slot, _BATCH, seed=3)
    _arm(ctx, faults, lambda: opt.replica_stats, manager)  # type: ignore[union-attr]
    ctx.log("ready")
    ctx.wait_for_peers(240)
    try:
        while not _stop(ctx, opt.iterations, opt.replica_stats.commits):
            idx = shards.batch(opt.iterations)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            before = opt.iterations
            opt.step()
            if opt.iterations > before:
                ctx.log(
                    "commit",
                    step=opt.iterations,
                    state=state_checksum(list(model.parameters())),
                    heals=opt.replica_stats.heals,
                    contributed=opt.replica_stats.contributed,
                    **_quorum(manager),
                )
    except Exception as exc:  # e.g. a replica with another model is refused by name
        manager.shutdown(wait=False)
        return {"refused": f"{type(exc).__name__}: {exc}"}
    stats = opt.replica_stats
    manager.shutdown(wait=False)
    return {
        "step": opt.iterations,
        "state": state_checksum(list(model.parameters())),
        "commits": stats.commits,
        "heals": stats.heals,
        "failed": stats.failed,
    }


def streaming_diloco(
    ctx: ReplicaContext, wire: str = "int8", faults: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """Streaming DiLoCo (2 fragments, H = 8, tau = 1, alpha = 0.5) under a torchft manager."""
    return _outer(ctx, "streaming", wire, faults)


def diloco(
    ctx: ReplicaContext, wire: str = "fp32", faults: dict[str, str] | None = None
) -> dict[str, Any] | None:
    """DiLoCo (one fragment, H = 8) under a torchft manager."""
    return _outer(ctx, "diloco", wire, faults)


def diloco_joins(ctx: ReplicaContext) -> dict[str, Any] | None:
    """DiLoCo (one fragment, H = 8) whose restarted replicas call ``join()``: they heal at the
    others' next sync, at their own first step."""
    return _outer(ctx, "diloco", "fp32", joins=True)


def local_sgd(ctx: ReplicaContext, faults: dict[str, str] | None = None) -> dict[str, Any] | None:
    """LocalSGD (H = 8) under a torchft manager."""
    return _outer(ctx, "localsgd", "fp32", faults)


def _outer(
    ctx: ReplicaContext,
    kind: str,
    wire: str,
    faults: dict[str, str] | None = None,
    odd: dict[str, dict[str, Any]] | None = None,
    joins: bool = False,
) -> dict[str, Any] | None:
    """The DiLoCo family under a torchft manager; logs ``syncing`` before each step that syncs
    (so a scenario can kill a replica as it enters a sync) and ``commit`` after each sync (with
    ``calls``: this incarnation's ``step()`` calls so far). ``joins``: a restarted replica
    calls ``join()`` before its first step.
    ``odd``: per ``"SLOT"`` (its first incarnation) or ``"SLOT.INC"``, options that differ from
    the others' (``width``, ``wire``, ``sync_every``, ``fragments``; ``stale_lr``: the inner
    learning rate a healed replica sets back after loading its donor's state, as a scheduler
    left out of the heal state would): such a replica must be refused by name (it returns
    ``{"refused": ...}``) while the others go on."""
    odd = odd or {}
    mine = odd.get(f"{ctx.slot}.{ctx.incarnation}", odd.get(str(ctx.slot), {}))
    if ctx.incarnation and f"{ctx.slot}.{ctx.incarnation}" not in odd:
        mine = {}
    model = _model(mine.get("width", 16))
    x, y = _data()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wire = mine.get("wire", wire)
    every = mine.get("sync_every", 8)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load(s: dict[str, Any]) -> None:
        model.load_state_dict(s["model"])
        inner.load_state_dict(s["inner"])
        if "stale_lr" in mine:
            for group in inner.param_groups:
                group["lr"] = mine["stale_lr"]

    manager = _manager(ctx, state, load)
    opt: DiLoCo
    if kind == "localsgd":
        opt = LocalSGD(inner, sync_every=every, manager=manager)
    else:
        streaming = kind == "streaming"
        opt = DiLoCo(
            inner,
            torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True),
            sync_every=every,
            fragments=mine.get("fragments", 2 if streaming else 1),
            fragment_sync_delay=1 if streaming else 0,
            fragment_update_alpha=0.5 if streaming else 0.0,
            wire=wire,
            manager=manager,
        )
    shards = SlotShards(_N, ctx.num_slots, ctx.slot, _BATCH, seed=3)
    _arm(ctx, faults, lambda: opt.replica_stats, manager)
    if joins and ctx.incarnation:
        opt.join()
    ctx.log("ready")
    ctx.wait_for_peers(240)
    calls = 0
    try:
        while not _stop(ctx, opt.iterations, opt.replica_stats.commits, waits=bool(mine)):
            idx = shards.batch(opt.iterations)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            syncs = opt.syncs
            if kind != "streaming" and (opt.iterations + 1) % every == 0:
                ctx.log("syncing", step=opt.iterations + 1)
            opt.step()
            calls += 1
            if opt.syncs > syncs:
                ctx.log(
                    "commit",
                    calls=calls,
                    step=opt.iterations,
                    syncs=opt.syncs,
                    state=state_checksum(list(opt.global_parameters)),
                    heals=opt.replica_stats.heals,
                    contributed=opt.replica_stats.contributed,
                    **_quorum(manager),
                )
        opt.finish()
    except ParameterMismatchError as exc:  # the odd replica is refused by name
        if not mine:
            raise
        manager.shutdown(wait=False)
        return {"refused": f"{type(exc).__name__}: {exc}"}
    stats = opt.replica_stats
    manager.shutdown(wait=False)
    return {
        "step": opt.iterations,
        "state": state_checksum(list(opt.global_parameters)),
        "model": state_checksum(list(model.parameters())),
        "commits": stats.commits,
        "heals": stats.heals,
        "failed": stats.failed,
        "contributed": stats.contributed,
        "caught_up": stats.caught_up,
    }


def odd_width(ctx: ReplicaContext) -> dict[str, Any] | None:
    """Replica 2 builds a wider model than the others (the others train as in cross_shard)."""
    return cross_shard(ctx, width=32 if ctx.slot == 2 else 16)


def odd_outer(
    ctx: ReplicaContext,
    kind: str,
    wire: str,
    odd: dict[str, dict[str, Any]],
    faults: dict[str, str] | None = None,
) -> dict[str, Any] | None:
    """The DiLoCo family where the slots in ``odd`` differ from the others (see ``_outer``)."""
    return _outer(ctx, kind, wire, faults, odd)


def commits_agree(run: ReplicaRun, key: str) -> dict[int, set[int]]:
    """Per commit (by ``key``), the states the replicas that committed it logged."""
    by: dict[int, set[int]] = defaultdict(set)
    for e in run.events:
        if e["kind"] == "commit":
            by[e[key]].add(e["state"])
    bad = {k: v for k, v in by.items() if len(v) > 1}
    assert not bad, f"replicas committed different states at {sorted(bad)[:5]}"
    return by


def linear_cross_shard(ctx: ReplicaContext, **manager_options: Any) -> Any:
    """A ``Linear(8, 2)`` (seeded alike on every replica) under CrossShard SGD (lr 0.1) with a
    torchft manager built with ``manager_options`` (timeouts, ``min_replica_size``; never an
    initial sync): the replica of the lighthouse, spare and quorum-timeout scenarios. Returns
    ``(model, opt, manager)``; the manager heals the model and the optimizer's state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    holder: list[CrossShardOptimizer] = []
    manager = make_manager(
        ctx.lighthouse,
        replica_id=ctx.replica_id,
        state_dict=lambda: {"opt": holder[0].state_dict(), "model": model.state_dict()},
        load_state_dict=lambda s: (
            holder[0].load_state_dict(s["opt"]),
            model.load_state_dict(s["model"]),
        ),
        init_sync=False,
        **manager_options,
    )
    opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), manager=manager)
    holder.append(opt)
    return model, opt, manager
