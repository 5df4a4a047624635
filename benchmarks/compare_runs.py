"""Benchmark: how much of `distoptim compare`'s table is signal, over repeated runs?

The README shows the table of ``distoptim compare``. Its accuracies, commits and bytes repeat
run to run (the synchronous algorithms bit for bit); its time-based columns -- wall time, time
to target, temporal efficiency -- are wall-clock figures, and on a shared machine wall times
swing 2x between runs. This script runs the command several times and records the spread of
every column, so that the README's table says which differences are larger than the noise.

Each run is the command as a user types it, ``python -m distoptim.cli.main compare`` with the
defaults (or ``--dataset mnist5k``), in a fresh process, ``--progress none``, into a folder of
its own (``--quick``: the same entry point called once, in this process, with ``--repeats 2``:
its two repeats are the two runs, sparing each run an interpreter, its imports and its worker
processes). The runs of the datasets are interleaved (digits, mnist5k,
digits, ...), and each run takes the algorithms in its own shuffled order (seeded: ``--algos``
in a permutation), so a burst of load from other jobs, or the position of an algorithm in the
run, does not favour one algorithm; the machine's load average is recorded before and after
each run.

Why wall time with its spread, and not CPU time: what separates the algorithms in time is
waiting -- sync waits for the slowest rank at every step, DiLoCo at every sync, the parameter
server's workers never wait for each other -- and waiting costs wall time, not CPU time; a
CPU-time column would score sync's waiting as free. So the table keeps wall time, reports each
time as the median and the range over the runs, and adds the figures that do not depend on
the machine: samples processed until the target (all workers together), and the *paired* time
ratio to sync (this algorithm's time to target over sync's, within the same run: load that
lasts a run cancels).

The target. ``distoptim compare``'s default target is 0.95 x sync's final validation accuracy.
On mnist5k every algorithm reaches that within its first seconds, so the column cannot tell
them apart; the script therefore also reads each run's history at a ladder of absolute
targets and reports, per dataset, which target separates the algorithms best (the most pairs
of algorithms whose ranges of time to target do not overlap, among the targets every algorithm
reached in every run) -- the ``--target-acc`` to use for that dataset.

Run::

    python benchmarks/compare_runs.py           # 3 runs each of digits and mnist5k (~1 h on 2
                                                # shared cores)
    python benchmarks/compare_runs.py --quick   # 2 runs of sync and LocalSGD, 1 epoch (smoke):
                                                # one invocation, --repeats 2, in this process

Prints a Markdown table per dataset (the README's) and writes
``benchmarks/results/compare_runs.json`` (``--quick``: ``benchmarks/results/quick/``, never
over the shipped figures): the machine, every run's command, order, load and ``results.json``
(histories included), and the summary the tables are made of.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import Bench, load, machine

ALGOS = "sync,localsgd,diloco,streaming-diloco,agn,downpour,easgd,async-diloco"
TARGETS = (0.80, 0.85, 0.88, 0.90, 0.92, 0.93, 0.94, 0.95, 0.96, 0.97)
"""Absolute validation accuracies at which each run's history is read (the target ladder)."""


def _commit() -> str | None:
    """The checkout's commit, when this runs from a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def _names(results: dict[str, Any]) -> dict[str, str]:
    """Algorithm -> its name in the command's table (``Streaming DiLoCo F=2 int8``, ...)."""
    return {
        row["algorithm"]: row["title"] + (f" {row['detail']}" if row["detail"] else "")
        for row in results["summary"]
    }


def _in_a_fresh_process(cmd: list[str]) -> tuple[int, str]:
    """The command as a user types it, in a fresh process: (exit code, its stderr)."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stderr


def _in_this_process(cmd: list[str]) -> tuple[int, str]:
    """``--quick``: the same command through the same entry point
    (:func:`distoptim.cli.main.main`), in this process -- it saves an interpreter, torch and
    scikit-learn per run, seconds of CPU each, which a smoke run is mostly made of; its output
    is kept as a fresh process's would be (stderr for the failure message)."""
    from distoptim.cli.main import main as distoptim_main

    said = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said):
        code = distoptim_main(cmd[3:])  # after "python -m distoptim.cli.main"
    return code, said.getvalue()


