"""Training as torchft replica groups on one machine: what ``--fault-tolerant`` runs.

Owns the fault-tolerant run of one algorithm (``sync``, ``localsgd``, ``diloco``,
``streaming-diloco``): one process per replica group around a local lighthouse
(:func:`distoptim.ft.local.run_replicas`), each training the command line's model with the
algorithm's optimizer built with a torchft manager, on the data of its slot
(:class:`~distoptim.ft.data.SlotShards`: the batch follows the committed step, so a healed
joiner lands on the batch the others are on), optionally under a :class:`~distoptim.ft.local.Chaos`
schedule; and what the run's events say afterwards (:class:`FaultTolerantRecord`):

* **useful samples** -- the samples of the inner steps whose work reached a committed model: a
  replica counts, at each commit it *contributed* to, the samples it trained on since its last
  contributing commit (or since it joined); work lost to a failed round, to a death, or done
  while healing is not counted;
* **goodput** -- useful samples per second of the run's wall time (from the moment every
  replica is ready to train until the last one finishes); the comparison's table shows it
  relative to the same configuration's run without faults when both are run;
* **recoveries** -- heals: a replica received a peer's state;
* **time to heal** -- from a restarted replica's first quorum to its first contributing commit
  (its process start and import are reported separately: ``start_s``);
* **time away** -- from a kill to the slot's first contributing commit after it (``away_s``),
  and per restart where that time went (``restarts``: the kill to the new incarnation's start,
  its start to ready, ready to its first quorum, the heal; whether a warm spare took the slot).

Pacing (``step_ms``): each replica's inner step takes at least ``step_ms`` milliseconds (it
waits out the rest after computing, as a straggler does), so replicas behave like machines of
a fixed speed: on a machine with fewer cores than replicas, a dead replica's core would
otherwise speed the survivors up and flatter the goodput.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from distoptim.cli.algorithms import make_torch_optimizer
from distoptim.cli.datasets import Dataset
from distoptim.cli.model import build_model, evaluate
from distoptim.comm.checksum import state_checksum
from distoptim.ft.data import SlotShards
from distoptim.ft.local import Chaos, ReplicaContext, ReplicaRun, run_replicas
from distoptim.ft.replica import NoPeersError, make_manager

__all__ = ["FT_ALGORITHMS", "FaultTolerantRecord", "FaultTolerantSpec", "run_fault_tolerant"]

FT_ALGORITHMS = ("sync", "localsgd", "diloco", "streaming-diloco")
"""The algorithms that run as torchft replica groups (the synchronous family)."""


@dataclass(frozen=True)
class FaultTolerantSpec:
    """One fault-tolerant run: the algorithm, its options, the model, the data, the schedule.

    ``steps``: committed steps (inner steps for the DiLoCo family) every replica trains;
    ``replicas``: replica groups (one process each); ``chaos``: the fault schedule or None;
    ``spares``: warm spare processes that take a killed group's slot at once.
    ``collective_timeout``: the manager's timeout (collectives, commits, heals). A replica that
    dies can leave a survivor waiting in a collective with a live peer that already gave the
    round up: that wait ends only at this timeout, so it is the main cost of a fault here; 3 s
    is a hundred times a healthy step's collective on this machine. ``heartbeat_timeout``: the
    lighthouse's: how long it still counts a group that stopped heartbeating (torchft's
    managers beat every 0.1 s) -- a killed group's quorum, and a warm spare's first one, wait
    that long (with one spare, 4 groups, a kill every 8 s: 2 s gave heals of 1.9-3.0 s, 1 s
    of 0.9-1.0 s); a live group silent that long would be dropped (the record's
    ``heartbeats`` say how long the live groups' longest silence was).
    """

    algo: str
    replicas: int
    steps: int
    batch_size: int = 16
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    hidden: tuple[int, ...] = (128, 64)
    sync_every: int = 50
    fragments: int = 2
    fragment_sync_delay: int = 1
    fragment_alpha: float = 0.5
    wire: str | None = None
    outer_lr: float = 1.0
    outer_momentum: float = 0.5
    chaos: Chaos | None = None
    step_ms: float = 0.0
    timeout: float = 1800.0
    collective_timeout: float = 3.0
    spares: int = 0
    heartbeat_timeout: float = 1.0

    def __post_init__(self) -> None:
        if self.algo not in FT_ALGORITHMS:
            raise ValueError(
                f"--fault-tolerant runs {', '.join(FT_ALGORITHMS)}; {self.algo!r} is not one "
                "(the parameter-server family tolerates dead workers on its own)"
            )


@dataclass
class FaultTolerantRecord:
    """What one fault-tolerant run did (see the module docstring for each figure)."""

    spec: dict[str, Any]
    wall_s: float
    useful_samples: int
    goodput: float  # useful samples per second
    commits: int  # distinct rounds committed (steps for sync, fragment syncs for DiLoCo)
    failed_rounds: int
    recoveries: int
    heal_s: list[float] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)  # restarted processes: spawn -> ready
    away_s: list[float] = field(default_factory=list)  # kill -> the slot contributing again
    restarts: list[dict[str, Any]] = field(default_factory=list)  # where each absence went
    final_val_acc: float | None = None
    final_val_loss: float | None = None
    states_equal: bool = True  # every commit's committers held bitwise-equal state
    mismatched_commits: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    # the live groups' longest heartbeat silences the lighthouse saw (HeartbeatWatch)
    heartbeats: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _build(spec: FaultTolerantSpec, inner: torch.optim.Optimizer, manager: Any) -> Any:
    import distoptim

    if spec.algo == "sync":
        return distoptim.CrossShardOptimizer(inner, manager=manager)
    if spec.algo == "localsgd":
        return distoptim.LocalSGD(inner, sync_every=spec.sync_every, manager=manager)
    params = [p for g in inner.param_groups for p in g["params"]]
    mu = spec.outer_momentum
    outer = torch.optim.SGD(params, lr=spec.outer_lr, momentum=mu, nesterov=mu > 0)
    streaming = spec.algo == "streaming-diloco"
    wire = spec.wire or ("int8" if streaming else "fp32")
    return distoptim.DiLoCo(
        inner,
        outer,
        sync_every=spec.sync_every,
        fragments=spec.fragments if streaming else 1,
        fragment_sync_delay=spec.fragment_sync_delay if streaming else 0,
        fragment_update_alpha=spec.fragment_alpha if streaming else 0.0,
        wire=wire,
        manager=manager,
    )


def _synced(opt: Any) -> tuple[int, list[torch.Tensor]]:
    """``(commit count, the state replicas agree on)`` of the optimizer."""
    if hasattr(opt, "global_parameters"):
        return opt.syncs, list(opt.global_parameters)
    return opt.iterations, [p for g in opt.param_groups for p in g["params"]]


def _state_fns(spec: FaultTolerantSpec, model: torch.nn.Module, inner: Any, opt: list[Any]) -> Any:
    """The user's side of a heal: the model and the optimizer's state (copies)."""

    # CrossShardOptimizer's own state dict carries its step counter; DiLoCo registers its own
    # counters, global copy and outer state with the manager, so the inner optimizer's is the
    # user's part there
    def holder() -> Any:
        return opt[0] if spec.algo == "sync" else inner

    def state() -> dict[str, Any]:
        return copy.deepcopy({"model": model.state_dict(), "opt": holder().state_dict()})

    def load(saved: dict[str, Any]) -> None:
        model.load_state_dict(saved["model"])
        holder().load_state_dict(saved["opt"])

    return state, load


def replica_main(ctx: ReplicaContext, spec: FaultTolerantSpec, data: Dataset) -> dict[str, Any]:
    """One replica group's process (see the module docstring); returns its final figures."""
    ready = time.time()
    model = build_model(data.num_features, data.num_classes, spec.seed, spec.hidden)
    inner = make_torch_optimizer(spec.optimizer, model.parameters(), spec.lr)
    holder: list[Any] = []
    state, load = _state_fns(spec, model, inner, holder)
    manager = make_manager(
        ctx.lighthouse,
        replica_id=ctx.replica_id,
        state_dict=state,
        load_state_dict=load,
        timeout=spec.collective_timeout,
        quorum_timeout=max(60.0, 4 * spec.collective_timeout),
        connect_timeout=30,
        init_sync=False,
    )
    opt = _build(spec, inner, manager)
    holder.append(opt)
    if ctx.incarnation and hasattr(opt, "join"):  # the DiLoCo family: heal at the next sync
        opt.join()
    n = int(data.x_train.shape[0])
    shards = SlotShards(n, ctx.num_slots, ctx.slot, spec.batch_size, spec.seed)
    ctx.log("ready")
    ctx.wait_for_peers(600)
    stats = opt.replica_stats
    pending, logged_round, pace = 0, False, spec.step_ms / 1000.0
    while opt.iterations < spec.steps:
        if ctx.incarnation and stats.commits == 0 and ctx.ending():
            manager.shutdown(wait=False)
            return {"joined": False}
        began = time.perf_counter()
        idx = shards.batch(opt.iterations)
        opt.zero_grad()
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        before = (stats.contributed, stats.commits, stats.heals, stats.failed)
        try:
            opt.step()
        except NoPeersError:
            if not ctx.incarnation or stats.commits:
                raise
            manager.shutdown(wait=False)  # it came back as the others finished the run
            return {"joined": False}
        pending += len(idx)
        if not logged_round and stats.first_round_at is not None:
            ctx.log("round", at=stats.first_round_at)
            logged_round = True
        if stats.heals > before[2]:
            ctx.log("heal")
        if stats.commits > before[1]:
            count, synced = _synced(opt)
            useful = pending if stats.contributed > before[0] else 0  # healing: not its work
            ctx.log(
                "commit", n=count, step=opt.iterations, samples=useful, state=state_checksum(synced)
            )
            pending = 0
        elif stats.failed > before[3]:  # a round that did not commit: its work is lost
            ctx.log("failed")
            pending = 0
        rest = pace - (time.perf_counter() - began)
        if rest > 0:
            time.sleep(rest)  # emulated compute time of a fixed-speed machine, not a wait
    if hasattr(opt, "finish"):
        opt.finish()
    acc, loss = evaluate(model, data.x_val, data.y_val)
    manager.shutdown(wait=False)
    return {
        "joined": True,
        "val_acc": acc,
        "val_loss": loss,
        "commits": stats.commits,
        "failed": stats.failed,
        "heals": stats.heals,
        "ready_at": ready,
    }


def run_fault_tolerant(spec: FaultTolerantSpec, data: Dataset) -> FaultTolerantRecord:
    """Run ``spec`` (see the module docstring) and summarise its events."""
    chaos = spec.chaos
    if chaos is not None and chaos.by_step is None:  # a short run meets a fault too
        chaos = dataclasses.replace(chaos, by_step=max(1, spec.steps // 3))
    run = run_replicas(
        replica_main,
        spec.replicas,
        args=(spec, data),
        chaos=chaos,
        spares=spec.spares,
        timeout=spec.timeout,
        join_timeout=_join_timeout(spec),
        heartbeat_timeout=spec.heartbeat_timeout,
    )
    return summarise(spec, run)


def _join_timeout(spec: FaultTolerantSpec) -> float:
    """How long a quorum waits for live replicas that have not asked yet: a few collective
    timeouts, and longer than the inner steps between two DiLoCo syncs (their sync points)."""
    between_syncs = spec.sync_every * max(spec.step_ms, 10.0) / 1000 if spec.algo != "sync" else 0
    return max(spec.collective_timeout, 4 * between_syncs)


def summarise(spec: FaultTolerantSpec, run: ReplicaRun) -> FaultTolerantRecord:
    """The figures of a finished run, from its events and its replicas' return values."""
    events = run.events
    readies = [e["t"] for e in events if e["kind"] == "ready" and e["inc"] == 0]
    start = max(readies) if readies else run.started_at
    # a restarted replica that never joined (the run ended first) did no training: its
    # process start does not lengthen the run
    trained = {(e["slot"], e["inc"]) for e in events if e["kind"] == "commit"}
    ends = [e["t"] for e in events if e["kind"] == "returned" and (e["slot"], e["inc"]) in trained]
    end = max(ends, default=run.ended_at)
    wall = max(end - start, 1e-9)
    useful = sum(e["samples"] for e in events if e["kind"] == "commit")
    states: dict[int, set[int]] = {}
    for e in events:
        if e["kind"] == "commit":
            states.setdefault(e["n"], set()).add(e["state"])
    mismatched = sum(1 for v in states.values() if len(v) > 1)
    heal_s, start_s = _heal_times(events)
    restarts = _restarts(events, run)
    finals = [v for v in run.values if isinstance(v, dict) and v.get("joined")]
    return FaultTolerantRecord(
        spec=dataclasses.asdict(spec) | {"chaos": str(spec.chaos) if spec.chaos else None},
        wall_s=wall,
        useful_samples=useful,
        goodput=useful / wall,
        commits=len(states),
        failed_rounds=sum(v["failed"] for v in finals),
        recoveries=sum(1 for e in events if e["kind"] == "heal"),
        heal_s=heal_s,
        start_s=start_s,
        away_s=[r["away_s"] for r in restarts if r["away_s"] is not None],
        restarts=restarts,
        final_val_acc=statistics.fmean(v["val_acc"] for v in finals) if finals else None,
        final_val_loss=statistics.fmean(v["val_loss"] for v in finals) if finals else None,
        states_equal=mismatched == 0,
        mismatched_commits=mismatched,
        faults=[dataclasses.asdict(a) for a in run.chaos],
        heartbeats=dict(run.heartbeats),
    )


def _heal_times(events: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Per restarted incarnation: first quorum -> first contributing commit, and spawn -> ready."""
    heal, start = [], []
    by_inc: dict[tuple[int, int], dict[str, float]] = {}
    for e in events:
        key = (e["slot"], e["inc"])
        if e["inc"] == 0:
            continue
        marks = by_inc.setdefault(key, {})
        if e["kind"] == "process":
            marks["spawned"] = e.get("spawned_at", e["t"])
        elif e["kind"] == "ready":
            marks.setdefault("ready", e["t"])
        elif e["kind"] == "round" and "round" not in marks:
            marks["round"] = e["at"]
        elif e["kind"] == "commit" and e["samples"] > 0 and "contributed" not in marks:
            marks["contributed"] = e["t"]
    for marks in by_inc.values():
        if "spawned" in marks and "ready" in marks:
            start.append(marks["ready"] - marks["spawned"])
        if "round" in marks and "contributed" in marks:
            heal.append(marks["contributed"] - marks["round"])
    return heal, start


def _restarts(events: list[dict[str, Any]], run: ReplicaRun) -> list[dict[str, Any]]:
    """Per kill: where the slot's time away went, in seconds (None: the run ended first).

    ``restart_s`` -- kill to the next incarnation's start (the schedule's pause, the hand-off);
    ``start_s`` -- its start to ready (a new process: its start and imports; a warm spare:
    building the model and the manager); ``wait_s`` -- ready to its first quorum; ``heal_s`` --
    first quorum to its first contributing commit; ``away_s`` -- kill to that commit."""
    marks: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        m = marks.setdefault((e["slot"], e["inc"]), {})
        if e["kind"] == "process":
            m["spawned"], m["spare"] = e.get("spawned_at", e["t"]), bool(e.get("spare"))
            if "warm_since" in e:
                m["warm"] = e["warm_since"]
        elif e["kind"] in ("ready", "round"):
            m.setdefault(e["kind"], e.get("at", e["t"]))
        elif e["kind"] == "commit" and e["samples"] > 0:
            m.setdefault("contributed", e["t"])
    out = []
    incarnation = dict.fromkeys(range(len(run.values)), 0)
    for action in sorted(run.chaos, key=lambda a: a.at):
        if action.action != "kill":
            continue
        incarnation[action.slot] += 1
        m = marks.get((action.slot, incarnation[action.slot]), {})

        def span(a: str, b: str, m: dict[str, Any] = m) -> float | None:
            return m[b] - m[a] if a in m and b in m else None

        m["killed"] = action.at
        out.append(
            {
                "slot": action.slot,
                "spare": m.get("spare", False),
                "warm_before_kill_s": span("warm", "killed"),  # a spare: < 0 if not ready
                "restart_s": span("killed", "spawned"),
                "start_s": span("spawned", "ready"),
                "wait_s": span("ready", "round"),
                "heal_s": span("round", "contributed"),
                "away_s": span("killed", "contributed"),
            }
        )
    return out
