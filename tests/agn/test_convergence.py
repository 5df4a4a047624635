"""distoptim.agn: four asynchronous AGN workers train a real classifier (scikit-learn digits)."""

from __future__ import annotations

import pytest
import torch

import distoptim
from distoptim.agn import spawn

pytest.importorskip("sklearn")

STEPS = 60
THRESHOLD = 0.5  # cross-entropy; the untrained model is at ~2.3 (= ln 10)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(x), y))


def _train(ctx) -> dict:
    x, y = _data()
    xs, ys = x[ctx.task_index :: ctx.num_worker], y[ctx.task_index :: ctx.num_worker]
    model = _model()
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
        ctx.num_worker,
        communication_period=5,
    )
    # the untrained model (same seed on every worker); measured before the init hook because a
    # late worker pulls a center that the others may already have moved
    start = _loss(model, x, y)
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()
    g = torch.Generator().manual_seed(ctx.task_index)
    for _ in range(STEPS):
        idx = torch.randint(len(xs), (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
        opt.step()
    return {"start": start, "commits": opt.local_step // opt.communication_period}


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["p2p", "rpc"])
def test_four_workers_reach_loss_threshold(transport):
    result = spawn(_train, 4, num_ps=1, timeout=140, num_threads=1, transport=transport)
    x, y = _data()
    model = _model()
    with torch.no_grad():
        for p, c in zip(model.parameters(), result.center):
            p.copy_(c)
    final = _loss(model, x, y)
    assert all(r["start"] > 2.0 for r in result.worker_results)
    assert final < THRESHOLD, f"final loss {final:.3f}"
    assert result.stats.global_step == 4 * STEPS // 5
    assert result.stats.commits_per_worker == {t: STEPS // 5 for t in range(4)}
    assert result.stats.dead_workers == []
