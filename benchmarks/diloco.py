"""Benchmark: bytes and wall time to a target accuracy -- sync vs LocalSGD vs (Streaming) DiLoCo.

Four replicas (local gloo ranks; two under ``--quick``) train the same MLP (64 -> 128 -> 64 ->
10, ReLU) on the embedded digits dataset (``distoptim.cli.datasets``: 1,438 training / 359
validation images); each replica reads a disjoint quarter of the training set every epoch,
batch 32. Contenders:

* ``sync``: ``CrossShardOptimizer(Adam(lr=1e-3))`` -- a gradient all-reduce every step;
* ``localsgd_h10``: ``LocalSGD(Adam(lr=1e-3), sync_every=10)``;
* ``diloco_h10`` / ``diloco_h50``: ``DiLoCo(Adam(lr=1e-3), SGD(lr=0.7, momentum=0.9,
  nesterov=True), sync_every=H)`` (the paper's outer optimizer);
* ``streaming_f4_int8``: the same with ``sync_every=48`` (``H`` must be divisible by ``F``),
  ``fragments=4, fragment_sync_delay=1, fragment_update_alpha=0.5, wire="int8"``.

Asynchronous contenders (:data:`ASYNC_CONTENDERS`), the same four replicas as workers of a
parameter-server cluster (``distoptim.agn.spawn``, one shard, ``p2p``; the shard pays the
emulated link for its replies too):

* ``async_diloco_h10``: ``AsyncDiLoCoOptimizer(Adam(lr=1e-3), 4, communication_period=10)``
  with the default outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9) applied to every commit
  (the paper's "Async. DiLoCo");
* ``async_diloco_h10_dn_dylu``: the same with Delayed Nesterov (``delayed_momentum=4``, the
  paper's ``N`` = number of workers: ``"n"`` below) and Dynamic Local Updates;
* ``async_diloco_h10_dn_dylu_lr035``: the same with the outer learning rate halved (0.35): in
  a single-process simulation of round-robin asynchronous commits on this task (no grace
  period, so every pseudo-gradient is three commits stale), Delayed Nesterov at DiLoCo's 0.7
  oscillates and never reaches the target within 400 steps while 0.35 does (not tuned on this
  benchmark's runs);
* ``agn_h10``: ``AGNOptimizer(Adam(lr=1e-3), 4, communication_period=10, update_rule="delta")``
  (AGN's paper rule, the CLI's default).

Scenarios (the link is emulated by :mod:`distoptim.comm.link`, paid where the optimizers count
their bytes): ``slow_link`` -- 2 ms and 100 Mbit/s per message; ``straggler`` -- the same link,
and rank 3's steps take 3x as long (after each step it sleeps twice the time its forward,
backward and inner step took: emulated at the step boundary; rank 1 of two under ``--quick``).

Measured per run, on rank 0: the wall time and the bytes rank 0 sent (``comm_stats``) until the
validation accuracy first reaches the target -- 0.95 x the final accuracy of ``sync`` on the
slow link, in the same repeat -- evaluated every 10 steps on a snapshot of the model (sync:
rank 0's parameters; the DiLoCo family: the global copy, what a sync hands every replica;
AsyncDiLoCo: the center as worker 0 last received it, ``global_parameters()``; AGN: worker 0's
parameters right after its commit, i.e. the center it just received, as ``λ`` = 10 = the
evaluation period); snapshots are evaluated after the run, outside the clock. Also: final
accuracy (async: the center when every worker is done), total bytes, and the peak bytes of
one sync (for a fragment: from its launch to its outer step; async: one commit's payload).
Bytes of the asynchronous workers are worker 0's commit payloads (what it sends; it receives
as many bytes of center back), the ring all-reduce's counterpart being rank 0's sent bytes.
The wall time of an asynchronous run is its last worker's (with a straggler the fast workers
finish first: the time to the target is reached, or not, while worker 0 trains, else at the
end on the final center). The runs of one repeat are shuffled inside two launches, one
``distoptim.launch`` group for the synchronous contenders and one parameter-server cluster for
the asynchronous ones, in a shuffled order (``--quick``: both kinds, in that order, on one
cluster's processes: the synchronous contenders over a gloo group of its workers); ratios
against ``sync`` are paired within a repeat (median over repeats).

Run::

    python benchmarks/diloco.py             # 3 repeats, ~10-20 minutes on 2 cores
    python benchmarks/diloco.py --quick     # a smoke run: 2 replicas, 1 repeat of 3 epochs,
                                            # every contender on one cluster's processes

Prints a table and writes ``benchmarks/results/diloco.json`` (``--out``). A ``--quick`` run
(every contender in every scenario on two replicas, 3 epochs: long enough for ``H`` = 50 to
sync once; the code paths, not the figures) writes ``benchmarks/results/quick/diloco.json``
unless ``--out`` says otherwise, so it never replaces the shipped figures. The dataset is
loaded once, by the parent, and handed to every process.
"""

