"""cli.report and cli.plot: temporal efficiency math, the summary, results.json, the PNG."""

from __future__ import annotations

import io
import json
import math
import tempfile
from pathlib import Path

import pytest

from distoptim.cli.plot import MAX_COLUMNS, accuracy_range, loss_range, plot_runs
from distoptim.cli.record import RunRecord, build_history
from distoptim.cli.report import (
    assign_targets,
    assign_temporal_efficiency,
    render_table,
    summarize,
    temporal_efficiency,
    write_results,
)
from distoptim.cli.runconfig import RunConfig


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


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_writes_both_pngs_with_a_zoomed_accuracy_axis_and_returns_every_path(tmp_path):
    records = [_rec("sync", 0.9), _rec("agn", 0.8), _rec("agn", 0.85, lam=10, workers=4)]
    records[1].history = _hist([(0, 0.1), (2, 0.7), (4, 0.62), (6, 0.9), (8, 0.93)])
    assert accuracy_range(records) == (55.0, 100.0)  # 62 % late in a run is shown, 10 % not
    assert accuracy_range([RunRecord(_cfg("sync"))]) == (0.0, 100.0)
    paths = plot_runs(records, tmp_path, "title")
    assert paths == [str(tmp_path / n) for n in ("accuracy_vs_time.png", "accuracy_vs_samples.png")]
    for path in paths:
        _png_size(Path(path))
    assert plot_runs([RunRecord(_cfg("sync"))], tmp_path / "none", "t") == []


def test_many_algorithms_wrap_into_a_grid_that_reads_at_normal_size(tmp_path):
    # the default comparison: sync and 7 more algorithms, one worker count
    algos = ["localsgd", "diloco", "streaming-diloco", "agn", "downpour", "easgd", "async-diloco"]
    records = [_rec("sync", 0.9)] + [_rec(a, 0.8 + 0.01 * i) for i, a in enumerate(algos)]
    paths = plot_runs(records, tmp_path, "digits")
    width, height = _png_size(Path(paths[0]))
    assert MAX_COLUMNS == 4
    assert width < 1500 and height > 500  # two rows of 4 and 3 panels, not one row of 7
    assert width / height < 3


def _loss_rec(algo, losses, bytes_, **cfg):
    r = _rec(algo, 0.3, **cfg)
    r.config = RunConfig(
        algo, 2, 1 if algo == "sync" else 5, 0.1, 8, "adam", 3e-3, 0, model="gpt", wire=None
    )
    r.history = [
        {"t": 2.0 * i, "samples": 1000 * i, "val_acc": 0.2, "val_loss": v, "train_loss": v,
         "bytes": b}
        for i, (v, b) in enumerate(zip(losses, bytes_))
    ]  # fmt: skip
    r.val_loss, r.train_loss, r.bytes_moved = losses[-1], losses[-1], bytes_[-1]
    return r


def test_the_language_models_runs_are_judged_by_validation_loss(tmp_path):
    sync = _loss_rec("sync", [4.3, 2.6, 2.0], [0, 500, 1000])
    diloco = _loss_rec("diloco", [4.3, 2.07, 2.05], [0, 5, 10])  # 2.07 <= 1.04 x 2.0
    slow = _loss_rec("agn", [4.3, 3.0, 2.5], [0, 50, 100])
    records = [sync, diloco, slow]
    assign_temporal_efficiency(records)
    assign_targets(records)
    assert sync.target_loss == diloco.target_loss == pytest.approx(2.08)
    assert sync.target_acc is None and sync.target == pytest.approx(2.08)
    assert (diloco.time_to_target_s, diloco.bytes_to_target) == (2.0, 5)  # first, not last
    assert (sync.time_to_target_s, sync.bytes_to_target) == (4.0, 1000)
    assert slow.time_to_target_s is None
    # lower loss sooner than sync: E > 1 (the reference's area over the run's)
    assert sync.temporal_efficiency == pytest.approx(1.0)
    assert diloco.temporal_efficiency > 1.0 > slow.temporal_efficiency
    rows = summarize(records)
    row = {r["algorithm"]: r for r in rows}["diloco"]
    assert row["metric"] == "loss" and row["val_loss"] == 2.05
    assert row["val_bpc"] == pytest.approx(2.05 / math.log(2))
    assert row["val_perplexity"] == pytest.approx(math.exp(2.05))
    buf = io.StringIO()
    render_table(rows, buf)
    text = buf.getvalue()
    assert "val loss (nats)" in text and "bits per char" in text and "perplexity" in text
    header = next(line for line in text.splitlines() if line.startswith("| algorithm"))
    assert "val acc" not in header and " 2.050 |" in text and " 7.77 |" in text
    assert "val loss <= 1.04 x the final val loss of sync with the same n (2.080" in text
    doc = write_results(tmp_path / "r.json", records, {})
    assert doc["metric"] == "loss" and "lower loss sooner" in doc["temporal_efficiency_definition"]
    run = doc["runs"][1]
    assert run["metric"] == "loss" and run["target_loss"] == pytest.approx(2.08)
    assert run["val_bpc"] == pytest.approx(2.05 / math.log(2))
    assert run["val_perplexity"] == pytest.approx(math.exp(2.05))
    assign_targets(records, 2.3)  # --target-loss
    assert slow.target_loss == 2.3 and slow.time_to_target_s is None
    assert diloco.target_reference is None and diloco.time_to_target_s == 2.0


