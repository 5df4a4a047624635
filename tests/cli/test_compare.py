"""`distoptim compare` end to end: every algorithm, the λ grid, the outer-optimizer family from
the console script, the real cause of a failed run, Ctrl-C and SIGTERM, torchrun."""

from __future__ import annotations

import os
import re
import shutil
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distoptim.cli import run as cli_run
from distoptim.cli.main import main
from distoptim.launch import torchrun_main
from tests.cli.helpers import (
    command,
    console_script,
    read_until,
    results,
    run_command,
    start_command,
    wait_gone,
)

pytestmark = pytest.mark.timeout(300)


def test_compare_every_algorithm_from_the_console_script(tmp_path):
    # what a fresh install runs: the console script, the default --algos (every algorithm)
    out = tmp_path / "out"
    cmd = [console_script(), "compare", "--workers", "2", "--communication-period", "4"]
    cmd += ["--epochs", "3"]
    cmd += ["--agn-rule", "tf,paper", "--moving-rate", "tf", "--straggler", "1:2"]
    proc = run_command([*cmd, "--eval-points", "6", "--progress", "plain", "--out", str(out)], 280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "warning" not in proc.stderr
    doc = results(out)
    assert doc["status"] == "complete" and doc["oversubscription"]["processes"] == 3
    runs = {(r["config"]["algo"], r["config"]["agn_rule"]): r for r in doc["runs"]}
    algos = ["sync", "localsgd", "diloco", "streaming-diloco", "agn", "agn", "downpour"]
    assert [a for a, _ in runs] == [*algos, "easgd", "async-diloco"]  # AGN twice: both rules
    model_bytes = 4 * (64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10)
    sync = runs["sync", "paper"]
    for key, r in runs.items():
        assert r["status"] == "ok", (key, r["error"])
        assert r["val_acc"] > 0.5 and r["train_acc"] > 0.5, (key, r["val_acc"])  # chance 0.1
        assert r["history"][0]["t"] == pytest.approx(0.0, abs=5.0)
        # no sample left out: 1438 = 2 x 719 each epoch, in 44 batches of 16 and one of 15
        assert r["history"][-1]["samples"] == r["samples"] == 3 * 1438
        assert r["bytes_moved"] > 0 and r["wall_time_s"] > 0 and r["startup_s"] >= 0
        assert r["config"]["stragglers"] == [[1, 2.0]]
        assert r["temporal_efficiency"] > 0 and r["temporal_efficiency_reference"] == "sync n=2"
        # time and bytes to 0.95 x sync's final accuracy: the first evaluation there
        assert r["target_reference"] == "sync n=2"
        assert r["target_acc"] == pytest.approx(0.95 * sync["val_acc"])
        assert r["history"][-1]["bytes"] == r["bytes_moved"]
        if r["time_to_target_s"] is not None:
            assert 0 <= r["bytes_to_target"] <= r["bytes_moved"]
    assert sync["temporal_efficiency"] == pytest.approx(1.0)
    # the DiLoCo family syncs every H = 4 of each worker's 135 steps, and once more at the end
    # (finish(): the 3 steps after the last periodic sync, each fragment of Streaming DiLoCo's
    # two); its bytes are measured
    for algo in ("localsgd", "diloco", "streaming-diloco"):
        r = runs[algo, "paper"]
        assert r["communication_kind"] == "syncs" and r["bytes_history"] == "measured"
        assert r["time_to_target_s"] is not None, algo
    assert runs["localsgd", "paper"]["communications"] == 135 // 4 + 1
    assert runs["diloco", "paper"]["communications"] == 135 // 4 + 1
    assert runs["streaming-diloco", "paper"]["communications"] == 135 // 2 + 2  # F = 2
    assert runs["diloco", "paper"]["bytes_moved"] * 3 < sync["bytes_moved"]
    assert (
        runs["streaming-diloco", "paper"]["bytes_moved"] * 2
        < runs["diloco", "paper"]["bytes_moved"]
    )
    assert runs["diloco", "paper"]["settings"]["outer"] == {
        "optimizer": "SGD",
        "lr": 1.0,
        "momentum": 0.5,
        "nesterov": True,
    }
    assert runs["streaming-diloco", "paper"]["settings"]["wire"] == "int8"
    # the parameter server: a commit every 4 steps; the chief's evaluation pulls left out
    for key in [k for k in runs if k[0] in ("agn", "downpour", "easgd", "async-diloco")]:
        r = runs[key]
        assert r["communication_kind"] == "commits"
        assert r["communications"] == 2 * (3 * 45 // 4)  # every 4 of 3 x 45 local steps
        assert sum(r["stats"]["staleness_histogram"].values()) == r["communications"]
        assert r["settings"]["transport"] == "p2p"
        assert r["bytes_history"] == "estimated from samples"
        evals = len(r["history"]) - 1  # the last point is the final center, not a pull
        assert r["stats"]["evaluation_pull_bytes"] == evals * model_bytes
        moved = r["stats"]["bytes_in"] + r["stats"]["bytes_out"] - evals * model_bytes
        assert r["bytes_moved"] == moved
    # what ran is recorded: AGN's rule, EASGD's moving rate (tf: 0.9 / (τ n)), Async DiLoCo's N
    assert runs["agn", "tf"]["settings"]["update_rule"] == "gradient"
    assert runs["agn", "paper"]["settings"]["update_rule"] == "delta"
    assert runs["easgd", "paper"]["settings"]["moving_rate"] == pytest.approx(0.9 / 8)
    assert runs["easgd", "paper"]["config"]["moving_rate"] == "tf"
    assert runs["async-diloco", "paper"]["settings"]["delayed_momentum"] == 2  # "n"
    rows = {(r["algorithm"], r["variant"]) for r in doc["summary"]}
    assert ("agn", "tf") in rows and ("agn", "paper") in rows
    table = proc.stdout
    for name in (
        "| sync",
        "| LocalSGD",
        "| DiLoCo",
        "| Streaming DiLoCo F=2 int8",
        "| AGN (tf)",
        "| AGN (paper)",
        "| DOWNPOUR",
        "| EASGD \N{GREEK SMALL LETTER ALPHA}=0.113",
        "| Async DiLoCo DN=2",
    ):
        assert name in table
    assert "AGN (paper): Hermans et al.'s rule" in table and "time: " in table
    assert "bytes to target" in table and "stragglers: worker 1 2x as long per step" in table
    # one pool for the nine runs, its start-up said while it happens; where the time went
    assert doc["timing"]["pool_start_s"] and len(doc["timing"]["pool_start_s"]) == 1
    assert doc["timing"]["training_s"] == pytest.approx(sum(r["wall_time_s"] for r in doc["runs"]))
    assert 0 < doc["timing"]["startup_share"] < 1 and doc["timing"]["load_average"]["end"]
    assert "starting 3 worker processes" in proc.stderr and "ready in" in proc.stderr
    assert "training started" in proc.stderr and "done in" in proc.stderr
    assert "tensorpipe" not in proc.stderr.lower()  # a normal end is quiet
    for png in ("accuracy_vs_time.png", "accuracy_vs_samples.png"):
        data = (out / png).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 20_000
        assert f"plot:    {out / png}" in proc.stdout  # every file written is listed
    assert sorted(os.listdir(out)) == [
        "accuracy_vs_samples.png",
        "accuracy_vs_time.png",
        "results.json",
    ]


def test_compare_sweeps_the_lambda_grid(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compare", "--algos", "easgd", "--workers", "1,2", "--communication-period", "2,5"]
    argv += ["--epochs", "2", "--eval-points", "5", "--moving-rate", "0.3"]
    assert main([*argv, "--progress", "none", "--out", str(out)]) == 0
    doc = results(out)
    cells = [(r["algorithm"], r["workers"], r["communication_period"]) for r in doc["summary"]]
    assert cells == [("easgd", 1, 2), ("easgd", 1, 5), ("easgd", 2, 2), ("easgd", 2, 5)]
    commits = [r["communications"] for r in doc["runs"]]
    # 90 local steps per epoch on one worker, 45 on each of two
    assert commits == [2 * 90 // 2, 2 * 90 // 5, 2 * (2 * 45 // 2), 2 * (2 * 45 // 5)]
    # one pool of 3: the n = 2 clusters ran on processes that had run clusters of 2 before
    assert len(doc["timing"]["pool_start_s"]) == 1 and doc["timing"]["pool_processes"] == 3
    assert all(r["val_acc"] > 0.3 for r in doc["runs"])
    assert [r["settings"]["moving_rate"] for r in doc["runs"]] == [0.3] * 4
    # no sync run: temporal efficiency against the grid's best run, said under the table
    best = max(doc["runs"], key=lambda r: r["val_acc"])
    assert best["temporal_efficiency"] == pytest.approx(1.0)
    assert {r["temporal_efficiency_reference"] for r in doc["runs"]} == {best["label"]}
    table = capsys.readouterr().out
    assert "1.00*" in table and f"grid's best run ({best['label']})" in table


def _run_store() -> dist.TCPStore:
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))


def _rank_1_raises_after_its_peer_failed(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        dist.destroy_process_group()  # rank 0, in an all-reduce, loses its peer at once ...
        _run_store().wait(["rank 0 failed"])  # ... and has failed before this raises
        raise ValueError("the real cause on rank 1")
    dist.all_reduce(torch.ones(1))


def _failing_collective_task(context, cfg, run):
    """Stands in for the CLI's collective task: rank 1 raises the run's real cause only after
    rank 0 failed with gloo's consequence, so rank 0's report reaches the parent first."""
    try:
        torchrun_main(_rank_1_raises_after_its_peer_failed, backend="gloo", timeout=30)
    except Exception:
        if os.environ["RANK"] == "0":
            _run_store().set("rank 0 failed", "1")
        raise


def test_a_failed_run_reports_the_rank_that_raised_not_its_peers_connection_error(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(cli_run, "collective_task", _failing_collective_task)
    out = tmp_path / "out"
    argv = ["compare", "--algos", "sync", "--workers", "2", "--epochs", "1"]
    assert main([*argv, "--progress", "none", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    cause = "RankFailedError: rank 1 failed: ValueError: the real cause on rank 1"
    assert f"run 'sync n=2' failed: {cause}" in err, err
    doc = results(out)
    assert doc["runs"][0]["status"] == "failed" and doc["runs"][0]["error"] == cause


# ---------------------------------------------------------------------------------------------
def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


_MP_HELPERS = re.compile(r"multiprocessing\.(resource_tracker|forkserver) import main")


def _is_helper(pid: int, parent: int) -> bool:
    """Whether ``pid`` is one of multiprocessing's own helpers that ``parent`` started (not a
    worker): the resource tracker, or the forkserver ``distoptim.launch`` starts processes
    from (the workers it forks keep its command line, but their parent is the server)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return ppid == parent and _MP_HELPERS.search(_cmdline(pid)) is not None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as fh:
            return fh.read().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.parametrize(
    ("algo", "sig", "code"), [("sync", signal.SIGINT, 130), ("agn", signal.SIGTERM, 143)]
)
def test_ctrl_c_and_sigterm_stop_every_worker_and_keep_partial_results(tmp_path, algo, sig, code):
    out = tmp_path / "out"
    cmd = command("compare", "--algos", f"{algo},easgd", "--workers", "2", "--epochs", "100000")
    proc = start_command([*cmd, "--progress", "plain", "--out", str(out)])
    try:
        read_until(proc.stderr, "training started", timeout=120)
        spawned = _descendants(proc.pid)
        helpers = {p for p in spawned if _is_helper(p, proc.pid)}
        workers = spawned - helpers
        assert len(workers) >= 2  # the pool: 2 ranks (sync) or 1 PS + 2 workers (agn)
        proc.send_signal(sig)  # to the parent only, as `kill` or a test can
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert "leaked semaphore" not in stderr
    # the parent waits for its workers to end before it exits; multiprocessing's resource
    # tracker and forkserver leave by themselves when the parent's end of their pipes closes --
    # wait for that exit, bounded
    assert not [p for p in workers if _alive(p)], "worker processes outlived the signal"
    assert wait_gone(helpers, timeout=30), "multiprocessing helper outlived the command"
    doc = results(out)
    assert doc["status"] == "interrupted"
    assert [r["status"] for r in doc["runs"]] == ["interrupted"]  # easgd never started
    partial = doc["runs"][0]
    assert partial["error"] == f"interrupted by {'Ctrl-C' if code == 130 else 'SIGTERM'}"
    assert partial["history"], "the progress that reached the parent is kept"
    assert partial["val_acc"] == partial["history"][-1]["val_acc"] and partial["wall_time_s"] >= 0
    assert "interrupted" in stdout  # the table marks the row


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
@pytest.mark.parametrize(("algo", "procs"), [("sync", 2), ("agn", 3)])
def test_train_module_under_torchrun(tmp_path, algo, procs):
    out = tmp_path / "out"
    cmd = ["torchrun", "--standalone", "--nproc-per-node", str(procs), "-m", "distoptim.cli.train"]
    cmd += ["--algo", algo, "--epochs", "2", "--eval-points", "5", "--progress", "plain"]
    proc = run_command([*cmd, "--out", str(out)], 180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = results(out)
    run = doc["runs"][0]
    assert run["config"]["workers"] == 2 and run["status"] == "ok" and run["val_acc"] > 0.3
    assert run["history"] and run["samples"] == 2 * 1438
    if algo == "sync":
        assert run["communications"] >= 2 * 45 and run["stats"]["bytes_sent_per_rank"][1] > 0
    else:  # 1 PS + 2 workers, each commits every 10 of its 90 steps
        assert run["communications"] == 2 * 9 and run["stats"]["commits_per_worker"]["1"] == 9
    assert proc.stdout.count(f"| {'sync' if algo == 'sync' else 'AGN'}") == 1  # one rank reports
    assert "(torchrun)" in proc.stderr
