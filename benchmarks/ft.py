"""Benchmark: fault-tolerant training on torchft -- goodput under faults, time to heal, overhead.

Four replica groups (one process each, around an in-process torchft lighthouse:
``distoptim.cli.faulttolerant``) train the command line's default model (the MLP 64 -> 128 -> 64
-> 10 on scikit-learn's digits, Adam lr 1e-3, batch 16 per replica) for a fixed number of
steps, each replica's steps paced to a fixed speed (``--step-ms``, default 20 ms: a machine of
fixed speed; on this 2-core machine a killed replica's core would otherwise speed up the
survivors and flatter the goodput). Contenders:

* ``sync`` -- ``CrossShardOptimizer(Adam, manager=...)``: a quorum and an all-reduce every step;
* ``diloco_h50`` -- ``DiLoCo(Adam, Nesterov SGD(lr 1.0, momentum 0.5), sync_every=50,
  manager=...)``: a quorum and a pseudo-gradient mean every 50 steps.

Figures:

* **goodput** -- useful samples per second (the samples of the steps whose work reached a
  committed model, see ``distoptim.cli.faulttolerant``) under ``--chaos`` (default
  ``kill:30``: one replica SIGKILLed every 30 s, round robin, restarted at once: a new process
  that imports torch, heals from a peer and joins), relative to the same contender's run without
  faults; the runs are interleaved (fault-free, faulty; then the next contender), and the final
  validation accuracy of both is recorded. Goals: DiLoCo H = 50 >= 95 %, sync >= 80 %, final
  accuracy within 1 point of the fault-free run.
* **time to heal** -- per restart: from the new replica's first quorum to its first committed
  contribution (goal <= 2 s); its process start and torch import (spawn to ready) separately.
* **nothing silently wrong** -- every commit of every run: the replicas that committed it logged
  bitwise-equal synchronised state (counted).
* **overhead without faults** -- the same contender without a manager (``distoptim.launch``
  gloo ranks, one process group) against with one (no faults), unpaced, interleaved and
  repeated: median step time, and what the quorum costs per step (sync) and per sync (DiLoCo).

Run::

    python benchmarks/ft.py            # 3-minute faulty runs: ~20 minutes on 2 cores
    python benchmarks/ft.py --quick    # a smoke run: 2 replicas, a few seconds of training

Writes ``benchmarks/results/ft.json`` (``--out``); a ``--quick`` run writes to
``benchmarks/results/quick/ft.json`` unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from distoptim.cli.algorithms import make_torch_optimizer
from distoptim.cli.datasets import Dataset, load_dataset
from distoptim.cli.faulttolerant import FaultTolerantSpec, replica_main, run_fault_tolerant
from distoptim.cli.model import build_model
from distoptim.ft.data import SlotShards
from distoptim.ft.local import Chaos, run_replicas
from distoptim.launch import spawn

RESULTS = Path(__file__).parent / "results" / "ft.json"
CONTENDERS = {"sync": {"algo": "sync"}, "diloco_h50": {"algo": "diloco", "sync_every": 50}}
GOALS = {"sync": 0.80, "diloco_h50": 0.95}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _goodput_pair(name: str, steps: int, replicas: int, chaos: Chaos, step_ms: float,
                  data: Dataset) -> dict[str, Any]:  # fmt: skip
    base = {"replicas": replicas, "steps": steps, "step_ms": step_ms, **CONTENDERS[name]}
    out: dict[str, Any] = {}
    for label, schedule in (("fault_free", None), ("faulty", chaos)):
        spec = FaultTolerantSpec(chaos=schedule, **base)
        began = time.perf_counter()
        record = run_fault_tolerant(spec, data).as_dict()
        record["elapsed_s"] = time.perf_counter() - began
        out[label] = record
        print(
            f"{name:<12} {label:<10} wall {record['wall_s']:7.1f} s  goodput "
            f"{record['goodput']:8.1f} samples/s  commits {record['commits']:5d}  recoveries "
            f"{record['recoveries']:3d}  acc {record['final_val_acc']:.4f}  equal "
            f"{record['states_equal']}",
            flush=True,
        )
    free, faulty = out["fault_free"], out["faulty"]
    heal = faulty["heal_s"]
    out["goodput_ratio"] = faulty["goodput"] / free["goodput"]
    out["accuracy_drop_points"] = 100 * (free["final_val_acc"] - faulty["final_val_acc"])
    out["heal_median_s"] = statistics.median(heal) if heal else None
    out["start_median_s"] = statistics.median(faulty["start_s"]) if faulty["start_s"] else None
    out["goal_goodput"] = GOALS[name]
    out["goodput_goal_met"] = out["goodput_ratio"] >= GOALS[name]
    out["heal_goal_met"] = out["heal_median_s"] is not None and out["heal_median_s"] <= 2.0
    out["accuracy_goal_met"] = out["accuracy_drop_points"] <= 1.0
    return out


# ---- overhead without faults: the same loop with and without a manager -------------------
def _plain_rank(rank: int, world: int, name: str, steps: int, data: Dataset) -> float:
    """One rank of the contender on a plain gloo group (no manager): its seconds per step
    after the first round."""
    import distoptim

    model = build_model(data.num_features, data.num_classes, 0, (128, 64))
    inner = make_torch_optimizer("adam", model.parameters(), 1e-3)
    if CONTENDERS[name]["algo"] == "sync":
        opt = distoptim.CrossShardOptimizer(inner)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5, nesterov=True)
        opt = distoptim.DiLoCo(inner, outer, sync_every=CONTENDERS[name]["sync_every"])
    shards = SlotShards(int(data.x_train.shape[0]), world, rank, 16)
    every = CONTENDERS[name].get("sync_every", 1)
    began = 0.0
    for step in range(steps):
        if step == every:  # steady state: after the first round (connections set up)
            began = time.perf_counter()
        idx = shards.batch(step)
        opt.zero_grad()
        F.cross_entropy(model(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    return (time.perf_counter() - began) / (steps - every)


def _overhead(name: str, replicas: int, steps: int, repeats: int, data: Dataset) -> dict[str, Any]:
    plain, managed = [], []
    for _ in range(repeats):  # interleaved: plain, managed, plain, managed, ...
        began = time.perf_counter()
        per_rank = spawn(_plain_rank, replicas, args=(name, steps, data), timeout=900)
        plain.append(max(per_rank))
        print(f"{name:<12} plain      {time.perf_counter() - began:6.1f} s", flush=True)
        spec = FaultTolerantSpec(replicas=replicas, steps=steps, **CONTENDERS[name])
        run = run_replicas(replica_main, replicas, args=(spec, data), timeout=900)
        commits = [(e["t"], e["n"]) for e in run.events if e["kind"] == "commit" and e["slot"] == 0]
        (t0, n0), (t1, n1) = commits[0], commits[-1]  # steady state: first to last commit
        every = CONTENDERS[name].get("sync_every", 1)
        managed.append((t1 - t0) / ((n1 - n0) * every))
        print(f"{name:<12} managed    commits {len(commits)}", flush=True)
    p, m = statistics.median(plain), statistics.median(managed)
    every = CONTENDERS[name].get("sync_every", 1)
    return {
        "plain_step_ms": 1000 * p,
        "managed_step_ms": 1000 * m,
        "ratio": m / p,
        "quorum_cost_ms_per_round": 1000 * (m - p) * every,
        "rounds_every_steps": every,
        "note": "seconds per step in steady state, unpaced, after the first round (connections "
        "set up): plain -- the slowest rank's loop from its first round's end; managed -- "
        "replica 0's first to last commit",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS}")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=180.0, help="length of a faulty run")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--chaos", default="kill:30")
    parser.add_argument("--repeats", type=int, default=2, help="of the overhead runs")
    args = parser.parse_args()
    if args.out is None:
        args.out = RESULTS.parent / "quick" / RESULTS.name if args.quick else RESULTS
    replicas = 2 if args.quick else args.replicas
    chaos = Chaos.parse("kill:4:0" if args.quick else args.chaos)
    steps = 300 if args.quick else int(args.seconds * 1000 / args.step_ms)
    overhead_steps = 100 if args.quick else 600
    repeats = 1 if args.quick else args.repeats
    torch.set_num_threads(1)
    data = load_dataset("digits")
    load_before = _load()
    t0 = time.perf_counter()
    goodput = {
        name: _goodput_pair(name, steps, replicas, chaos, args.step_ms, data) for name in CONTENDERS
    }
    overhead = {
        name: _overhead(name, replicas, overhead_steps, repeats, data) for name in CONTENDERS
    }
    result = {
        "benchmark": "ft",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "load_before": load_before,
        "load_after": _load(),
        "elapsed_s": time.perf_counter() - t0,
        "config": {
            "replicas": replicas,
            "steps": steps,
            "step_ms": args.step_ms,
            "chaos": str(chaos),
            "overhead_steps": overhead_steps,
            "repeats": repeats,
            "quick": args.quick,
        },
        "goodput": goodput,
        "overhead": overhead,
    }
    print()
    for name, g in goodput.items():
        print(
            f"{name:<12} goodput {100 * g['goodput_ratio']:5.1f} % "
            f"(goal {100 * g['goal_goodput']:.0f} %)  heal median {g['heal_median_s']} s  "
            f"start median {g['start_median_s']} s  "
            f"accuracy drop {g['accuracy_drop_points']:.2f} pt"
        )
    for name, o in overhead.items():
        print(
            f"{name:<12} step {o['plain_step_ms']:.2f} ms plain, {o['managed_step_ms']:.2f} ms "
            f"with a manager ({o['ratio']:.2f}x; {o['quorum_cost_ms_per_round']:.1f} ms per round)"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {args.out}  (load {load_before} -> {result['load_after']})")


if __name__ == "__main__":
    main()
