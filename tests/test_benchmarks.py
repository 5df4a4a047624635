"""benchmarks/: every script's ``--quick`` run succeeds and writes the JSON its figures come from.

A refactor that breaks a benchmark fails here, not at the next measurement. Each script runs in
a subprocess as a user runs it (``python benchmarks/NAME.py --quick --out FILE``, this
checkout's ``src`` first on the path), bounded by a timeout, writing into ``tmp_path`` (never
over the shipped ``benchmarks/results/``); the test then reads the JSON and checks the parts
each script's figures come from, not only the exit code, and the ending every script shares
(``benchmarks/_common.py``: the command line and the load before and after). Every script in
``benchmarks/`` (but the ``_``-prefixed helpers) must have an entry in :data:`CHECKS`.
The GPU scripts' ``--quick`` runs a tiny configuration on the CPU where there is no CUDA device;
their real runs still refuse without one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT_S = 240
"""A backstop for a hung run; a quick run takes seconds on a quiet 2-core machine (minutes
when the machine is loaded many times over: process start-up dominates)."""


def _run(script: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and x > 0


def _cross_shard(r: dict[str, Any]) -> None:
    assert {"cases", "bandwidth", "ratios", "machine", "settings"} <= r.keys()
    assert r["cases"] and r["ratios"].keys() == {*r["cases"], "bandwidth"}
    for case in r["cases"].values():
        methods = case["methods"]
        assert {"local", "cross_shard", "cross_shard_views_overlap", "ddp", "naive"} <= set(methods)
        assert all(_positive(m["median_s"]) for m in methods.values())
        assert _positive(case["paired_ratios"]["cross_shard_vs_ddp"])
    assert _positive(r["bandwidth"]["single_all_reduce"]["GB_per_s"])
    assert _positive(r["bandwidth"]["bucketed_cap25mb_views_words"]["GB_per_s"])


def _zero(r: dict[str, Any]) -> None:
    assert {"cases", "machine", "settings"} <= r.keys()
    methods = {"ddp", "zero", "zero_bucketview", "cross_shard", "sharded", "sharded_views"}
    methods |= {"sharded_all_reduce", "sharded_views_all_reduce"}
    for case in r["cases"].values():
        assert set(case["median_s"]) == methods and set(case["state_bytes"]) == methods
        assert all(_positive(t) for t in case["median_s"].values())
        assert all(_positive(x) for x in case["paired_pairwise_vs_all_reduce"].values())
        assert set(case["max_abs_param_difference_vs_ddp"].values()) == {0.0}
    memory = [c["memory"] for c in r["cases"].values() if "memory" in c]
    assert memory and all(m["sharded"]["state_bytes"] > 0 for m in memory)


def _memory(r: dict[str, Any]) -> None:
    assert {"runs", "machine", "settings"} <= r.keys() and r["runs"]
    contenders = {"ddp", "zero", "cross_shard", "cross_shard_views", "sharded", "sharded_views"}
    for key, rows in r["runs"].items():
        world = int(key.split("/")[1])
        assert set(rows) == contenders | {"diloco"}
        params = rows["ddp"]["params"]
        full = rows["cross_shard_views"]["state_elements"]
        assert full >= params  # at least one moment per parameter
        # sharding: 1/n of the state (plus padding), and no buffer of the gradients' size
        for sharded, unsharded in (("sharded_views", "cross_shard_views"),
                                   ("sharded", "cross_shard")):  # fmt: skip
            assert rows[sharded]["state_elements"] <= full / world + world
            saved = rows[unsharded]["live_elements"] - rows[sharded]["live_elements"]
            assert saved >= 0.8 * (1 - 1 / world) * full, (key, sharded, saved)
        assert rows["zero"]["state_elements"] < full  # whole parameters per rank: about 1/n
        # DiLoCo keeps a global copy and the outer momentum on top of the inner state
        assert rows["diloco"]["state_elements"] >= full + 2 * params
        assert all(row["peak_rss_growth_bytes"] >= 0 for row in rows.values())


def _diloco(r: dict[str, Any]) -> None:
    assert {"config", "summary", "goal_straggler_time_to_target", "runs"} <= r.keys()
    names = {*r["config"]["contenders"], *r["config"]["async_contenders"]}
    assert len(names) == 9 and r["summary"].keys() == r["config"]["scenarios"].keys()
    for rows in r["summary"].values():
        assert rows.keys() == names
        assert all(0 <= row["final_val_acc"] <= 1 for row in rows.values())
    assert len(r["runs"]) == len(names) * len(r["summary"])
    assert all(run["steps"] > 0 and run["bytes"] > 0 for run in r["runs"])


def _mesh_sgd(r: dict[str, Any]) -> None:
    assert {"machine", "config", "results"} <= r.keys()
    assert {"plain_fp32", "dtensor_shard0_2ranks_fp32"} <= r["results"].keys()
    for res in r["results"].values():
        assert _positive(res["distoptim"]["median_s"]) and "goal" in res
        assert _positive(res["torch_foreach"]["distoptim_paired_speedup"])


def _gpu_cross_shard(r: dict[str, Any]) -> None:
    assert "skipped" not in r and not r.get("timed_out")
    assert set(r["dtypes"]) == {"fp32", "bf16"}
    for d in r["dtypes"].values():
        assert d["rounds"] >= 1 and _positive(d["params"])
        assert len(d["contenders"]) == 8
        for c in d["contenders"].values():
            assert _positive(c["step_median_ms"]) and c["state_bytes"] > 0


def _gpu_fsdp_diloco(r: dict[str, Any]) -> None:
    assert "skipped" not in r and r["config"]["device"] == "cpu"  # --quick: the CPU run
    assert r["exit_codes"] == [0, 0] and r["every_rank_reported"] and r["one_model"]
    ranks = r["ranks"]
    assert [(x["replica"], x["rank"]) for x in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(x["steps"] == r["config"]["steps"] and x["syncs"] >= 1 for x in ranks)
    assert all(x["bytes_sent"] > 0 and _positive(x["step_ms"]) for x in ranks)


def _gpu_mesh_sgd(r: dict[str, Any]) -> None:
    assert "skipped" not in r and r["timed_out"] is False
    assert set(r["results"]) == {"fp32", "bf16"}
    for res in r["results"].values():
        assert res["check"]["grads_bit_identical_after_steps"]["distoptim"] is True
        assert _positive(res["speed"]["distoptim"]["median_s"]) and res["speed"]["rounds"] >= 3


def _agn(r: dict[str, Any]) -> None:
    assert {"machine", "model", "loadavg"} <= r.keys()
    # the quick run: one cluster, both transports; the fault scenarios are --quick --only faults
    assert {"passes_ms", "round_trip", "commits_per_s"} <= r.keys() and "faults" not in r
    assert all(_positive(ms) for ms in r["passes_ms"].values())
    assert set(r["round_trip"]) == {"1ps"}  # the quick run measures one shard only
    rt = r["round_trip"]["1ps"]
    assert all(_positive(ms) for ms in rt["median_ms"].values())
    assert {"p2p_commit", "rpc_commit", "p2p_echo", "rpc_echo"} <= rt["median_ms"].keys()
    assert _positive(rt["p2p_commit_over_rpc_commit"]) and _positive(rt["p2p_commit_over_floor"])
    assert _positive(r["commits_per_s"]["1w"]["p2p_over_rpc"])


def _lm_size(r: dict[str, Any]) -> None:
    assert {"machine", "corpus", "unigram", "summary", "runs"} <= r.keys()
    assert r["corpus"]["val_plays"] and r["corpus"]["vocab_size"] > 0
    assert _positive(r["unigram"]["val_loss"])
    for row in r["summary"].values():
        assert _positive(row["median_step_ms"]) and _positive(row["final"]["loss"])


def _ft(r: dict[str, Any]) -> None:
    assert {"machine", "config", "load_before", "load_after", "cpu_s"} <= r.keys()
    assert "vs_torchft" in r or "goodput" in r  # --quick: the per-step comparison
    for pair in ("sync", "diloco") if "vs_torchft" in r else ():
        v = r["vs_torchft"][pair]
        assert _positive(v["ours_step_ms"]) and _positive(v["theirs_step_ms"])
        assert v["paired_ratios"] and all(_positive(x) for x in v["paired_ratios"])
        assert _positive(v["check"]["slice_ms"]) and _positive(v["check_share_of_step"])
    for g in r.get("goodput", {}).values():
        assert set(g["spares"]) == {str(n) for n in r["config"]["spares"]}
        runs = [g["fault_free"], *(row["run"] for row in g["spares"].values())]
        for run in runs:
            assert run["states_equal"] and run["commits"] > 0 and _positive(run["goodput"])
            for key in ("load_before", "load_after"):
                assert len(run[key]) == 3 and all(x >= 0 for x in run[key]), (key, run[key])
        for n, row in g["spares"].items():
            faulty = row["run"]
            assert faulty["faults"]  # the schedule dealt at least one fault
            assert _positive(row["goodput_ratio"])
            assert faulty["heal_s"] and all(x >= 0 for x in faulty["heal_s"])
            assert faulty["away_s"] and all(_positive(x) for x in faulty["away_s"])
            assert _positive(row["away_median_s"]) and row["heal_median_s"] is not None
            healed = [x for x in faulty["restarts"] if x["away_s"] is not None]
            assert healed and all(x["spare"] is (n != "0") for x in healed), faulty["restarts"]
    for o in r.get("overhead", {}).values():
        assert _positive(o["plain_step_ms"]) and _positive(o["managed_step_ms"])


def _compare_runs(r: dict[str, Any]) -> None:
    assert {"machine", "settings", "datasets"} <= r.keys()
    runs = r["settings"]["runs"]
    assert runs >= 2  # a spread needs two
    for d in r["datasets"].values():
        assert len(d["runs"]) == runs
        assert all(run["results"]["status"] == "complete" for run in d["runs"])
        assert all(run["load_before"] and run["load_after"] for run in d["runs"])
        assert d["order"][0] == "sync" and set(d["order"]) == set(d["summary"])
        assert d["summary"]["sync"]["time_to_target_vs_sync"]["median"] == 1.0  # paired with itself
        assert all(row["wall_time_s"]["n"] == runs for row in d["summary"].values())
        assert len(d["table"].splitlines()) == 2 + len(d["order"])


def _lm(r: dict[str, Any]) -> None:
    assert {"machine", "config", "corpus", "goals", "quality", "step_time"} <= r.keys()
    q = r["quality"]
    assert q["load_before"] and q["load_after"]
    runs = q["runs"]
    assert {"sync", "sync_sqrt_lr"} <= runs.keys() and len(runs) == 6
    assert runs["sync_sqrt_lr"]["settings"]["lr"] == pytest.approx(3e-3 * 2**0.5)  # 2 replicas
    tokens = {run["tokens_per_worker"] for run in runs.values()}
    assert len(tokens) == 1 and tokens.pop() > 0  # the same token budget per worker
    for name, run in runs.items():
        assert 0 < run["val_loss"] < 5 and run["bytes"] == sum(run["bytes_per_rank"]) > 0
        assert run["history"][0]["step"] == 0 and run["history"][-1]["val_loss"] == run["val_loss"]
        reference = runs[q["goals"]["reference"]]["val_loss"]  # the better sync
        assert reference == min(runs["sync"]["val_loss"], runs["sync_sqrt_lr"]["val_loss"])
        assert run["loss_gap_vs_sync"] == pytest.approx((run["val_loss"] - reference) / reference)
        if not name.startswith("sync"):  # every outer-family contender sends fewer bytes
            assert run["bytes_ratio_vs_sync"] > 1, name
    assert runs["sync"]["bytes_ratio_vs_sync"] == runs["sync_sqrt_lr"]["bytes_ratio_vs_sync"] == 1
    assert q["invocations"] and q["invocations"][0]["order"]
    goals = {k: v for k, v in q["goals"].items() if k != "reference"}
    assert set(goals) == {"streaming", "topk_lowbit"}
    for goal in goals.values():
        assert goal["contenders"] and isinstance(goal["met"], bool)
        for row in goal["contenders"].values():
            assert row["met"] == (row["loss_met"] and row["bytes_met"])
    steps = r["step_time"]["contenders"]
    assert "ddp" in steps and "cross_shard" in steps and len(steps) == 6
    assert steps["ddp"]["paired_ratio_vs_ddp"] == 1.0
    assert all(
        _positive(s["median_step_ms"]) and _positive(s["paired_ratio_vs_ddp"])
        for s in steps.values()
    )


def _groups(r: dict[str, Any]) -> None:
    rows = {(row["wire"], row["k"]): row for row in r["rows"]}
    assert sorted(rows) == [("fp32", 1), ("fp32", 2), ("int8", 1), ("int8", 2)]
    fp32 = rows["fp32", 2]  # FSDP2 over 2 processes: every buffer is half a model
    assert fp32["state_ratio"] == 0.5 and fp32["residuals"] == 0
    assert 0.5 <= fp32["bytes_ratio"] < 0.51  # half the payload, the same 64-byte headers
    assert rows["int8", 2]["residuals"] > 0 and rows["int8", 2]["state_ratio"] < 0.55
    hsdp = {row["k"]: row for row in r["hsdp"]}  # CrossShard over FSDP2: 1/k of the model's ring
    assert sorted(hsdp) == [1, 2] and hsdp[2]["goal_bytes"] * 2 == hsdp[1]["goal_bytes"]
    assert all(1 <= row["ratio_to_goal"] < 1.02 for row in hsdp.values())  # + the fixed words
    assert len(hsdp[2]["steady_over_ranks"]) == 1 and 0.5 <= hsdp[2]["ratio_to_k1"] < 0.51
    timing = r["vs_torchft"]  # DiLoCo vs torchft's on FSDP2: paired per block, one model
    assert len(timing["paired_ratios"]) == len(timing["cpu_paired_ratios"]) == 2
    assert all(_positive(x) for x in timing["paired_ratios"] + timing["cpu_paired_ratios"])
    assert timing["max_abs_diff_ours_vs_torchft"] == 0.0
    assert len(timing["load_start"]) == len(timing["load_end"]) == 3


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "agn.py": _agn,
    "compare_runs.py": _compare_runs,
    "cross_shard.py": _cross_shard,
    "diloco.py": _diloco,
    "ft.py": _ft,
    "groups.py": _groups,
    "gpu_cross_shard.py": _gpu_cross_shard,
    "gpu_fsdp_diloco.py": _gpu_fsdp_diloco,
    "gpu_mesh_sgd.py": _gpu_mesh_sgd,
    "lm.py": _lm,
    "lm_size.py": _lm_size,
    "memory.py": _memory,
    "mesh_sgd.py": _mesh_sgd,
    "zero.py": _zero,
}
"""Every benchmark script and what its quick run's JSON must hold."""


