"""cli.report and cli.plot: temporal efficiency math, the summary, results.json, the PNG."""

from __future__ import annotations

import io
import json
import math

import pytest

from distoptim.cli.config import RunConfig
from distoptim.cli.plot import accuracy_range, plot_accuracy
from distoptim.cli.record import RunRecord, build_history
from distoptim.cli.report import (
    assign_temporal_efficiency,
    render_table,
    summarize,
    temporal_efficiency,
    write_results,
)


def _hist(points):
    return [
        {"t": t, "samples": 10 * i, "val_acc": a, "val_loss": 1.0, "train_loss": 1.0}
        for i, (t, a) in enumerate(points)
    ]


def test_temporal_efficiency_is_the_ratio_of_areas_over_the_common_window():
    sync = _hist([(0, 0.5), (10, 0.5)])
    better = _hist([(0, 1.0), (20, 1.0)])  # longer run: only [0, 10] counts
    assert temporal_efficiency(better, sync) == pytest.approx(2.0)
    assert temporal_efficiency(sync, sync) == pytest.approx(1.0)
    ramp = _hist([(0, 0.0), (10, 1.0)])  # area 5 vs a flat 1.0 (area 10)
    assert temporal_efficiency(ramp, _hist([(0, 1.0), (10, 1.0)])) == pytest.approx(0.5)
    assert temporal_efficiency(_hist([(0, 1.0)]), sync) is None


def _cfg(algo, repeat=0, workers=2, lam=5, rule="paper"):
    period = 1 if algo == "sync" else lam
    return RunConfig(algo, workers, period, 1, 8, "sgd", 0.1, 0, repeat=repeat, agn_rule=rule)


def _rec(algo, acc, repeat=0, status="ok", **cfg):
    r = RunRecord(
        _cfg(algo, repeat, **cfg),
        status=status,
        wall_time_s=10.0,
        train_acc=acc,
        val_acc=acc,
        communications=7,
        bytes_moved=2_500_000,
    )
    r.history = _hist([(0, 0.1), (10, acc)])
    return r


def test_summary_means_repeats_and_reports_spread():
    records = [
        _rec("sync", 0.9),
        _rec("agn", 0.8),
        _rec("agn", 0.9, repeat=1),
        _rec("easgd", 0.5, status="interrupted"),
    ]
    assign_temporal_efficiency(records)
    assert records[0].temporal_efficiency == pytest.approx(1.0)
    assert records[1].temporal_efficiency < 1.0
    rows = {r["algorithm"]: r for r in summarize(records)}
    assert rows["agn"]["val_acc"] == pytest.approx(0.85)
    assert rows["agn"]["val_acc_std"] == pytest.approx(math.sqrt(0.005))
    assert rows["sync"]["communication_period"] is None and rows["agn"]["runs"] == 2
    assert rows["easgd"]["status"] == "interrupted" and rows["easgd"]["val_acc"] == 0.5
    buf = io.StringIO()
    render_table(summarize(records), buf)
    text = buf.getvalue()
    assert "85.0 ± 7.1%" in text and "EASGD \N{GREEK SMALL LETTER ALPHA}=0.45 (interrupted)" in text
    assert "2.5 MB" in text and "| AGN (paper)" in text and "*" not in text


def test_without_sync_the_grids_best_run_is_the_reference_and_the_footer_says_so():
    records = [_rec("agn", 0.8), _rec("agn", 0.9, rule="tf"), _rec("easgd", 0.7)]
    records.append(_rec("downpour", 0.95, status="failed"))  # unfinished: never the reference
    assign_temporal_efficiency(records)
    assert records[1].temporal_efficiency == pytest.approx(1.0)
    assert {r.temporal_efficiency_reference for r in records[:3]} == {"agn/tf λ=5 n=2"}
    assert records[0].temporal_efficiency < 1.0 and records[3].temporal_efficiency is None
    buf = io.StringIO()
    render_table(summarize(records), buf)
    text = buf.getvalue()
    assert "1.00*" in text and "| AGN (tf)" in text and "| AGN (paper)" in text
    assert "*: no sync run with that n; temporal eff. relative to the grid's best run" in text
    assert "AGN (tf): TF contrib's rule" in text


def test_results_json_is_strict_json(tmp_path):
    r = _rec("sync", 0.9)
    r.val_loss = float("nan")
    doc = write_results(tmp_path / "results.json", [r], {"status": "complete"})
    loaded = json.loads((tmp_path / "results.json").read_text())
    assert loaded["runs"][0]["val_loss"] is None and loaded["status"] == "complete"
    assert loaded["summary"] == json.loads(json.dumps(doc["summary"]))
    assert "integral" in loaded["temporal_efficiency_definition"]


def test_history_counts_every_workers_latest_samples():
    events = [
        {"kind": "start", "worker": 0, "t": 100.0, "samples": 0},
        {"kind": "start", "worker": 1, "t": 100.5, "samples": 0},
        {"kind": "eval", "worker": 0, "t": 100.6, "samples": 0, "acc": 0.1, "loss": 2.3},
        {"kind": "tick", "worker": 1, "t": 101.0, "samples": 40, "loss": 1.5},
        {"kind": "tick", "worker": 0, "t": 101.1, "samples": 30, "loss": 1.7},
        {"kind": "eval", "worker": 0, "t": 101.2, "samples": 32, "acc": 0.6, "loss": 1.2},
    ]
    t0, points = build_history(events)
    assert t0 == 100.0
    assert [p["samples"] for p in points] == [0, 72]
    assert points[1]["t"] == pytest.approx(1.2) and points[1]["train_loss"] == pytest.approx(1.6)


def test_plot_writes_both_pngs_with_a_zoomed_accuracy_axis(tmp_path):
    records = [_rec("sync", 0.9), _rec("agn", 0.8), _rec("agn", 0.85, lam=10, workers=4)]
    records[1].history = _hist([(0, 0.1), (2, 0.7), (4, 0.62), (6, 0.9), (8, 0.93)])
    assert accuracy_range(records) == (55.0, 100.0)  # 62 % late in a run is shown, 10 % not
    assert accuracy_range([RunRecord(_cfg("sync"))]) == (0.0, 100.0)
    path = plot_accuracy(records, tmp_path / "p.png", "title")
    for name in ("p.png", "accuracy_vs_samples.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert path == str(tmp_path / "p.png")
    assert plot_accuracy([RunRecord(_cfg("sync"))], tmp_path / "q.png", "t") is None
