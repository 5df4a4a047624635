"""The LM workload's training pieces: window shards, fractional epochs, loss, validation
scores and the unigram baseline."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from distoptim.cli.gpt import GPTConfig, build_gpt
from distoptim.cli.lm import (
    VAL_WINDOWS,
    LMScore,
    WindowPlan,
    evaluate_lm,
    lm_loss,
    unigram_entropy,
    unigram_loss,
    validation_starts,
    windows,
)


def _plan(n_tokens: int = 1000, context: int = 8, batch: int = 5, world: int = 3, seed: int = 0):
    return WindowPlan(n_tokens, context, batch, world, seed)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("epoch", [0, 1, 7])
def test_shards_are_disjoint_and_cover_the_epoch(world: int, epoch: int) -> None:
    plan = _plan(n_tokens=1003, context=8, world=world, seed=5)
    shards = [plan.shard_starts(rank, epoch) for rank in range(world)]
    assert all(len(s) == plan.windows_per_worker for s in shards)
    starts = torch.cat(shards)
    assert len(set(starts.tolist())) == len(starts)  # disjoint
    offset = int(starts.min()) % plan.context
    grid = set(range(offset, offset + plan.windows_per_epoch * plan.context, plan.context))
    assert set(starts.tolist()) <= grid  # the epoch's tiling, at one offset
    assert len(grid) - len(starts) == plan.windows_per_epoch % world  # all but < world left


def test_every_window_fits_at_every_offset() -> None:
    for n_tokens in (2 * 8 + 2, 100, 101, 1000):
        plan = WindowPlan(n_tokens, 8, 4, 1, 0)
        tokens = torch.arange(n_tokens)
        for epoch in range(40):  # offsets 0..7 all come up
            x, y = windows(tokens, plan.shard_starts(0, epoch), 8)
            assert int(y.max()) <= n_tokens - 1
            assert torch.equal(x[:, 1:], y[:, :-1])


def test_windows_are_inputs_and_next_token_targets() -> None:
    tokens = torch.arange(50, dtype=torch.uint8)
    x, y = windows(tokens, torch.tensor([0, 10, 41]), 8)
    assert x.dtype == y.dtype == torch.int64
    assert x.tolist()[1] == list(range(10, 18))
    assert y.tolist()[1] == list(range(11, 19))
    assert y.tolist()[2] == list(range(42, 50))


def test_shards_are_deterministic_per_seed_and_epoch() -> None:
    a, b, c = _plan(seed=1), _plan(seed=1), _plan(seed=2)
    assert torch.equal(a.shard_starts(1, 3), b.shard_starts(1, 3))
    assert not torch.equal(a.shard_starts(1, 3), a.shard_starts(1, 4))
    assert not torch.equal(a.shard_starts(1, 3), c.shard_starts(1, 3))


def test_fractional_epochs_and_the_batches_of_a_run() -> None:
    plan = _plan(n_tokens=1000, context=8, batch=5, world=3)
    assert plan.windows_per_epoch == 123
    assert plan.windows_per_worker == 41
    assert plan.steps_per_epoch == 9  # 8 batches of 5 and one of 1
    assert plan.total_steps(1) == 9
    assert plan.total_steps(0.05) == 1  # at least one step
    assert plan.total_steps(1.5) == 14  # round(13.5): half to even
    batches = list(plan.batch_starts(2, 1.5))
    assert len(batches) == 14
    assert [len(b) for b in batches[:9]] == [5] * 8 + [1]
    assert torch.equal(torch.cat(batches[:9]), plan.shard_starts(2, 0))
    assert torch.equal(torch.cat(batches[9:]), plan.shard_starts(2, 1)[:25])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_tokens": 30, "context": 8, "world": 3}, "fewer than the 3 workers"),
        ({"context": 0}, "context must be an int >= 1"),
        ({"batch": 0}, "batch_size must be an int >= 1"),
        ({"seed": -1}, "seed must be an int >= 0"),
    ],
)
def test_plan_is_checked(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _plan(**kwargs)


def test_run_arguments_are_checked() -> None:
    plan = _plan()
    with pytest.raises(ValueError, match="epochs must be a finite number > 0"):
        plan.total_steps(0)
    with pytest.raises(ValueError, match="epochs"):
        list(plan.batch_starts(0, float("nan")))
    with pytest.raises(ValueError, match="rank must be < world_size 3"):
        plan.shard_starts(3, 0)


def test_validation_starts_are_fixed_and_span_the_text() -> None:
    starts = validation_starts(10_000, 64)
    assert len(starts) == VAL_WINDOWS == 256
    assert int(starts[0]) == 0 and int(starts[-1]) == 10_000 - 64 - 1
    assert torch.equal(starts, validation_starts(10_000, 64))
    assert bool((starts[1:] > starts[:-1]).all())
    with pytest.raises(ValueError, match="fewer than one window"):
        validation_starts(64, 64)


def test_evaluation_is_the_mean_next_token_loss() -> None:
    cfg = GPTConfig(vocab_size=9, layers=1, width=8, heads=2, context=6)
    model = build_gpt(cfg, 0)
    tokens = torch.randint(9, (300,), generator=torch.Generator().manual_seed(1))
    starts = validation_starts(300, 6, count=10)
    model.train()
    score = evaluate_lm(model, tokens, starts, 6, batch_size=3)  # batches of 3, 3, 3, 1
    assert model.training  # mode restored
    x, y = windows(tokens, starts, 6)
    with torch.no_grad():
        want = lm_loss(model(x), y).item()
    assert score.loss == pytest.approx(want, rel=1e-5)
    assert want == pytest.approx(
        F.cross_entropy(model(x).reshape(-1, 9), y.reshape(-1)).item(), rel=1e-6
    )


def test_score_spellings() -> None:
    s = LMScore(1.5)
    assert s.bits_per_char == pytest.approx(1.5 / math.log(2))
    assert s.perplexity == pytest.approx(math.exp(1.5))
    assert s.as_dict() == {"loss": 1.5, "bpc": s.bits_per_char, "perplexity": s.perplexity}


def test_unigram_baseline() -> None:
    train = torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.uint8)
    val = torch.tensor([0, 1, 3], dtype=torch.uint8)  # 3 never occurs in training
    q = torch.tensor([4, 3, 2, 1], dtype=torch.float64) / 10  # add-one: (n_c + 1) / (6 + 4)
    want = -(q[0].log() + q[1].log() + q[3].log()).item() / 3
    assert unigram_loss(train, val, 4) == pytest.approx(want)
    assert unigram_entropy(torch.tensor([0, 1, 2, 3] * 5), 6) == pytest.approx(math.log(4))
    assert unigram_entropy(torch.zeros(7, dtype=torch.long), 3) == 0.0
    # Gibbs: no unigram model scores below the text's own entropy
    assert unigram_loss(train, val, 4) > unigram_entropy(val, 4)