def test_the_language_models_plots_are_loss_against_time_bytes_and_tokens(tmp_path):
    records = [
        _loss_rec("sync", [4.3, 2.6, 2.0], [0, 500, 1000]),
        _loss_rec("diloco", [4.3, 2.4, 2.1], [0, 5, 10]),
        _loss_rec("agn", [4.3, 3.0, 2.5], [0, 50, 100]),
    ]
    assert loss_range(records, 3.3) == pytest.approx((2.0 - 0.04 * 1.564, 3.564))
    paths = plot_runs(records, tmp_path, "shakespeare", ("unigram", 3.3))
    names = ["loss_vs_time.png", "loss_vs_bytes.png", "loss_vs_tokens.png"]
    assert paths == [str(tmp_path / n) for n in names]
    for path in paths:
        width, height = _png_size(Path(path))
        assert 800 <= width <= 1100 and 400 <= height <= 700


def test_one_run_is_not_compared_with_itself():
    # distoptim train: one run; its reference would be itself
    one = [_rec("sync", 0.9)]
    assign_temporal_efficiency(one)
    assert one[0].temporal_efficiency is None
    buf = io.StringIO()
    render_table(summarize(one), buf)
    text = buf.getvalue()
    header = next(line for line in text.splitlines() if line.startswith("| algorithm"))
    assert "1.00" not in text and "temporal" not in header
    assert "temporal eff" not in text  # neither a column nor a line under the table


def _curve(algo, points, **cfg):
    """A finished run whose history is ``points``: (t, val_acc, bytes) at 10 samples apart."""
    r = _rec(algo, points[-1][1], **cfg)
    r.history = [
        {"t": t, "samples": 10 * i, "val_acc": a, "val_loss": 1.0, "train_loss": 1.0, "bytes": b}
        for i, (t, a, b) in enumerate(points)
    ]
    r.bytes_moved = points[-1][2]
    return r


def test_time_and_bytes_to_target_read_the_first_evaluation_at_the_target():
    sync = _curve("sync", [(0, 0.1, 0), (4, 0.8, 400), (8, 0.9, 800)])
    diloco = _curve("diloco", [(0, 0.1, 0), (3, 0.855, 30), (6, 0.6, 60), (9, 0.88, 90)])
    slow = _curve("agn", [(0, 0.1, 0), (9, 0.85, 90)])  # 0.85 < 0.95 x 0.9 = 0.855
    records = [sync, diloco, slow]
    assign_targets(records)
    assert sync.target_acc == diloco.target_acc == pytest.approx(0.855)
    assert diloco.target_reference == "sync n=2" and sync.target_reference == "sync n=2"
    assert (sync.time_to_target_s, sync.bytes_to_target) == (8, 800)
    assert (diloco.time_to_target_s, diloco.bytes_to_target) == (3, 30)  # first, not last
    assert slow.time_to_target_s is None and slow.bytes_to_target is None
    buf = io.StringIO()
    render_table(summarize(records), buf, notes=["stragglers: worker 1 3x as long per step"])
    text = buf.getvalue()
    assert "time to target" in text and "bytes to target" in text and "not reached" in text
    assert " 3.0 s |" in text and " 30 B |" in text
    assert "0.95 x the final val acc of sync with the same n (85.5% for sync n=2)" in text
    assert text.rstrip().endswith("stragglers: worker 1 3x as long per step")
    assign_targets(records, 0.5)  # --target-acc: a fixed accuracy, for every run
    assert slow.target_acc == 0.5 and slow.target_reference is None
    assert (slow.time_to_target_s, slow.bytes_to_target) == (9, 90)
    buf = io.StringIO()
    render_table(summarize(records), buf)
    assert "val acc >= 50.0% (--target-acc)" in buf.getvalue()


