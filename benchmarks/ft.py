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
  that imports torch, heals from a peer and joins; with ``--spares N``, a warm spare -- a
  process already started, imported and waiting -- takes the slot at once), relative to the
  same contender's run without faults. Per contender, one faulty run per number of spares
  (default 0 and 1) with the fault-free run in their middle (spares 0, fault-free, spares 1;
  then the next contender), so each ratio pairs runs close in time; every run records the load
  average at its start and end, and the final validation accuracy. Goals: without a spare
  DiLoCo H = 50 >= 95 %, sync >= 80 %; with one, DiLoCo >= 97 %, sync >= 90 %; final accuracy
  within 1 point of the fault-free run.
* **time to heal** -- per restart: from the new replica's first quorum to its first committed
  contribution (goal <= 2 s); its process start and torch import (spawn to ready) separately;
  **time away** -- from the kill to the slot's first contributing commit, and per restart where
  it went (``restarts``: kill to start, start to ready, ready to first quorum, heal).
* **nothing silently wrong** -- every commit of every run: the replicas that committed it logged
  bitwise-equal synchronised state (counted).
* **overhead without faults** -- the same contender without a manager (``distoptim.launch``
  gloo ranks, one process group) against with one (no faults), unpaced, interleaved and
  repeated: median step time, and what the quorum costs per step (sync) and per sync (DiLoCo).
* **per step against torchft's own** (``vs_torchft``) -- two replica groups, each process
  holding all four contenders (one lighthouse each, so their quorums never mix), the same
  model (an MLP 512 -> 1024 -> 1024 -> 512, 2.1M parameters, AdamW lr 1e-3, batch 32, MSE),
  the same manager settings (timeouts; ``init_sync=False`` with identically seeded models;
  the asynchronous quorum for the sync pair, the synchronous one torchft's DiLoCo requires for
  the DiLoCo pair): ``CrossShardOptimizer(manager=, gradient_as_bucket_view=True)`` against
  torchft's ``ddp.DistributedDataParallel`` + ``optim.OptimizerWrapper``, and
  ``DiLoCo(manager=, sync_every=20)`` (Nesterov SGD outer) against torchft's
  ``local_sgd.DiLoCo``. Blocks interleave the contenders (the order alternates per block); a
  sync block times 20 steps after one untimed step (which absorbs the groups' skew), a DiLoCo
  block the 20 steps from the end of one sync to the end of the next; each block's time is the
  slower group's, and the paired ratio is per block (goal <= 0.95); beside it, the CPU time per
  step of both groups' processes (all their threads; what a loaded machine disturbs least). The
  state check's cost is timed apart, on the same tensors, after every block: a slice (what a
  clean round checks: a CrossShard step, a DiLoCo sync, paid once per 20 steps), the whole
  state (what a round after a heal or a membership change checks), and the CRC-32 of a host
  copy this project used before; its share of a step (goal <= 1 %), and the checks' CPU time
  inside the timed steps. ``--profile NAME`` adds a cProfile of one contender's timed steps.

Run::

    python benchmarks/ft.py                    # everything: ~25 minutes on 2 cores
    python benchmarks/ft.py --only vs-torchft  # the per-step comparison: a few minutes
    python benchmarks/ft.py --quick            # a smoke run of the per-step comparison (a
                                               # tiny model; --only goodput --quick: goodput,
                                               # sync only, one fault, one spare)
    python benchmarks/ft.py --only goodput --no-overhead --spares 0 1   # goodput alone

