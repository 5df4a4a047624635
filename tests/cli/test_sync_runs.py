"""Real multi-process sync runs through the command line: the pool, determinism, npz data."""

from __future__ import annotations

import os

import numpy as np
import pytest

from distoptim.cli.datasets import load_dataset
from distoptim.cli.main import main
from distoptim.cli.record import RunRecord, finish_record, record_collective
from distoptim.cli.runconfig import RunConfig
from distoptim.cli.training import collective_rank
from distoptim.comm.link import ENV_VAR
from distoptim.launch import spawn
from tests.cli.helpers import results

pytestmark = pytest.mark.timeout(240)


def test_pool_reuse_gives_the_results_of_fresh_processes(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compare", "--algos", "sync", "--workers", "1,2", "--repeats", "2", "--epochs", "2"]
    code = main([*argv, "--seed", "3", "--progress", "none", "--out", str(out)])
    assert code == 0
    doc = results(out)
    assert doc["status"] == "complete"
    assert len(doc["timing"]["pool_start_s"]) == 1  # four runs, one pool of two processes
    runs = doc["runs"]
    assert [(r["config"]["workers"], r["config"]["repeat"]) for r in runs] == [
        (1, 0),
        (2, 0),
        (1, 1),
        (2, 1),
    ]
    for first, again in ((runs[0], runs[2]), (runs[1], runs[3])):
        # the repeat ran on processes that had run other runs: same seed, same numbers
        assert first["val_acc"] == again["val_acc"] and first["val_loss"] == again["val_loss"]
        assert [p["val_loss"] for p in first["history"]] == [
            p["val_loss"] for p in again["history"]
        ]
    # ... and the numbers of fresh processes of their own (distoptim.launch.spawn)
    cfg = RunConfig("sync", 2, 1, 2, 16, "adam", 0.001, 3)
    data = load_dataset("digits")
    fresh = RunRecord(cfg)
    events, params = record_collective(fresh, spawn(collective_rank, 2, (cfg, data, None, None)))
    finish_record(fresh, data, events, params)
    assert fresh.val_loss == runs[3]["val_loss"] and fresh.train_acc == runs[3]["train_acc"]
    assert [p["val_loss"] for p in fresh.history] == [p["val_loss"] for p in runs[3]["history"]]
    for r in runs:
        assert r["status"] == "ok" and r["val_acc"] > 0.5  # chance is 0.1
        assert r["communication_kind"] == "all-reduces"
    assert runs[0]["communications"] == 0 and runs[0]["bytes_moved"] == 0  # one worker: none
    # 2 workers: every rank all-reduces once per step (plus setup checks)
    steps = 2 * 45  # 719 samples per rank and epoch: 44 batches of 16, one of 15
    assert runs[1]["communications"] >= steps and runs[1]["bytes_moved"] > 0
    assert runs[1]["samples"] == 2 * 1438
    assert len(doc["summary"]) == 2 and doc["summary"][0]["val_acc_std"] == 0.0
    table = capsys.readouterr().out
    assert "| sync" in table and "results.json" in table
    assert (out / "accuracy_vs_time.png").stat().st_size > 10_000


def test_train_on_a_user_npz(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(0)
    centers = rng.normal(scale=3.0, size=(3, 5))
    y = np.repeat(np.arange(3), 80)
    x = (centers[y] + rng.normal(size=(240, 5))).reshape(240, 5, 1)
    path = tmp_path / "blobs.npz"
    np.savez(path, x=x, y=y + 10)
    out = tmp_path / "out"
    argv = ["train", "--algo", "sync", "--workers", "2", "--epochs", "5", "--batch-size", "8"]
    argv += ["--link-latency-ms", "1", "--link-mbps", "1000"]  # an emulated link, too
    argv += ["--hidden", "64"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)  # one core
    code = main([*argv, "--dataset", str(path), "--progress", "none", "--out", str(out)])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 0, err
    assert "warning" not in err  # 2 workers on 1 core: recorded, under the table
    oversubscribed = "oversubscribed: runs of up to 2 processes (2 training) on 1 CPU core(s)"
    doc = results(out)
    assert doc["dataset"] == {
        "name": "blobs.npz",
        "train_samples": 192,
        "val_samples": 48,
        "features": 5,
        "classes": 3,
    }
    assert doc["runs"][0]["val_acc"] > 0.8  # chance is 1/3
    assert doc["runs"][0]["config"]["hidden"] == [64]
    assert doc["link"] == {"latency_ms": 1.0, "mbps": 1000.0}
    assert doc["oversubscription"]["workers_per_core"] == 2.0
    assert any(line.startswith(oversubscribed) for line in doc["footer"])
    assert oversubscribed in captured.out
    assert os.environ.get(ENV_VAR) is None  # only the children had it


def test_a_failed_run_is_recorded_and_the_next_one_still_runs(tmp_path, capsys):
    out = tmp_path / "out"
    # 50 ms cannot even set up a run's process group: every run times out, its processes are
    # killed, and the next run gets a new pool
    argv = ["compare", "--algos", "sync", "--workers", "1,2", "--epochs", "1", "--timeout", "0.05"]
    assert main([*argv, "--progress", "none", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("failed: ProcessTimeoutError") == 2  # the second run was still attempted
    doc = results(out)
    assert doc["status"] == "failed"
    assert [r["status"] for r in doc["runs"]] == ["failed", "failed"]
    # the user's own limit, named as such: not presented as a hang
    assert "did not finish within 0.05s, the limit set by --timeout" in doc["runs"][0]["error"]
    assert "if the run needs longer, raise --timeout" in doc["runs"][0]["error"]
    assert len(doc["timing"]["pool_start_s"]) == 2
