"""The amortized state check of a managed CrossShardOptimizer, across real replica processes.

Three replica groups around a real lighthouse train a model large enough that a clean round
checks only a slice of the parameters (``state_slices`` > 1). One replica flips one bit of its
last parameter right after a commit (a named point: its commit of :data:`FLIP_AT`): the check
must name it within ``K`` rounds, and the other two must go on and finish with equal states.
The run without a flip shows the slicing never refuses a healthy round (no false alarm).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from distoptim import CrossShardOptimizer
from distoptim.comm.checksum import state_checksum
from distoptim.ft.data import SlotShards
from distoptim.ft.local import ReplicaContext, run_replicas
from distoptim.ft.replica import make_manager
from distoptim.sync.replicated import state_slices

FLIP_AT, STEPS, WIDTH = 5, 16, 384
RUN_TIMEOUT = 600.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, 3))  # fmt: skip


def drifting(ctx: ReplicaContext, flip_slot: int | None) -> dict[str, Any]:
    """Train ``STEPS`` committed steps; replica ``flip_slot`` flips a bit after ``FLIP_AT``."""
    model = _model()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(256, WIDTH, generator=g), torch.randint(0, 3, (256,), generator=g)
    opt: CrossShardOptimizer | None = None

    def state() -> dict[str, Any]:
        return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})  # type: ignore[union-attr]

    def load(s: dict[str, Any]) -> None:
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])  # type: ignore[union-attr]

    manager = make_manager(
        ctx.lighthouse,
        replica_id=ctx.replica_id,
        state_dict=state,
        load_state_dict=load,
        timeout=30,
        quorum_timeout=120,
        connect_timeout=30,
        init_sync=False,
    )
    opt = CrossShardOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), manager=manager)
    shards = SlotShards(256, ctx.num_slots, ctx.slot, 8, seed=3)
    ctx.wait_for_peers(240)
    result: dict[str, Any] = {"slices": state_slices(list(model.parameters()))}
    try:
        while opt.iterations < STEPS:
            idx = shards.batch(opt.iterations)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            before = opt.iterations
            opt.step()
            if opt.iterations > before and opt.iterations == FLIP_AT and ctx.slot == flip_slot:
                with torch.no_grad():  # the last element: the last slice to be checked
                    model[2].bias.view(torch.int32)[-1] ^= 1
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result.update(
        step=opt.iterations,
        state=state_checksum(list(model.parameters())),
        commits=opt.replica_stats.commits,
    )
    manager.shutdown(wait=False)
    return result


def test_a_one_bit_drift_is_named_within_one_cycle_of_slices_and_the_others_go_on():
    run = run_replicas(drifting, 3, args=(2,), timeout=RUN_TIMEOUT)
    good, odd = run.values[:2], run.values[2]
    slices = odd["slices"]
    assert 2 <= slices < STEPS - FLIP_AT  # the test needs slicing, and a whole cycle to run
    assert "DesyncError" in odd.get("error", ""), odd
    assert "synchronised state" in odd["error"] and "than the majority" in odd["error"]
    # the flip came after commit FLIP_AT; its slice is checked within the next `slices` rounds
    assert FLIP_AT <= odd["step"] <= FLIP_AT + slices, odd
    for v in good:
        assert "error" not in v, v
        assert v["step"] == STEPS
    assert good[0]["state"] == good[1]["state"]


def test_slicing_raises_no_false_alarm_and_all_commit():
    run = run_replicas(drifting, 2, args=(None,), timeout=RUN_TIMEOUT)
    for v in run.values:
        assert "error" not in v, v
        assert v["step"] == STEPS and v["slices"] >= 2
    assert run.values[0]["state"] == run.values[1]["state"]