from __future__ import annotations

import functools
import os
import platform
import random
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import Bench, machine
from torch import nn

import distoptim
from distoptim import agn
from distoptim.cli.datasets import load_dataset, shard_indices
from distoptim.comm import link
from distoptim.launch import import_dynamo_before_groups, spawn

WORLD = 4
QUICK_WORLD, QUICK_EPOCHS = 2, 3
"""``--quick``: 2 replicas, 3 epochs (66 steps each, so every contender syncs at least once);
every process start costs seconds, so the smoke run starts as few as it can."""
BATCH = 32
EVAL_EVERY = 10
LINK = link.Link(latency_ms=2.0, mbps=100.0)
SCENARIOS: dict[str, float | None] = {"slow_link": None, "straggler": 3.0}
"""Scenario -> how many times as long the last rank's steps take (None: no straggler)."""
CONTENDERS: dict[str, dict[str, Any]] = {
    "sync": {},
    "localsgd_h10": {"sync_every": 10},
    "diloco_h10": {"sync_every": 10},
    "diloco_h50": {"sync_every": 50},
    "streaming_f4_int8": {
        "sync_every": 48,  # divisible by 4 fragments: one fragment sync every 12 steps
        "fragments": 4,
        "fragment_sync_delay": 1,
        "fragment_update_alpha": 0.5,
        "wire": "int8",
    },
}
ASYNC_CONTENDERS: dict[str, dict[str, Any]] = {
    "async_diloco_h10": {"communication_period": 10},
    "async_diloco_h10_dn_dylu": {
        "communication_period": 10,
        "delayed_momentum": "n",
        "dynamic_local_updates": True,
    },
    "async_diloco_h10_dn_dylu_lr035": {
        "communication_period": 10,
        "delayed_momentum": "n",
        "dynamic_local_updates": True,
        "outer_optimizer": functools.partial(torch.optim.SGD, lr=0.35, momentum=0.9, nesterov=True),
    },
    "agn_h10": {"communication_period": 10, "update_rule": "delta"},
}
TARGET_FRACTION = 0.95


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every replica and for every contender
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def _optimizer(name: str, model: nn.Module) -> Any:
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    if name == "sync":
        return distoptim.CrossShardOptimizer(inner)
    kwargs = CONTENDERS[name]
    if name.startswith("localsgd"):
        return distoptim.LocalSGD(inner, **kwargs)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return distoptim.DiLoCo(inner, outer, **kwargs)


def _snapshot(name: str, model: nn.Module, opt: Any) -> list[torch.Tensor]:
    params = model.parameters() if name == "sync" else opt.global_parameters
    return [p.detach().clone() for p in params]


@torch.no_grad()
def _accuracy(
    model: nn.Module, params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> float:
    for p, v in zip(model.parameters(), params):
        p.copy_(v)
    return (model(x).argmax(1) == y).float().mean().item()


def _train(
    rank: int,
    world: int,
    scenario: str,
    epochs: int,
    data: Any,
    model: nn.Module,
    opt: Any,
    start_together: Any,
    sent: Any,
    snapshot: Any,
) -> tuple[list[tuple[int, float, int, list[torch.Tensor]]], list[int], float]:
    """The training loop every contender runs: rank ``rank``'s share of the data each epoch,
    the straggler's sleep, a snapshot every ``EVAL_EVERY`` steps on rank 0. ``start_together()``
    starts the clock on every rank at once, ``sent()`` is the bytes sent so far, ``snapshot()``
    the parameters to evaluate. Returns (snapshots, bytes per step, wall seconds)."""
    factor = SCENARIOS[scenario] or 1.0
    slow = factor > 1.0 and rank == world - 1
    n = int(data.x_train.shape[0])
    steps_per_epoch = n // world // BATCH
    snapshots: list[tuple[int, float, int, list[torch.Tensor]]] = []
    step_bytes: list[int] = []
    start_together()
    start = time.perf_counter()
    step = 0
    for epoch in range(epochs):
        idx = shard_indices(n, rank, world, epoch, seed=0)
        for s in range(steps_per_epoch):
            take = idx[s * BATCH : (s + 1) * BATCH]
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[take]), data.y_train[take]).backward()
            compute = time.perf_counter() - t0
            before = sent()
            opt.step()
            step += 1
            step_bytes.append(sent() - before)
            if slow:  # the straggler's step takes `factor` times as long
                time.sleep((factor - 1.0) * compute)
            if rank == 0 and step % EVAL_EVERY == 0:
                snapshots.append((step, time.perf_counter() - start, sent(), snapshot()))
    return snapshots, step_bytes, time.perf_counter() - start