def test_without_sync_the_target_is_relative_to_the_best_run_and_the_footer_says_so():
    best = _curve("diloco", [(0, 0.1, 0), (5, 0.92, 50), (10, 0.95, 100)])
    other = _curve("agn", [(0, 0.1, 0), (4, 0.9, 40), (8, 0.93, 80)])
    unfinished = _curve("localsgd", [(0, 0.1, 0), (1, 0.99, 10)])
    unfinished.status = "interrupted"
    records = [best, other, unfinished]
    assign_targets(records)
    assert other.target_reference == best.label == "diloco λ=5 n=2"
    assert other.time_to_target_s == 8 and best.time_to_target_s == 5  # 0.9025
    assert unfinished.target_acc is None and unfinished.time_to_target_s is None
    rows = summarize(records)
    buf = io.StringIO()
    render_table(rows, buf)
    assert "the final val acc of the grid's best run (no sync run with that n)" in buf.getvalue()
    doc = write_results(Path(tempfile.mkdtemp()) / "r.json", records, {}, notes=["x"])
    assert doc["footer"][-1] == "x" and "first evaluation" in doc["to_target_definition"]
    assert doc["runs"][1]["bytes_to_target"] == 80 and doc["summary"][1]["reached_target"] == 1


def _ev(kind, worker, t, samples, step, sent, **fields):
    return {"kind": kind, "worker": worker, "t": t, "samples": samples, "step": step,
            "bytes": sent, **fields}  # fmt: skip


def test_history_bytes_are_the_evaluating_rank_plus_every_other_ranks_mark_at_that_step():
    events = [
        _ev("start", 0, 10.0, 0, 0, 0),
        _ev("start", 1, 10.0, 0, 0, 0),
        _ev("eval", 0, 10.1, 0, 0, 5, acc=0.1, loss=2.0),
        _ev("mark", 1, 10.1, 0, 0, 5),
        _ev("mark", 1, 11.0, 64, 4, 900),
        _ev("tick", 1, 11.5, 96, 6, 1300),
        _ev("eval", 0, 11.9, 64, 4, 905, acc=0.5, loss=1.0),
        _ev("eval", 0, 12.5, 96, 6, 1305, acc=0.6, loss=0.9),  # no mark of worker 1 at step 6
    ]
    _, points = build_history(events)
    assert [p["bytes"] for p in points] == [10, 1805, None]
    assert [p["samples"] for p in points] == [0, 160, 192]  # worker 1 at its tick, 96


def test_unmeasured_bytes_are_the_samples_share_of_the_total():
    import torch

    from distoptim.cli.datasets import Dataset
    from distoptim.cli.model import build_model
    from distoptim.cli.record import finish_record

    x, y = torch.rand(8, 4), torch.arange(8) % 2
    data = Dataset("tiny", x, y, x, y, 2)
    record = RunRecord(_cfg("agn"))
    record.bytes_moved = 1000
    events = [
        {"kind": "start", "worker": 0, "t": 0.0, "samples": 0},
        {"kind": "eval", "worker": 0, "t": 0.1, "samples": 0, "acc": 0.1, "loss": 2.0},
        {"kind": "tick", "worker": 1, "t": 0.9, "samples": 100, "loss": 1.0},
        {"kind": "eval", "worker": 0, "t": 1.0, "samples": 100, "acc": 0.5, "loss": 1.0},
        {"kind": "finish", "worker": 0, "t": 2.0, "samples": 200, "loss": 1.0},
        {"kind": "finish", "worker": 1, "t": 2.0, "samples": 200, "loss": 1.0},
    ]
    params = list(build_model(data.num_features, data.num_classes, 0, (128, 64)).parameters())
    finish_record(record, data, events, params)
    assert [p["bytes"] for p in record.history] == [0, 500, 1000]  # 200 of 400 samples: half
    assert record.bytes_history == "estimated from samples"
