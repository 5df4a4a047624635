"""Benchmark: bytes and wall time to a target accuracy -- sync vs LocalSGD vs (Streaming) DiLoCo.

Four replicas (local gloo ranks) train the same MLP (64 -> 128 -> 64 -> 10, ReLU) on the
embedded digits dataset (``distoptim.cli.datasets``: 1,438 training / 359 validation images);
each replica reads a disjoint quarter of the training set every epoch, batch 32. Contenders:

* ``sync``: ``CrossShardOptimizer(Adam(lr=1e-3))`` -- a gradient all-reduce every step;
* ``localsgd_h10``: ``LocalSGD(Adam(lr=1e-3), sync_every=10)``;
* ``diloco_h10`` / ``diloco_h50``: ``DiLoCo(Adam(lr=1e-3), SGD(lr=0.7, momentum=0.9,
  nesterov=True), sync_every=H)`` (the paper's outer optimizer);
* ``streaming_f4_int8``: the same with ``sync_every=48`` (``H`` must be divisible by ``F``),
  ``fragments=4, fragment_sync_delay=1, fragment_update_alpha=0.5, wire="int8"``.

The asynchronous contenders (AsyncDiLoCo and AGN on the parameter server) have their place in
:data:`ASYNC_CONTENDERS`; they are reported as "not run" until AsyncDiLoCo exists.

Scenarios (the link is emulated by :mod:`distoptim.comm.link`, paid where the optimizers count
their bytes): ``slow_link`` -- 2 ms and 100 Mbit/s per message; ``straggler`` -- the same link,
and rank 3's steps take 3x as long (after each step it sleeps twice the time its forward,
backward and inner step took: emulated at the step boundary).

Measured per run, on rank 0: the wall time and the bytes rank 0 sent (``comm_stats``) until the
validation accuracy first reaches the target -- 0.95 x the final accuracy of ``sync`` on the
slow link, in the same repeat -- evaluated every 10 steps on a snapshot of the model (sync:
rank 0's parameters; the DiLoCo family: the global copy, what a sync hands every replica);
snapshots are evaluated after the run, outside the clock. Also: final accuracy, total bytes,
and the peak bytes of one sync (for a fragment: from its launch to its outer step). The runs
of one repeat are interleaved in a shuffled order inside one spawned group; ratios against
``sync`` are paired within a repeat (median over repeats).

Run::

    python benchmarks/diloco.py             # 3 repeats, ~3-6 minutes on 2 cores
    python benchmarks/diloco.py --quick     # a smoke run

Prints a table and writes ``benchmarks/results/diloco.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import distoptim
from distoptim.cli.datasets import load_dataset, shard_indices
from distoptim.comm import link
from distoptim.launch import spawn

RESULTS = Path(__file__).resolve().parent / "results" / "diloco.json"
WORLD = 4
BATCH = 32
EVAL_EVERY = 10
LINK = link.Link(latency_ms=2.0, mbps=100.0)
SCENARIOS: dict[str, tuple[int, float] | None] = {"slow_link": None, "straggler": (3, 3.0)}
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
ASYNC_CONTENDERS = {
    "async_diloco": "not run: distoptim.AsyncDiLoCoOptimizer does not exist yet",
    "agn": "not run: added together with async_diloco (same parameter-server launcher)",
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


def _one_run(rank: int, name: str, scenario: str, epochs: int, data: Any) -> dict[str, Any]:
    straggler = SCENARIOS[scenario]
    slow = straggler is not None and straggler[0] == rank
    factor = straggler[1] if straggler is not None else 1.0
    model = _model()
    opt = _optimizer(name, model)
    stats = opt.comm_stats
    n = int(data.x_train.shape[0])
    steps_per_epoch = n // WORLD // BATCH
    snapshots: list[tuple[int, float, int, list[torch.Tensor]]] = []
    step_bytes: list[int] = []
    dist.barrier()
    start = time.perf_counter()
    step = 0
    for epoch in range(epochs):
        idx = shard_indices(n, rank, WORLD, epoch, seed=0)
        for s in range(steps_per_epoch):
            take = idx[s * BATCH : (s + 1) * BATCH]
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(data.x_train[take]), data.y_train[take]).backward()
            compute = time.perf_counter() - t0
            before = stats.bytes_sent
            opt.step()
            step += 1
            step_bytes.append(stats.bytes_sent - before)
            if slow:  # the straggler's step takes `factor` times as long
                time.sleep((factor - 1.0) * compute)
            if rank == 0 and step % EVAL_EVERY == 0:
                snapshots.append(
                    (
                        step,
                        time.perf_counter() - start,
                        stats.bytes_sent,
                        _snapshot(name, model, opt),
                    )
                )
    wall = time.perf_counter() - start
    dist.barrier()
    if rank != 0:
        return {}
    eval_model = _model()
    history = [
        {
            "step": s,
            "time_s": t,
            "bytes": b,
            "val_acc": _accuracy(eval_model, p, data.x_val, data.y_val),
        }
        for s, t, b, p in snapshots
    ]
    return {
        "contender": name,
        "scenario": scenario,
        "steps": step,
        "wall_s": wall,
        "bytes": stats.bytes_sent,
        "collectives": stats.collectives,
        "peak_sync_bytes": _peak_sync_bytes(name, opt, step_bytes),
        "final_val_acc": _accuracy(eval_model, _snapshot(name, model, opt), data.x_val, data.y_val),
        "history": history,
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


def _worker(rank: int, world: int, order: list[list[tuple[str, str]]], epochs: int) -> list[dict]:
    torch.set_num_threads(1)
    data = load_dataset("digits")
    link.set_link(LINK)
    out = []
    for repeat, runs in enumerate(order):
        for scenario, name in runs:
            record = _one_run(rank, name, scenario, epochs, data)
            if record:
                record["repeat"] = repeat
                out.append(record)
    return out


# ---------------------------------------------------------------------------------------------
# the parent: schedule, targets, ratios
# ---------------------------------------------------------------------------------------------
def _to_target(history: list[dict], target: float) -> tuple[float | None, int | None, int | None]:
    for h in history:
        if h["val_acc"] >= target:
            return h["time_s"], h["bytes"], h["step"]
    return None, None, None


def _load() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        return "unknown"


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
        for name in CONTENDERS:
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
        for name, why in ASYNC_CONTENDERS.items():
            rows[name] = {"status": why}
        summary[scenario] = rows
    return summary


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print(summary: dict[str, Any]) -> None:
    head = (
        f"{'contender':<20} {'final acc':>9} {'vs sync':>8} {'to target':>9} {'s':>7} "
        f"{'bytes':>11} {'x fewer':>8} {'speedup':>8} {'total B':>11} {'peak/sync':>10}"
    )
    for scenario, rows in summary.items():
        print(f"\n== {scenario} ==\n{head}")
        for name, row in rows.items():
            if "status" in row:
                print(f"{name:<20} {row['status']}")
                continue
            print(
                f"{name:<20} {_fmt(row['final_val_acc'], '.4f'):>9} "
                f"{_fmt(row['final_vs_sync_points'], '+.2f'):>8} "
                f"{row['reached_target']:>9} {_fmt(row['time_to_target_s'], '.2f'):>7} "
                f"{_fmt(row['bytes_to_target'], ',.0f'):>11} "
                f"{_fmt(row['bytes_to_target_reduction'], '.1f'):>8} "
                f"{_fmt(row['time_to_target_speedup'], '.2f'):>8} "
                f"{_fmt(row['total_bytes'], ',.0f'):>11} {_fmt(row['peak_sync_bytes'], ',.0f'):>10}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="1 repeat, 10 epochs (smoke run)")
    parser.add_argument("--seed", type=int, default=0, help="shuffles the run order")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    repeats, epochs = (1, 10) if args.quick else (args.repeats, args.epochs)
    rng = random.Random(args.seed)
    order = []
    for _ in range(repeats):
        runs = [(s, c) for s in SCENARIOS for c in CONTENDERS]
        rng.shuffle(runs)
        order.append(runs)
    load_before = _load()
    t0 = time.perf_counter()
    records = spawn(_worker, WORLD, args=(order, epochs), timeout=3600, num_threads=1)[0]
    elapsed = time.perf_counter() - t0
    load_after = _load()
    summary = _summarize(records)
    _print(summary)
    print(f"\nload before: {load_before}\nload after:  {load_after}\n({elapsed:.0f} s)")
    result = {
        "benchmark": "diloco",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "load_before": load_before,
        "load_after": load_after,
        "elapsed_s": elapsed,
        "config": {
            "world": WORLD,
            "batch_per_replica": BATCH,
            "epochs": epochs,
            "repeats": repeats,
            "eval_every": EVAL_EVERY,
            "link": {"latency_ms": LINK.latency_ms, "mbps": LINK.mbps},
            "scenarios": {k: v for k, v in SCENARIOS.items()},
            "contenders": CONTENDERS,
            "target_fraction_of_sync_final": TARGET_FRACTION,
            "order": order,
        },
        "summary": summary,
        "runs": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