def _history(
    snapshots: list[tuple[int, float, int, list[torch.Tensor]]], data: Any
) -> list[dict[str, Any]]:
    eval_model = _model()
    return [
        {
            "step": s,
            "time_s": t,
            "bytes": b,
            "val_acc": _accuracy(eval_model, p, data.x_val, data.y_val),
        }
        for s, t, b, p in snapshots
    ]


def _one_run(
    rank: int, world: int, name: str, scenario: str, epochs: int, data: Any
) -> dict[str, Any]:
    model = _model()
    opt = _optimizer(name, model)
    stats = opt.comm_stats
    snapshots, step_bytes, wall = _train(
        rank,
        world,
        scenario,
        epochs,
        data,
        model,
        opt,
        dist.barrier,
        lambda: stats.bytes_sent,
        lambda: _snapshot(name, model, opt),
    )
    dist.barrier()
    if rank != 0:
        return {}
    return {
        "contender": name,
        "scenario": scenario,
        "steps": len(step_bytes),
        "wall_s": wall,
        "bytes": stats.bytes_sent,
        "collectives": stats.collectives,
        "peak_sync_bytes": _peak_sync_bytes(name, opt, step_bytes),
        "final_val_acc": _accuracy(_model(), _snapshot(name, model, opt), data.x_val, data.y_val),
        "history": _history(snapshots, data),
    }


def _peak_sync_bytes(name: str, opt: Any, step_bytes: list[int]) -> int:
    """The most bytes one sync moved: a step for sync, launch..outer step for a fragment."""
    if name == "sync":
        return max(step_bytes)
    delay = opt.fragment_sync_delay
    peaks = [
        sum(step_bytes[t - 1 : t + delay])
        for t in range(1, len(step_bytes) + 1)
        if opt.schedule.launching_at(t) is not None
    ]
    return max(peaks)


def _worker(
    rank: int, world: int, runs: list[tuple[str, str]], epochs: int, data: Any
) -> list[dict]:
    torch.set_num_threads(1)
    link.set_link(LINK)
    out = []
    for scenario, name in runs:
        record = _one_run(rank, world, name, scenario, epochs, data)
        if record:
            out.append(record)
    return out


# ---------------------------------------------------------------------------------------------
# the asynchronous contenders, on a parameter-server cluster
# ---------------------------------------------------------------------------------------------
def _async_optimizer(name: str, model: nn.Module, table: str, world: int) -> Any:
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    kwargs = dict(ASYNC_CONTENDERS[name])
    if kwargs.get("delayed_momentum") == "n":  # the paper's N: the number of workers
        kwargs["delayed_momentum"] = world
    if name.startswith("agn"):
        return distoptim.AGNOptimizer(inner, world, name=table, **kwargs)
    return distoptim.AsyncDiLoCoOptimizer(inner, world, name=table, **kwargs)


def _store_barrier(store: Any, key: str, world: int) -> None:
    """Every worker arrives, then all go (bounded)."""
    if int(store.add(f"{key}/arrived", 1)) == world:
        store.set(f"{key}/go", "1")
    store.wait([f"{key}/go"], timedelta(seconds=600))