def _compare(
    dataset: str,
    algos: list[str],
    extra: Sequence[str],
    out: Path,
    launch: Callable[[list[str]], tuple[int, str]] = _in_a_fresh_process,
) -> dict[str, Any]:
    """One ``distoptim compare`` (``launch``: in a fresh process unless told otherwise); what it
    wrote, and how the machine was."""
    cmd = [sys.executable, "-m", "distoptim.cli.main", "compare", "--algos", ",".join(algos)]
    cmd += ["--dataset", dataset, "--progress", "none", "--out", str(out), *extra]
    before = load()
    t0 = time.monotonic()
    code, stderr = launch(cmd)
    took = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}):\n{stderr[-3000:]}")
    doc = json.loads((out / "results.json").read_text())
    return {
        "command": cmd[2:],
        "order": algos,
        "seconds": round(took, 1),
        "load_before": before,
        "load_after": load(),
        "results": doc,
    }


def _per_repeat(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One record per repeat of an invocation (``--quick``'s ``--repeats``): the same
    command, order, time and load, its ``results.json`` holding that repeat's rows only. An
    invocation without repeats is returned as it is."""
    rows = run["results"]["runs"]
    repeats = sorted({r["config"].get("repeat", 0) for r in rows})
    if len(repeats) == 1:
        return [run]
    return [
        {
            **run,
            "repeat": k,
            "results": {**run["results"], "runs": [r for r in rows if r["config"]["repeat"] == k]},
        }
        for k in repeats
    ]


def _first(history: list[dict[str, Any]], target: float, key: str) -> float | None:
    """``key`` (``t`` or ``samples``) at the first evaluation at or above ``target``."""
    return next((p[key] for p in history if p["val_acc"] >= target), None)


def _spread(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per algorithm: the spread of every column over the runs, paired ratios to sync, and the
    time and samples to each target of the ladder."""
    per: dict[str, dict[str, list[Any]]] = {}
    for run in runs:
        rows = run["results"]["runs"]
        names = _names(run["results"])
        sync = next((r for r in rows if r["config"]["algo"] == "sync"), None)
        for r in rows:
            cols = per.setdefault(names[r["config"]["algo"]], {})
            for key in (
                "val_acc",
                "train_acc",
                "wall_time_s",
                "communications",
                "bytes_moved",
                "time_to_target_s",
                "bytes_to_target",
                "temporal_efficiency",
                "target_acc",
            ):
                if r.get(key) is not None:
                    cols.setdefault(key, []).append(r[key])
            samples = _first(r["history"], r["target_acc"], "samples") if r["target_acc"] else None
            if samples is not None:
                cols.setdefault("samples_to_target", []).append(samples)
            if sync is not None and r["time_to_target_s"] and sync["time_to_target_s"]:
                ratio = r["time_to_target_s"] / sync["time_to_target_s"]
                cols.setdefault("time_to_target_vs_sync", []).append(ratio)
            for target in TARGETS:
                cols.setdefault(f"t@{target}", []).append(_first(r["history"], target, "t"))
    summary: dict[str, Any] = {}
    for label, cols in per.items():
        row = {k: _spread(v) for k, v in cols.items() if not k.startswith("t@")}
        row["time_at_target"] = {
            f"{t:g}": cols[f"t@{t}"]
            for t in TARGETS  # per run; None: not reached
        }
        summary[label] = row
    return summary


def _separation(summary: dict[str, Any]) -> dict[str, Any]:
    """For each target of the ladder that every algorithm reached in every run: how many
    pairs of algorithms have ranges of time to target that do not overlap; the best one."""
    labels = sorted(summary)
    pairs = [(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :]]
    ladder = {}
    for target in TARGETS:
        times = {k: summary[k]["time_at_target"][f"{target:g}"] for k in labels}
        if any(t is None for ts in times.values() for t in ts):
            continue  # some run of some algorithm never reached it
        apart = sum(
            1 for a, b in pairs if max(times[a]) < min(times[b]) or max(times[b]) < min(times[a])
        )
        ladder[f"{target:g}"] = {"pairs_apart": apart, "pairs": len(pairs)}
    best = max(ladder, key=lambda t: (ladder[t]["pairs_apart"], float(t)), default=None)
    return {"ladder": ladder, "best_target": None if best is None else float(best)}


def _range(s: dict[str, Any] | None, fmt: str, scale: float = 1.0) -> str:
    if s is None:
        return "-"
    mid, lo, hi = (fmt.format(s[k] * scale) for k in ("median", "min", "max"))
    return mid if lo == hi else f"{mid} ({lo} to {hi})"


def _mb(s: dict[str, Any] | None) -> str:
    return _range(s, "{:.1f}", 1e-6) + (" MB" if s else "")


def table(summary: dict[str, Any], order: Sequence[str]) -> str:
    """The README's table: median (min to max) over the runs of each column."""
    head = (
        "| algorithm | val acc | bytes moved | wall time (s) | time to target (s) "
        "| vs sync (paired) | samples to target | bytes to target | temporal eff. |"
    )
    lines = [head, "|---|" + "--:|" * 8]
    for label in order:
        row = summary[label]
        cells = [
            label,
            _range(row.get("val_acc"), "{:.1f}%", 100),
            _mb(row.get("bytes_moved")),
            _range(row.get("wall_time_s"), "{:.1f}"),
            _range(row.get("time_to_target_s"), "{:.1f}"),
            _range(row.get("time_to_target_vs_sync"), "{:.2f}"),
            _range(row.get("samples_to_target"), "{:,.0f}"),
            _mb(row.get("bytes_to_target")),
            _range(row.get("temporal_efficiency"), "{:.2f}"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _order(runs: list[dict[str, Any]]) -> list[str]:
    """The rows in the command's own order (sync first), whatever order the runs took."""
    names = _names(runs[0]["results"])
    rank = {a: i for i, a in enumerate(ALGOS.split(","))}
    return [names[a] for a in sorted(names, key=lambda a: rank.get(a, len(rank)))]


def main(argv: Sequence[str] | None = None) -> int:
    bench = Bench(__file__, __doc__, quick="2 runs of sync,localsgd on digits")
    parser = bench.parser
    parser.add_argument("--runs", type=int, default=3, help="runs per dataset (default 3)")
    parser.add_argument("--datasets", default="digits,mnist5k")
    parser.add_argument("--seed", type=int, default=0, help="seeds the algorithms' orders")
    args = bench.parse(argv)
    algos, extra, datasets, runs = ALGOS.split(","), [], args.datasets.split(","), args.runs
    launch, invocations = _in_a_fresh_process, runs
    if args.quick:  # both runs from one invocation (--repeats), in this process
        algos, extra, datasets, runs = ["sync", "localsgd"], ["--workers", "2"], ["digits"], 2
        extra += ["--epochs", "1", "--eval-points", "5", "--repeats", str(runs)]
        launch, invocations = _in_this_process, 1
    rng = random.Random(args.seed)
    recorded: dict[str, list[dict[str, Any]]] = {d: [] for d in datasets}
    with tempfile.TemporaryDirectory(prefix="compare-runs-") as tmp:
        for k in range(invocations):
            for dataset in datasets:
                order = rng.sample(algos, len(algos))
                folder = Path(tmp) / f"{dataset}-{k}"
                print(f"run {k + 1}/{invocations} {dataset}: {','.join(order)}", flush=True)
                run = _compare(dataset, order, extra, folder, launch)
                print(
                    f"  {run['seconds']:.0f} s, load {run['load_before']} -> {run['load_after']}",
                    flush=True,
                )
                recorded[dataset] += _per_repeat(run)
    doc: dict[str, Any] = {
        "machine": machine(),
        "commit": _commit(),
        "settings": {"runs": runs, "algos": algos, "extra": extra, "targets": list(TARGETS)},
        "datasets": {},
    }
    for dataset, dataset_runs in recorded.items():
        summary = _summary(dataset_runs)
        order = _order(dataset_runs)
        doc["datasets"][dataset] = {
            "summary": summary,
            "order": order,
            "separation": _separation(summary),
            "table": table(summary, order),
            "runs": dataset_runs,
        }
        sep = doc["datasets"][dataset]["separation"]
        print(f"\n{dataset}: {runs} runs (median, range)\n")
        print(doc["datasets"][dataset]["table"])
        print(f"\nbest separating target: {sep['best_target']} ({sep['ladder']})")
    bench.save(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
