"""``--fault-tolerant``: the runs of a plan as torchft replica groups, their table and files.

Owns what ``distoptim compare --fault-tolerant [--chaos SPEC]`` (and ``train``) does instead of
the process pool: every run of the plan (``sync``, ``localsgd``, ``diloco``,
``streaming-diloco``) becomes a :class:`~distoptim.cli.faulttolerant.FaultTolerantSpec` --
``--workers`` replica groups of one process, the run's options, ``--epochs`` over each slot's
shard of the training set (``distoptim.ft.SlotShards``) -- and runs with
:func:`~distoptim.cli.faulttolerant.run_fault_tolerant`. With ``--chaos`` every run also runs
without faults first, the reference of its goodput. The table gives, per run: the wall time,
the rounds committed, the faults dealt, the rounds failed, recoveries (heals) and the median
time to heal, goodput (useful samples per second) and its ratio to the fault-free run, the
final validation accuracy, and whether every commit's committers held bitwise-equal state.
``results.json`` holds every record (``distoptim.cli.faulttolerant.FaultTolerantRecord``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from distoptim.cli import algorithms
from distoptim.cli.arguments import Plan
from distoptim.cli.faulttolerant import FaultTolerantRecord, FaultTolerantSpec, run_fault_tolerant
from distoptim.cli.runconfig import RunConfig
from distoptim.cli.stopping import exit_code, print_or_drop, signals_held

__all__ = ["run_fault_tolerant_plan", "spec_of"]

RESULTS_JSON = "results.json"


def spec_of(
    cfg: RunConfig, steps: int, chaos: Any, step_ms: float, spares: int = 0
) -> FaultTolerantSpec:
    """The fault-tolerant run of ``cfg`` (``steps`` per replica, ``spares`` warm spares)."""
    return FaultTolerantSpec(
        algo=cfg.algo,
        replicas=cfg.workers,
        steps=steps,
        batch_size=cfg.batch_size,
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        seed=cfg.seed,
        hidden=tuple(cfg.hidden),
        sync_every=cfg.communication_period,
        fragments=cfg.fragments,
        fragment_sync_delay=cfg.fragment_sync_delay,
        fragment_alpha=cfg.fragment_alpha,
        wire=cfg.wire,
        outer_lr=cfg.outer_lr,
        outer_momentum=cfg.outer_momentum,
        chaos=chaos,
        step_ms=step_ms,
        timeout=cfg.timeout,
        spares=spares,
    )


def _steps(cfg: RunConfig, num_train: int) -> int:
    """``--epochs`` of each replica slot's shard, in steps of ``--batch-size``."""
    per_slot = num_train // cfg.workers
    return max(1, int(cfg.epochs * max(1, per_slot // cfg.batch_size)))


def _row(label: str, rec: FaultTolerantRecord, free: FaultTolerantRecord | None) -> list[str]:
    heal = f"{statistics.median(rec.heal_s):.2f}" if rec.heal_s else "-"
    ratio = f"{100 * rec.goodput / free.goodput:.1f} %" if free is not None else "-"
    if rec.spec.get("chaos") and not rec.faults:
        ratio = "no fault dealt"  # a fault-free run is no evidence of surviving one
    acc = "-" if rec.final_val_acc is None else f"{rec.final_val_acc:.4f}"
    return [
        label,
        f"{rec.wall_s:.1f}",
        str(rec.commits),
        str(len(rec.faults)),
        str(rec.failed_rounds),
        str(rec.recoveries),
        heal,
        f"{rec.goodput:.0f}",
        ratio,
        acc,
        "yes" if rec.states_equal else f"NO ({rec.mismatched_commits})",
    ]


_HEAD = [
    "run",
    "wall s",
    "commits",
    "faults",
    "failed",
    "recoveries",
    "heal s",
    "goodput/s",
    "vs no faults",
    "val acc",
    "bitwise equal",
]


def _table(rows: Sequence[list[str]], stream: TextIO) -> None:
    widths = [max(len(r[i]) for r in [_HEAD, *rows]) for i in range(len(_HEAD))]
    for r in [_HEAD, *rows]:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        print_or_drop("  ".join(cells), stream)


def _write(plan: Plan, argv: Sequence[str], runs: list[dict[str, Any]], status: str) -> str:
    path = os.path.join(plan.out, RESULTS_JSON)
    os.makedirs(plan.out, exist_ok=True)
    ft = plan.fault_tolerant or {}
    meta = {
        "command": plan.command,
        "argv": list(argv),
        "status": status,
        "dataset": plan.data.describe(),
        "fault_tolerant": {
            "chaos": str(ft.get("chaos")),
            "step_ms": ft.get("step_ms"),
            "spares": ft.get("spares", 0),
        },
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    with signals_held(), open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "runs": runs}, f, indent=1, default=str)
    os.replace(path + ".tmp", path)
    return path


def run_fault_tolerant_plan(
    plan: Plan, argv: Sequence[str], stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    """Run every config of ``plan`` as torchft replica groups; print the table; exit code."""
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    ft = plan.fault_tolerant
    assert ft is not None
    data = plan.data.data  # a classification dataset (checked by the plan)
    num_train = int(data.x_train.shape[0])
    runs: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    failed, status = False, "complete"
    started = time.monotonic()
    try:
        for cfg in plan.configs:
            label = algorithms.label(cfg)
            steps = _steps(cfg, num_train)
            free = None
            schedules = [None, ft["chaos"]] if ft["chaos"] is not None else [None]
            for chaos in schedules:
                name = label if chaos is None else f"{label} {chaos.action}:{chaos.every:g}"
                groups = f"{cfg.workers} replica groups, {steps} steps"
                print_or_drop(f"distoptim: {name}: {groups}", stderr)
                try:
                    spec = spec_of(cfg, steps, chaos, ft["step_ms"], ft.get("spares", 0))
                    rec = run_fault_tolerant(spec, data)
                except Exception as exc:  # a run that failed is recorded; the others run
                    failed = True
                    print_or_drop(f"distoptim: run '{name}' failed: {exc}", stderr)
                    runs.append({"run": name, "error": f"{type(exc).__name__}: {exc}"})
                    continue
                free = rec if chaos is None else free
                if chaos is not None and not rec.faults:
                    print_or_drop(
                        f"distoptim: '{name}' ended ({rec.wall_s:.1f} s of training) before its "
                        f"first fault at {chaos.every:g} s: raise --epochs or lower the period",
                        stderr,
                    )
                rows.append(_row(name, rec, free if chaos is not None else None))
                runs.append({"run": name, **rec.as_dict()})
                _write(plan, argv, runs, "running")
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM, SIGHUP: keep what finished
        path = _write(plan, argv, runs, "interrupted")
        _table(rows, stdout)
        print_or_drop(f"results: {path}", stdout)
        print_or_drop("distoptim: interrupted; the runs so far are in the results above", stderr)
        return exit_code(exc)
    status = "failed" if failed else status
    path = _write(plan, argv, runs, status)
    _table(rows, stdout)
    print_or_drop(f"total {time.monotonic() - started:.0f} s", stdout)
    print_or_drop(f"results: {path}", stdout)
    return 1 if failed else 0