Writes ``benchmarks/results/ft.json`` (``--out``; ``--only vs-torchft``:
``benchmarks/results/ft_vs_torchft.json``); a ``--quick`` run writes to
``benchmarks/results/quick/`` unless told otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import itertools
import json
import os
import platform
import resource
import statistics
import time
import zlib
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
GOALS = {"sync": (0.80, 0.90), "diloco_h50": (0.95, 0.97)}
"""Goodput goals (ratio to the fault-free run): without a spare, with one or more."""


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _goodput_run(name: str, label: str, spec: FaultTolerantSpec, data: Dataset) -> dict[str, Any]:
    """One run of a contender: its record, wall time and the load average around it."""
    load_before, began = _load(), time.perf_counter()
    record = run_fault_tolerant(spec, data).as_dict()
    record["elapsed_s"] = time.perf_counter() - began
    record["load_before"], record["load_after"] = load_before, _load()
    away, beats = record["away_s"], record["heartbeats"]
    print(
        f"{name:<12} {label:<10} wall {record['wall_s']:7.1f} s  goodput "
        f"{record['goodput']:8.1f} samples/s  commits {record['commits']:5d}  recoveries "
        f"{record['recoveries']:3d}  away median "
        f"{statistics.median(away) if away else float('nan'):.2f} s  acc "
        f"{record['final_val_acc']:.4f}  equal {record['states_equal']}  longest live "
        f"heartbeat silence {beats.get('longest_s', float('nan')):.2f} s (<= "
        f"{beats.get('bound_s', float('nan')):.2f})  load {load_before} -> {record['load_after']}",
        flush=True,
    )
    return record


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _goodput(name: str, steps: int, replicas: int, chaos: Chaos, step_ms: float,
             spares: list[int], heartbeat_timeout: float,
             data: Dataset) -> dict[str, Any]:  # fmt: skip
    """The contender without faults and under ``chaos`` with each number of warm spares,
    interleaved: the fault-free run sits in the middle of the faulty ones, so each ratio pairs
    runs close in time."""
    base = {"replicas": replicas, "steps": steps, "step_ms": step_ms, **CONTENDERS[name]}
    base["heartbeat_timeout"] = heartbeat_timeout
    order: list[int | None] = list(spares)
    order.insert(len(order) // 2, None)  # None: the fault-free run
    runs: dict[int | None, dict[str, Any]] = {}
    for n in order:
        spec = FaultTolerantSpec(chaos=None if n is None else chaos, spares=n or 0, **base)
        runs[n] = _goodput_run(name, "fault_free" if n is None else f"spares={n}", spec, data)
    free = runs[None]
    out: dict[str, Any] = {"order": ["fault_free" if n is None else n for n in order]}
    out["fault_free"] = free
    out["spares"] = {}
    for n in spares:
        faulty = runs[n]
        goal = GOALS[name][min(n, 1)]
        heal, away = _median(faulty["heal_s"]), _median(faulty["away_s"])
        row = {
            "run": faulty,
            "goodput_ratio": faulty["goodput"] / free["goodput"],
            "accuracy_drop_points": 100 * (free["final_val_acc"] - faulty["final_val_acc"]),
            "heal_median_s": heal,
            "heal_max_s": max(faulty["heal_s"], default=None),
            "away_median_s": away,
            "start_median_s": _median(faulty["start_s"]),
            "goal_goodput": goal,
        }
        row["goodput_goal_met"] = row["goodput_ratio"] >= goal
        row["heal_goal_met"] = heal is not None and heal <= 2.0
        row["accuracy_goal_met"] = row["accuracy_drop_points"] <= 1.0
        out["spares"][str(n)] = row
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


# ---- per step against torchft's own wrappers, interleaved in one run ------------------------
PAIRS = {
    "sync": ("distoptim_sync", "torchft_ddp"),
    "diloco": ("distoptim_diloco", "torchft_diloco"),
}
"""Each pair: distoptim's contender, torchft's."""


def _mlp(widths: tuple[int, ...]) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


class _Contender:
    """One contender in a replica process: its model, optimizer and manager, stepped on demand."""

    def __init__(self, name: str, ctx: Any, lighthouse: str, cfg: dict[str, Any]) -> None:
        from torchft import ddp as ft_ddp
        from torchft import local_sgd as ft_local_sgd
        from torchft import optim as ft_optim

        import distoptim
        from distoptim.ft.replica import make_manager

        self.name = name
        self.model = _mlp(tuple(cfg["widths"]))
        self.inner = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.step_fn: Any = None
        self.steps = 0

        def state() -> dict[str, Any]:
            return copy.deepcopy({"model": self.model.state_dict(), "opt": self.inner.state_dict()})

        def load(saved: dict[str, Any]) -> None:
            self.model.load_state_dict(saved["model"])
            self.inner.load_state_dict(saved["opt"])

        diloco = "diloco" in name
        self.manager = make_manager(
            lighthouse,
            replica_id=ctx.replica_id,
            state_dict=state,
            load_state_dict=load,
            timeout=30,
            quorum_timeout=60,
            connect_timeout=30,
            use_async_quorum=not diloco,  # torchft's DiLoCo requires a synchronous quorum
            init_sync=False,  # identical seeded models on every replica group
        )
        self._exit: Any = None
        if name == "distoptim_sync":
            self.opt = distoptim.CrossShardOptimizer(
                self.inner, manager=self.manager, **cfg["sync_options"]
            )
            self.forward = self.model
        elif name == "torchft_ddp":
            self.forward = ft_ddp.DistributedDataParallel(self.manager, self.model)
            self.opt = ft_optim.OptimizerWrapper(self.manager, self.inner)
        elif name == "distoptim_diloco":
            outer = torch.optim.SGD(self.model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            self.opt = distoptim.DiLoCo(
                self.inner, outer, sync_every=cfg["sync_every"], manager=self.manager
            )
            self.forward = self.model
        else:
            outer = torch.optim.SGD(self.model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            self._diloco = ft_local_sgd.DiLoCo(
                self.manager,
                [self.model],
                self.inner,
                outer,
                sync_every=cfg["sync_every"],
                backup_device=torch.device("cpu"),
                pin_memory=False,
            )
            self._exit = self._diloco.__exit__
            self._diloco.__enter__()
            self.opt = self.inner
            self.forward = self.model
        g = torch.Generator().manual_seed(1000 + ctx.slot)
        batch, width = cfg["batch"], cfg["widths"][0]
        self.x = torch.randn(4, batch, width, generator=g)
        self.y = torch.randn(4, batch, cfg["widths"][-1], generator=g)

    def step(self) -> None:
        i = self.steps % 4
        self.opt.zero_grad()
        loss = F.mse_loss(self.forward(self.x[i]), self.y[i])
        loss.backward()
        self.opt.step()
        self.steps += 1

    def synced_state(self) -> list[torch.Tensor]:
        """What this contender's state check reads (distoptim's): for the timing of the check."""
        if self.name == "distoptim_diloco":
            params = [p for g in self.opt.outer.param_groups for p in g["params"]]
            outer_state = [self.opt.outer.state.get(p, {}) for p in params]
            tensors = list(self.opt.global_parameters)
            for st in outer_state:
                tensors += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
            return tensors
        return list(self.model.parameters())

    def close(self) -> None:
        if self._exit is not None:
            self._exit(None, None, None)
        self.manager.shutdown(wait=False)


def _old_checksum(tensors: list[torch.Tensor]) -> int:
    """The check this project used before: CRC-32 and Adler-32 of a host copy of the bytes."""
    crc, adler = 0, 1
    for t in tensors:
        data = memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy())
        crc, adler = zlib.crc32(data, crc), zlib.adler32(data, adler)
    return crc << 32 | adler


def _time_check(tensors: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """Milliseconds of the state check, as a managed round runs it: a slice, the whole, the old."""
    from distoptim.comm.checksum import state_checksum, state_slices

    parts = state_slices(tensors)
    out: dict[str, list[float]] = {}
    for r in range(repeats):
        for key, fn in (
            ("slice", lambda r=r: state_checksum(tensors, r % parts, parts)),
            ("whole", lambda: state_checksum(tensors)),
            ("old_crc", lambda: _old_checksum(tensors)),
        ):
            began, cpu = time.perf_counter(), time.thread_time()  # this thread's CPU only
            fn()
            out.setdefault(f"{key}_ms", []).append(1000 * (time.perf_counter() - began))
            out.setdefault(f"{key}_cpu_ms", []).append(1000 * (time.thread_time() - cpu))
    return {**{k: statistics.median(v) for k, v in out.items()}, "slices": parts}


def _instrument_checks() -> dict[str, Any]:
    """Time every state check the managed optimizers run inside the timed steps (this thread's
    CPU seconds, summed into ``state["sum"]`` while ``state["on"]``)."""
    from distoptim.outer import managed
    from distoptim.sync import replicated

    state: dict[str, Any] = {"on": False}
    original = replicated.state_checksum

    def timed(*args: Any, **kwargs: Any) -> int:
        cpu = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            if state["on"]:
                state["sum"] = state.get("sum", 0.0) + time.thread_time() - cpu

    replicated.state_checksum = timed  # type: ignore[assignment]
    managed.state_checksum = timed  # type: ignore[attr-defined]
    return state


def _vs_torchft_replica(ctx: Any, cfg: dict[str, Any], lighthouses: dict[str, str]) -> Any:
    """One replica group's process: every contender, stepped in interleaved timed blocks."""
    torch.set_num_threads(1)
    contenders = {name: _Contender(name, ctx, lighthouses[name], cfg) for name in lighthouses}
    ctx.wait_for_peers(300)
    every = cfg["sync_every"]
    in_step = _instrument_checks()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu_times: dict[str, list[float]] = {name: [] for name in contenders}  # this process's
    checks: dict[str, list[dict[str, float]]] = {name: [] for name in PAIRS}
    profile = cfg.get("profile")
    profiler = None
    if profile and ctx.slot == 0:
        import cProfile

        profiler = cProfile.Profile()
    for block in range(cfg["blocks"]):
        for pair, (ours, theirs) in PAIRS.items():
            order = (ours, theirs) if block % 2 == 0 else (theirs, ours)
            for name in order:
                c = contenders[name]
                step = c.step
                if profiler is not None and name == profile:
                    step = functools.partial(profiler.runcall, c.step)
                if pair == "sync":  # the first step absorbs the groups' skew; time the rest
                    c.step()
                    timed = cfg["sync_steps"]
                else:  # from the end of one sync to the end of the next: `every` steps
                    for _ in range(every):
                        c.step()
                    timed = every
                in_step["on"] = True
                began, cpu = time.perf_counter(), time.process_time()
                for _ in range(timed):
                    step()
                times[name].append((time.perf_counter() - began) / timed)
                cpu_times[name].append((time.process_time() - cpu) / timed)
                in_step["on"] = False
                if name == ours:
                    in_step.setdefault(name, []).append(in_step.pop("sum", 0.0) / timed)
                in_step.pop("sum", None)
            checks[pair].append(_time_check(contenders[ours].synced_state(), 3))
    for c in contenders.values():
        c.close()
    result: dict[str, Any] = {"times": times, "cpu_times": cpu_times, "checks": checks}
    result["in_step_check_s"] = {k: in_step.get(k, []) for k in contenders}
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        result["profile"] = text.getvalue()
    return result


def _vs_torchft(cfg: dict[str, Any]) -> dict[str, Any]:
    from distoptim.ft.lighthouse import Lighthouse

    with contextlib.ExitStack() as stack:  # one lighthouse per contender: quorums never mix
        houses = {
            name: stack.enter_context(Lighthouse(2, join_timeout=5.0)).address
            for pair in PAIRS.values()
            for name in pair
        }
        load_before = _load()
        began = time.perf_counter()
        run = run_replicas(_vs_torchft_replica, 2, args=(cfg, houses), min_replicas=2, timeout=1800)
        elapsed = time.perf_counter() - began
    out: dict[str, Any] = {
        "config": cfg,
        "load_before": load_before,
        "load_after": _load(),
        "elapsed_s": elapsed,
    }
    per_block = {  # the slower replica group's time per step, per block
        name: [max(v["times"][name][b] for v in run.values) for b in range(cfg["blocks"])]
        for name in houses
    }
    cpu_per_block = {  # CPU time per step (all threads of the process), summed over groups
        name: [sum(v["cpu_times"][name][b] for v in run.values) for b in range(cfg["blocks"])]
        for name in houses
    }
    for pair, (ours, theirs) in PAIRS.items():
        ratios = [a / b for a, b in zip(per_block[ours], per_block[theirs])]
        cpu_ratios = [a / b for a, b in zip(cpu_per_block[ours], cpu_per_block[theirs])]
        step_ms = 1000 * statistics.median(per_block[ours])
        checks = [c for v in run.values for c in v["checks"][pair]]
        check = {k: statistics.median(c[k] for c in checks) for k in checks[0]}
        rounds_per_step = 1.0 if pair == "sync" else 1.0 / cfg["sync_every"]
        # a clean round (a CrossShard step, a DiLoCo sync) checks a slice of its state
        per_round = check["slice_ms"]
        check_per_step = per_round * rounds_per_step
        cpu_step = statistics.median(cpu_per_block[ours]) / 2  # one group's process
        # what the checks inside the timed steps cost (this thread's CPU), per step
        in_step = [x for v in run.values for x in v["in_step_check_s"][ours]]
        in_step_ms = 1000 * statistics.median(in_step)
        out[pair] = {
            "ours": ours,
            "theirs": theirs,
            "ours_step_ms": step_ms,
            "theirs_step_ms": 1000 * statistics.median(per_block[theirs]),
            "paired_ratios": ratios,
            "ratio_median": statistics.median(ratios),
            "cpu_ms_per_step": {
                k: 1000 * statistics.median(cpu_per_block[k]) for k in (ours, theirs)
            },
            "cpu_paired_ratios": cpu_ratios,
            "cpu_ratio_median": statistics.median(cpu_ratios),
            "goal_ratio": 0.95,
            "goal_met": statistics.median(ratios) <= 0.95,
            "check": check,
            "check_ms_per_step": check_per_step,
            "check_share_of_step": check_per_step / step_ms,
            "check_goal_met": check_per_step / step_ms <= 0.01,
            "in_step_check_cpu_ms_per_step": in_step_ms,
            "in_step_check_cpu_share": in_step_ms / (1000 * cpu_step),
            "old_crc_ms_per_step": check["old_crc_ms"] * rounds_per_step,
        }
    if run.values[0].get("profile"):
        out["profile"] = run.values[0]["profile"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS}")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=180.0, help="length of a faulty run")
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--chaos", default="kill:30")
    parser.add_argument("--repeats", type=int, default=2, help="of the overhead runs")
    parser.add_argument(
        "--spares",
        type=int,
        nargs="+",
        default=None,
        help="warm spares of the goodput's faulty runs, one run each (default 0 1; --quick: 1)",
    )
    parser.add_argument(
        "--contenders",
        nargs="+",
        choices=list(CONTENDERS),
        default=None,
        help="goodput: these contenders only (default both; --quick: sync)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=1.0,
        help="the lighthouse's (s): how long a killed group still counts, which a spare waits "
        "(default 1)",
    )
    parser.add_argument(
        "--no-overhead", action="store_true", help="goodput: leave out the overhead runs"
    )
    parser.add_argument(
        "--only",
        choices=("all", "goodput", "vs-torchft"),
        default="all",
        help="vs-torchft: only the per-step comparison with torchft's own wrappers",
    )
    parser.add_argument("--blocks", type=int, default=8, help="interleaved blocks per contender")
    parser.add_argument(
        "--profile",
        choices=[name for pair in PAIRS.values() for name in pair],
        default=None,
        help="cProfile this contender's timed steps on replica 0 (printed, and in the JSON)",
    )
    args = parser.parse_args()
    if args.quick and args.only == "all":  # a quick run: the per-step comparison alone
        args.only = "vs-torchft"  # (every process imports torch: ~3 s of CPU each)
    if args.out is None:
        name = "ft_vs_torchft.json" if args.only == "vs-torchft" else RESULTS.name
        args.out = RESULTS.parent / "quick" / name if args.quick else RESULTS.parent / name
    replicas = 2 if args.quick else args.replicas
    chaos = Chaos.parse("kill:60:0" if args.quick else args.chaos)  # quick: one fault (by_step)
    steps = 300 if args.quick else int(args.seconds * 1000 / args.step_ms)
    overhead_steps = 100 if args.quick else 600
    repeats = 1 if args.quick else args.repeats
    names = args.contenders or (["sync"] if args.quick else list(CONTENDERS))  # quick: cheap
    spares = args.spares if args.spares is not None else [1] if args.quick else [0, 1]
    for n in spares:
        if n < 0:
            parser.error(f"--spares takes numbers of spares >= 0, got {n}")
    overhead_on = not (args.quick or args.no_overhead)
    vs_cfg = {
        "widths": [64, 128, 64] if args.quick else [512, 1024, 1024, 512],
        "batch": 32,
        "sync_every": 4 if args.quick else 20,
        "sync_steps": 4 if args.quick else 20,
        "blocks": 1 if args.quick else args.blocks,
        "sync_options": {"gradient_as_bucket_view": True},
        "profile": args.profile,
    }
    torch.set_num_threads(1)
    data = load_dataset("digits")
    load_before = _load()
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "ft",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "load_before": load_before,
        "config": {
            "replicas": replicas,
            "steps": steps,
            "step_ms": args.step_ms,
            "chaos": str(chaos),
            "overhead_steps": overhead_steps,
            "repeats": repeats,
            "spares": spares,
            "heartbeat_timeout": args.heartbeat_timeout,
            "overhead": overhead_on,
            "quick": args.quick,
            "only": args.only,
        },
    }
    if args.only in ("all", "vs-torchft"):
        vs = result["vs_torchft"] = _vs_torchft(vs_cfg)
        for pair in PAIRS:
            v = vs[pair]
            print(
                f"{v['ours']:<17} {v['ours_step_ms']:7.2f} ms/step vs {v['theirs']:<15} "
                f"{v['theirs_step_ms']:7.2f} ms: paired ratio {v['ratio_median']:.3f} (goal "
                f"<= 0.95; blocks {' '.join(f'{r:.2f}' for r in v['paired_ratios'])})",
                flush=True,
            )
            print(
                f"{'':<17} CPU per step (both groups) {v['cpu_ms_per_step'][v['ours']]:.2f} vs "
                f"{v['cpu_ms_per_step'][v['theirs']]:.2f} ms: paired ratio "
                f"{v['cpu_ratio_median']:.3f} (blocks "
                f"{' '.join(f'{r:.2f}' for r in v['cpu_paired_ratios'])})",
                flush=True,
            )
            c = v["check"]
            print(
                f"{'':<17} state check {v['check_ms_per_step']:.3f} ms/step = "
                f"{100 * v['check_share_of_step']:.2f} % of a step, "
                f"inside the steps {v['in_step_check_cpu_ms_per_step']:.3f} ms CPU/step = "
                f"{100 * v['in_step_check_cpu_share']:.2f} % of a step's CPU "
                f"(slice {c['slice_ms']:.2f} ms "
                f"of {c['slices']:.0f}, whole {c['whole_ms']:.2f} ms, the old CRC "
                f"{c['old_crc_ms']:.2f} ms)",
                flush=True,
            )
        if "profile" in vs:
            print(vs["profile"])
    if args.only in ("all", "goodput"):
        goodput = {
            name: _goodput(
                name, steps, replicas, chaos, args.step_ms, spares, args.heartbeat_timeout, data
            )
            for name in names
        }
        result["goodput"] = goodput
        if overhead_on:
            result["overhead"] = {
                name: _overhead(name, replicas, overhead_steps, repeats, data) for name in names
            }
        print()
        for name, g in goodput.items():
            for n, row in g["spares"].items():
                print(
                    f"{name:<12} spares={n} goodput {100 * row['goodput_ratio']:5.1f} % "
                    f"(goal {100 * row['goal_goodput']:.0f} %)  heal median "
                    f"{_fmt(row['heal_median_s'])} s (max {_fmt(row['heal_max_s'])})  away "
                    f"median {_fmt(row['away_median_s'])} s  start median "
                    f"{_fmt(row['start_median_s'])} s  accuracy drop "
                    f"{row['accuracy_drop_points']:.2f} pt"
                )
        for name, o in result.get("overhead", {}).items():
            print(
                f"{name:<12} step {o['plain_step_ms']:.2f} ms plain, {o['managed_step_ms']:.2f} "
                f"ms with a manager ({o['ratio']:.2f}x; {o['quorum_cost_ms_per_round']:.1f} ms "
                "per round)"
            )
    result["load_after"] = _load()
    result["elapsed_s"] = time.perf_counter() - t0
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    result["cpu_s"] = sum(u.ru_utime + u.ru_stime for u in usage)  # every process, reaped
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(
        f"wrote {args.out}  (load {load_before} -> {result['load_after']}; "
        f"{result['elapsed_s']:.0f} s, {result['cpu_s']:.1f} s of CPU in all processes)"
    )


if __name__ == "__main__":
    main()