SHARED_ENDING = sorted(set(CHECKS) - {"ft.py"})
"""The scripts that end through ``benchmarks/_common.py``'s ``Bench.save``."""


def _scripts() -> list[str]:
    return sorted(p.name for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_every_benchmark_script_is_run_here():
    assert _scripts() == sorted(CHECKS)


def _shared_ending(r: dict[str, Any], script: str, *argv: str) -> None:
    assert r["command"] == " ".join(["python", f"benchmarks/{script}", *argv])
    for key in ("load_before", "load_after"):
        assert len(r[key]) == 3 and all(x >= 0 for x in r[key]), (key, r[key])
    assert r["wall_s"] >= 0


@pytest.mark.parametrize("script", sorted(CHECKS))
def test_quick_run_succeeds_and_writes_its_results(script, tmp_path):
    out = tmp_path / "results" / script.replace(".py", ".json")
    proc = _run(script, "--quick", "--out", str(out), cwd=tmp_path)
    said = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    assert out.is_file(), said
    result = json.loads(out.read_text())
    CHECKS[script](result)
    if script in SHARED_ENDING:
        _shared_ending(result, script, "--quick", "--out", str(out))


def test_agn_fault_scenarios_quick_run(tmp_path):
    """``agn.py --quick`` leaves out the fault scenarios (ten process starts); their own smoke
    run still goes through the real kills and restarts and writes what it measured."""
    out = tmp_path / "agn_faults.json"
    proc = _run("agn.py", "--quick", "--only", "faults", "--out", str(out), cwd=tmp_path)
    said = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    result = json.loads(out.read_text())
    assert result["faults"] and "passes_ms" not in result, said
    _shared_ending(result, "agn.py", "--quick", "--only", "faults", "--out", str(out))


def test_ft_goodput_quick_run(tmp_path):
    """``ft.py --quick`` runs the per-step comparison; the goodput's own smoke run (one
    contender, two replicas, a fault-free run and one with a warm spare under one SIGKILL) goes
    through a real kill and hand-off and writes what it measured."""
    out = tmp_path / "ft_goodput.json"
    proc = _run("ft.py", "--only", "goodput", "--quick", "--out", str(out), cwd=tmp_path)
    said = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, said
    result = json.loads(out.read_text())
    assert set(result["goodput"]) == {"sync"} and result["config"]["spares"] == [1], said
    _ft(result)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("script", ["gpu_cross_shard.py", "gpu_fsdp_diloco.py", "gpu_mesh_sgd.py"])
def test_gpu_scripts_real_run_refuses_without_cuda(script, tmp_path, monkeypatch, capsys):
    """In this process (the refusal starts nothing, so a subprocess would only import torch
    again): ``main`` returns 0, says why and writes it."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their sibling _common
    out = tmp_path / "gpu.json"
    assert importlib.import_module(script.removesuffix(".py")).main(["--out", str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert "no CUDA device" in result["skipped"]
    _shared_ending(result, script, "--out", str(out))


def test_the_readme_table_is_made_of_the_shipped_runs(monkeypatch):
    """Every number of the README's sample table comes from the runs recorded in
    ``benchmarks/results/compare_runs.json``: recomputed from them, it is the README's table."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # compare_runs imports its sibling _common
    compare_runs = importlib.import_module("compare_runs")
    doc = json.loads((BENCHMARKS / "results" / "compare_runs.json").read_text())
    readme = (ROOT / "README.md").read_text()
    for name, d in doc["datasets"].items():
        again = compare_runs.table(compare_runs._summary(d["runs"]), compare_runs._order(d["runs"]))
        assert again == d["table"], name
    assert doc["datasets"]["digits"]["table"] in readme


def test_the_readme_memory_table_is_the_shipped_run(monkeypatch):
    """The README's table of what each CrossShard option costs and saves is
    ``benchmarks/memory.py``'s table of the recorded run in ``benchmarks/results/memory.json``,
    and that run holds what the quick run's check asks (sharding saves its share)."""
    import importlib

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # memory.py imports its sibling cross_shard
    memory = importlib.import_module("memory")
    shipped = json.loads((BENCHMARKS / "results" / "memory.json").read_text())
    _memory(shipped)
    assert shipped["settings"]["worlds"] == [2, 4] and "--quick" not in shipped["command"]
    assert memory.readme_table(shipped["runs"]) in (ROOT / "README.md").read_text()
