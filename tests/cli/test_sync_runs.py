"""Real multi-process sync runs through the command line: the grid, determinism, npz data."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from distoptim.cli.main import main
from distoptim.comm.link import ENV_VAR

pytestmark = pytest.mark.timeout(240)


def test_sync_grid_over_workers_is_deterministic_with_seed(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compare", "--algos", "sync", "--workers", "1,2", "--repeats", "2", "--epochs", "2"]
    code = main([*argv, "--seed", "3", "--progress", "none", "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "complete"
    runs = doc["runs"]
    assert [(r["config"]["workers"], r["config"]["repeat"]) for r in runs] == [
        (1, 0),
        (2, 0),
        (1, 1),
        (2, 1),
    ]
    for first, again in ((runs[0], runs[2]), (runs[1], runs[3])):
        # same seed -> the same numbers, to the last bit
        assert first["val_acc"] == again["val_acc"] and first["val_loss"] == again["val_loss"]
        assert [p["val_loss"] for p in first["history"]] == [
            p["val_loss"] for p in again["history"]
        ]
    for r in runs:
        assert r["status"] == "ok" and r["val_acc"] > 0.5  # chance is 0.1
        assert r["communication_kind"] == "all-reduces"
    assert runs[0]["communications"] == 0 and runs[0]["bytes_moved"] == 0  # one worker: none
    # 2 workers: every rank all-reduces once per step (plus setup checks)
    steps = 2 * ((1438 // 2) // 16)
    assert runs[1]["communications"] >= steps and runs[1]["bytes_moved"] > 0
    assert runs[1]["samples"] == 2 * steps * 16
    assert len(doc["summary"]) == 2 and doc["summary"][0]["val_acc_std"] == 0.0
    table = capsys.readouterr().out
    assert "| sync" in table and "results.json" in table
    assert (out / "accuracy_vs_time.png").stat().st_size > 10_000


def test_train_on_a_user_npz(tmp_path, capsys):
    rng = np.random.default_rng(0)
    centers = rng.normal(scale=3.0, size=(3, 5))
    y = np.repeat(np.arange(3), 80)
    x = (centers[y] + rng.normal(size=(240, 5))).reshape(240, 5, 1)
    path = tmp_path / "blobs.npz"
    np.savez(path, x=x, y=y + 10)
    out = tmp_path / "out"
    argv = ["train", "--algo", "sync", "--workers", "2", "--epochs", "5", "--batch-size", "8"]
    argv += ["--link-latency-ms", "1", "--link-mbps", "1000"]  # an emulated link, too
    code = main([*argv, "--dataset", str(path), "--progress", "none", "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["dataset"] == {
        "name": "blobs.npz",
        "train_samples": 192,
        "val_samples": 48,
        "features": 5,
        "classes": 3,
    }
    assert doc["runs"][0]["val_acc"] > 0.8  # chance is 1/3
    assert doc["link"] == {"latency_ms": 1.0, "mbps": 1000.0}
    assert os.environ.get(ENV_VAR) is None  # only the children had it


def test_a_failed_run_is_recorded_and_the_next_one_still_runs(tmp_path, capsys):
    out = tmp_path / "out"
    # 50 ms cannot even start a Python process: every run times out and is killed
    argv = ["compare", "--algos", "sync", "--workers", "1,2", "--epochs", "1", "--timeout", "0.05"]
    assert main([*argv, "--progress", "none", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("failed: ProcessTimeoutError") == 2  # the second run was still attempted
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "failed"
    assert [r["status"] for r in doc["runs"]] == ["failed", "failed"]
    assert "did not finish within 0.05s" in doc["runs"][0]["error"]