def _one_async_run(
    ctx: Any, table: str, name: str, scenario: str, epochs: int, data: Any
) -> dict[str, Any]:
    task, world = ctx.task_index, ctx.num_worker
    model = _model()
    opt = _async_optimizer(name, model, table, world)
    hook = opt.make_session_run_hook(ctx.is_chief, task)
    hook.begin()
    hook.after_create_session()
    payload = sum(p.numel() * p.element_size() for p in model.parameters())
    agn_run = isinstance(opt, distoptim.AGNOptimizer)
    lam = opt.communication_period

    def sent() -> int:  # worker 0's commit payloads
        return (opt.local_step // lam) * payload if agn_run else opt.bytes_sent

    def snapshot() -> list[torch.Tensor]:  # AGN: right after a commit (λ = EVAL_EVERY)
        return _params(model) if agn_run else opt.global_parameters()

    snapshots, step_bytes, wall = _train(
        task,
        world,
        scenario,
        epochs,
        data,
        model,
        opt,
        lambda: _store_barrier(ctx.store, f"bench/{table}/start", world),
        sent,
        snapshot,
    )
    record: dict[str, Any] = {"task": task, "wall_s": wall, "steps": len(step_bytes)}
    if task == 0:
        record.update(
            contender=name,
            scenario=scenario,
            table=table,
            bytes=sent(),
            commits=opt.local_step // lam if agn_run else opt.commits,
            peak_sync_bytes=payload,
            snapshots=snapshots,
        )
    if not agn_run and opt.dynamic_local_updates:
        record["dylu_period_last"] = opt.period
    return record


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _async_worker(ctx: Any, runs: list[tuple[str, str, str]], epochs: int, data: Any) -> list[dict]:
    torch.set_num_threads(1)
    link.set_link(LINK)
    return [
        _one_async_run(ctx, table, name, scenario, epochs, data) for table, scenario, name in runs
    ]


def _tables(runs: list[tuple[str, str]], repeat: int) -> list[tuple[str, str, str]]:
    """The asynchronous runs of a repeat as (the server table's name, scenario, contender)."""
    return [(f"{name}/{scenario}/{repeat}", scenario, name) for scenario, name in runs]


def _cluster(worker: Any, world: int, args: tuple) -> Any:
    """A parameter-server cluster (one shard, ``world`` workers) running ``worker(ctx, *args)``
    on each worker, over the emulated link."""
    saved = os.environ.get(link.ENV_VAR)
    os.environ[link.ENV_VAR] = LINK.to_env()  # the shard pays the link for its replies too
    try:
        return agn.spawn(worker, world, num_ps=1, args=args, timeout=3600, num_threads=1)
    finally:
        if saved is None:
            os.environ.pop(link.ENV_VAR, None)
        else:
            os.environ[link.ENV_VAR] = saved


def _run_async(
    runs: list[tuple[str, str]], epochs: int, repeat: int, world: int, data: Any
) -> list[dict]:
    """One cluster (one shard, ``world`` workers) running ``runs`` in order; one record per
    run."""
    tables = _tables(runs, repeat)
    result = _cluster(_async_worker, world, (tables, epochs, data))
    per_worker = [result.worker_results[t] for t in range(world)]
    return _async_records(tables, per_worker, result, data, repeat)


def _both_kinds_worker(
    ctx: Any, launches: list[tuple[str, list]], epochs: int, data: Any
) -> dict[str, list[dict]]:
    """``--quick``: a repeat's two launches on one cluster's workers, in their order -- the
    synchronous contenders over a process group of the workers (made from the cluster's store;
    the parameter-server transport needs no default group), the asynchronous ones on the
    shard. One start of every process instead of two: a smoke run's CPU is mostly start-up."""
    out: dict[str, list[dict]] = {}
    for kind, runs in launches:
        if kind == "async":
            out[kind] = _async_worker(ctx, runs, epochs, data)
            continue
        import_dynamo_before_groups()
        store = dist.PrefixStore("bench/sync", ctx.store)
        dist.init_process_group(
            "gloo", store=store, rank=ctx.task_index, world_size=ctx.num_worker,
            timeout=timedelta(seconds=600),
        )  # fmt: skip
        try:
            out[kind] = _worker(ctx.task_index, ctx.num_worker, runs, epochs, data)
        finally:
            dist.destroy_process_group()
    return out


def _run_both(
    launches: list[tuple[str, list]], epochs: int, repeat: int, world: int, data: Any
) -> list[dict]:
    """``--quick``: a repeat's launches on one cluster (:func:`_both_kinds_worker`)."""
    sent = [(k, _tables(runs, repeat) if k == "async" else runs) for k, runs in launches]
    result = _cluster(_both_kinds_worker, world, (sent, epochs, data))
    tables = next(runs for k, runs in sent if k == "async")
    per_worker = [result.worker_results[t]["async"] for t in range(world)]
    records = [{**r, "repeat": repeat} for r in result.worker_results[0]["sync"]]
    return records + _async_records(tables, per_worker, result, data, repeat)


def _async_records(
    tables: list[tuple[str, str, str]],
    per_worker: list[list[dict]],
    result: Any,
    data: Any,
    repeat: int,
) -> list[dict]:
    """One record per asynchronous run: worker 0's, with every worker's wall time, the final
    center's accuracy and the shard's figures. ``per_worker[t][i]``: worker t's record of
    ``tables[i]``."""
    world = len(per_worker)
    eval_model = _model()
    records = []
    for i, (table, _, _) in enumerate(tables):
        per_task = [per_worker[t][i] for t in range(world)]
        rec = dict(per_task[0])
        snapshots = rec.pop("snapshots")
        wall = max(r["wall_s"] for r in per_task)
        final = _accuracy(eval_model, result.centers[table], data.x_val, data.y_val)
        history = _history(snapshots, data)
        history.append(
            {"step": rec["steps"], "time_s": wall, "bytes": rec["bytes"], "val_acc": final}
        )
        per = result.stats.per_optimizer[table]
        rec.update(
            wall_s=wall,
            worker0_wall_s=per_task[0]["wall_s"],
            workers_wall_s=[r["wall_s"] for r in per_task],
            final_val_acc=final,
            history=history,
            server_commits=per["commits_per_worker"],
            server_bytes=per["bytes_in"] + per["bytes_out"],
            staleness=per["staleness_histogram"],
            repeat=repeat,
        )
        rec.pop("table", None)
        records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------
# the parent: schedule, targets, ratios
# ---------------------------------------------------------------------------------------------
def _to_target(history: list[dict], target: float) -> tuple[float | None, int | None, int | None]:
    for h in history:
        if h["val_acc"] >= target:
            return h["time_s"], h["bytes"], h["step"]
    return None, None, None


def _summarize(records: list[dict]) -> dict[str, Any]:
    repeats = sorted({r["repeat"] for r in records})
    by = {(r["repeat"], r["scenario"], r["contender"]): r for r in records}
    for r in records:
        sync_final = by[(r["repeat"], "slow_link", "sync")]["final_val_acc"]
        r["target"] = TARGET_FRACTION * sync_final
        r["time_to_target_s"], r["bytes_to_target"], r["steps_to_target"] = _to_target(
            r["history"], r["target"]
        )
    summary: dict[str, Any] = {}
    for scenario in SCENARIOS:
        rows = {}
        for name in [*CONTENDERS, *ASYNC_CONTENDERS]:
            runs = [by[(k, scenario, name)] for k in repeats]
            syncs = [by[(k, scenario, "sync")] for k in repeats]

            def med(values: list[float | None]) -> float | None:
                vals = [v for v in values if v is not None]
                return statistics.median(vals) if vals else None

            def ratio(a: float | None, b: float | None) -> float | None:
                return None if a is None or b is None or a == 0 else b / a

            rows[name] = {
                "final_val_acc": med([r["final_val_acc"] for r in runs]),
                "final_vs_sync_points": med(
                    [100 * (r["final_val_acc"] - s["final_val_acc"]) for r, s in zip(runs, syncs)]
                ),
                "reached_target": sum(r["time_to_target_s"] is not None for r in runs),
                "time_to_target_s": med([r["time_to_target_s"] for r in runs]),
                "bytes_to_target": med([r["bytes_to_target"] for r in runs]),
                "total_bytes": med([r["bytes"] for r in runs]),
                "wall_s": med([r["wall_s"] for r in runs]),
                "peak_sync_bytes": med([r["peak_sync_bytes"] for r in runs]),
                # paired within a repeat: how many times less than sync (>1: better)
                "bytes_to_target_reduction": med(
                    [ratio(r["bytes_to_target"], s["bytes_to_target"]) for r, s in zip(runs, syncs)]
                ),
                "total_bytes_reduction": med(
                    [ratio(r["bytes"], s["bytes"]) for r, s in zip(runs, syncs)]
                ),
                "time_to_target_speedup": med(
                    [
                        ratio(r["time_to_target_s"], s["time_to_target_s"])
                        for r, s in zip(runs, syncs)
                    ]
                ),
            }
        summary[scenario] = rows
    return summary


def _goal(records: list[dict]) -> dict[str, Any]:
    """With the straggler: time to the target of each sync DiLoCo over each AsyncDiLoCo,
    paired within a repeat (> 1: AsyncDiLoCo reached it sooner); None where one never did."""
    by = {(r["repeat"], r["scenario"], r["contender"]): r for r in records}
    repeats = sorted({r["repeat"] for r in records})
    out: dict[str, Any] = {}
    for a in (n for n in ASYNC_CONTENDERS if n.startswith("async_diloco")):
        for sync in ("diloco_h10", "diloco_h50"):
            pairs = [
                (
                    by[(k, "straggler", sync)]["time_to_target_s"],
                    by[(k, "straggler", a)]["time_to_target_s"],
                )
                for k in repeats
            ]
            ratios = [None if x is None or y is None else x / y for x, y in pairs]
            out[f"{sync}/{a}"] = {
                "per_repeat": ratios,
                "median": statistics.median(r for r in ratios if r is not None)
                if any(r is not None for r in ratios)
                else None,
            }
    return out


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print(summary: dict[str, Any]) -> None:
    head = (
        f"{'contender':<31} {'final acc':>9} {'vs sync':>8} {'to target':>9} {'s':>7} "
        f"{'bytes':>11} {'x fewer':>8} {'speedup':>8} {'total B':>11} {'peak/sync':>10}"
    )
    for scenario, rows in summary.items():
        print(f"\n== {scenario} ==\n{head}")
        for name, row in rows.items():
            print(
                f"{name:<31} {_fmt(row['final_val_acc'], '.4f'):>9} "
                f"{_fmt(row['final_vs_sync_points'], '+.2f'):>8} "
                f"{row['reached_target']:>9} {_fmt(row['time_to_target_s'], '.2f'):>7} "
                f"{_fmt(row['bytes_to_target'], ',.0f'):>11} "
                f"{_fmt(row['bytes_to_target_reduction'], '.1f'):>8} "
                f"{_fmt(row['time_to_target_speedup'], '.2f'):>8} "
                f"{_fmt(row['total_bytes'], ',.0f'):>11} {_fmt(row['peak_sync_bytes'], ',.0f'):>10}"
            )


def main() -> None:
    bench = Bench(
        __file__,
        __doc__,
        quick=f"{QUICK_WORLD} replicas, 1 repeat, {QUICK_EPOCHS} epochs (smoke run)",
    )
    bench.parser.add_argument("--repeats", type=int, default=3)
    bench.parser.add_argument("--epochs", type=int, default=60)
    bench.parser.add_argument("--seed", type=int, default=0, help="shuffles the run order")
    args = bench.parse()
    repeats, epochs = (1, QUICK_EPOCHS) if args.quick else (args.repeats, args.epochs)
    world = QUICK_WORLD if args.quick else WORLD
    data = load_dataset("digits")
    rng = random.Random(args.seed)
    order = []  # per repeat: [(launch, [(scenario, contender), ...]), ...] in launch order
    for _ in range(repeats):
        launches = []
        for kind, names in (("sync", CONTENDERS), ("async", ASYNC_CONTENDERS)):
            runs = [(s, c) for s in SCENARIOS for c in names]
            rng.shuffle(runs)
            launches.append((kind, runs))
        rng.shuffle(launches)
        order.append(launches)
    records = []
    for repeat, launches in enumerate(order):
        if args.quick:  # both launches on one cluster
            records += _run_both(launches, epochs, repeat, world, data)
            continue
        for kind, runs in launches:
            if kind == "async":
                records += _run_async(runs, epochs, repeat, world, data)
                continue
            got = spawn(_worker, world, args=(runs, epochs, data), timeout=3600, num_threads=1)[0]
            records += [{**r, "repeat": repeat} for r in got]
    summary = _summarize(records)
    _print(summary)
    goal = _goal(records)
    print("\n== straggler: sync DiLoCo's time to target / AsyncDiLoCo's (> 1: async sooner) ==")
    for k, v in goal.items():
        print(f"{k:<45} median {_fmt(v['median'], '.2f')}  per repeat {v['per_repeat']}")
    result = {
        "benchmark": "diloco",
        "machine": machine(processor=platform.processor()),
        "config": {
            "world": world,
            "batch_per_replica": BATCH,
            "epochs": epochs,
            "repeats": repeats,
            "eval_every": EVAL_EVERY,
            "link": {"latency_ms": LINK.latency_ms, "mbps": LINK.mbps},
            "scenarios": {k: None if v is None else (world - 1, v) for k, v in SCENARIOS.items()},
            "contenders": CONTENDERS,
            "async_contenders": {
                name: {k: repr(v) if callable(v) else v for k, v in kwargs.items()}
                for name, kwargs in ASYNC_CONTENDERS.items()
            },
            "target_fraction_of_sync_final": TARGET_FRACTION,
            "order": order,
        },
        "summary": summary,
        "goal_straggler_time_to_target": goal,
        "runs": records,
    }
    bench.save(result)


if __name__ == "__main__":
    main()
