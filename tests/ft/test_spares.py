"""Warm spares (``run_replicas(spares=N)``): a killed slot is taken over by a process that was
started, imported and waiting before the kill, with a real lighthouse and real replicas.

The same scenario runs with one spare and without: replica 1 is killed once training is under
way (found by its log) and restarted. With the spare, the restarted incarnation is the spare's
process (its ``process`` event says ``spare`` and when it was ready, before the kill); without,
it is a new process. Both heal and finish with the others bit for bit. The time from the kill
to the slot's first commit after it is printed for both (a figure, not asserted on: the
machine may be loaded).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distoptim.comm.checksum import state_checksum
from distoptim.ft.local import Controls, ReplicaContext, run_replicas
from tests.ft import workloads

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow


def trainer(ctx: ReplicaContext) -> dict[str, Any]:
    model, opt, manager = workloads.linear_cross_shard(
        ctx, timeout=10, quorum_timeout=120, connect_timeout=30
    )
    g = torch.Generator().manual_seed(ctx.slot)
    ctx.wait_for_peers(240)
    while True:
        end = ctx.finish_at()
        if end is not None and opt.iterations >= end:
            break
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).square().sum().backward()
        before = opt.iterations
        opt.step()
        if opt.iterations > before:
            ctx.log("commit", step=opt.iterations)
    manager.shutdown(wait=False)
    return {"step": opt.iterations, "state": state_checksum(list(model.parameters()))}


class _KillOnce:
    """Kill replica 1 at step 20 and restart it; end 30 steps after it committed again."""

    def __init__(self) -> None:
        self.top, self.phase = 0, "warmup"

    def __call__(self, e: dict[str, Any], c: Controls) -> None:
        if e["kind"] != "commit":
            return
        self.top = max(self.top, e["step"])
        if self.phase == "warmup" and e["step"] >= 20:
            assert c.kill(1)
            c.restart(1)
            self.phase = "rejoining"
        elif self.phase == "rejoining" and e["slot"] == 1 and e["inc"] == 1:
            self.end = self.top + 30
            c.finish_at(self.end)
            self.phase = "ending"


def _rejoin_s(run: Any) -> tuple[float, dict[str, Any]]:
    """Seconds from the kill to slot 1's first commit after it; its restart's process event."""
    killed = min(a.at for a in run.chaos if a.slot == 1)
    first = min(e["t"] for e in run.events if e["kind"] == "commit" and e["inc"] == 1)
    process = next(e for e in run.events if e["kind"] == "process" and e["inc"] == 1)
    return first - killed, process | {"killed_at": killed}


@pytest.mark.parametrize("spares", [1, 0])
def test_a_killed_slot_is_taken_over_by_a_warm_spare(spares):
    scenario = _KillOnce()
    run = run_replicas(trainer, 3, on_event=scenario, spares=spares, timeout=300)
    assert scenario.phase == "ending", scenario.phase
    steps = {v["step"] for v in run.values}
    states = {v["state"] for v in run.values}
    assert steps == {scenario.end} and len(states) == 1, run.values  # bit for bit, all three
    seconds, process = _rejoin_s(run)
    if spares:
        assert process.get("spare") is True, process  # the spare's process took the slot
        assert process["warm_since"] < process["killed_at"], process  # ready before the kill
    else:
        assert "spare" not in process, process
    print(f"spares={spares}: kill -> first commit of the restarted slot {seconds:.2f} s")
