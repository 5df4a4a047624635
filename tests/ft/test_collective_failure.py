"""A replica that dies inside a collective: every survivor fails the round at once, none waits
for the collective timeout, and the next quorum holds every survivor.

Four replica groups; replica 3 stops itself after its quorum of a round (:mod:`distoptim.ft.inject`
``after_quorum``), before it sends anything, and the scenario SIGKILLs it there. Its neighbours
in the ring see its connections close; a survivor on the far side of the ring waits on a
*live* neighbour, not on the dead one. Without anything more, that survivor stays blocked
until the collective timeout (30 s here), or until its neighbours' next quorum, formed without
it after the lighthouse's join timeout (10 s), frees their old process group. Each survivor
that sees the failure drops the quorum's process group at once
(``ManagedReplicas.collective_failed``), so the failure spreads along the ring within
milliseconds.

The verdict does not depend on the machine's load: the next quorum after the kill must hold
all three survivors (every commit from then on has 3 participants; without the drop, the first
quorum after the kill is formed without the blocked survivor, and two replicas commit alone),
every survivor's failed round names a closed connection (not a timeout), and the survivors end
bitwise equal.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

from distoptim import CrossShardOptimizer, DiLoCo
from distoptim.comm.checksum import state_checksum
from distoptim.ft import _torchft, inject
from distoptim.ft.local import Controls, ReplicaContext, run_replicas
from distoptim.ft.replica import make_manager

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

REPLICAS, VICTIM, ROUND = 4, 3, 4  # replica 3 dies after the quorum of its 4th round
TIMEOUT = 30.0  # the collective timeout: far above the lighthouse's join timeout (10 s)


def member(ctx: ReplicaContext, algo: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    opt: Any = None

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(s: dict[str, Any]) -> None:
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])

    manager = make_manager(
        ctx.lighthouse,
        replica_id=ctx.replica_id,
        state_dict=state,
        load_state_dict=load,
        min_replica_size=2,
        timeout=TIMEOUT,
        quorum_timeout=120,
        connect_timeout=30,
        init_sync=False,
    )
    if algo == "cross_shard":
        opt = CrossShardOptimizer(inner, manager=manager)
        rounds = lambda: opt.iterations  # noqa: E731
    else:  # DiLoCo with a two-phase wire: all-gather and all-to-all over the quorum too
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.5, nesterov=True)
        opt = DiLoCo(inner, outer, sync_every=2, manager=manager, wire="int8")
        rounds = lambda: opt.syncs  # noqa: E731
    if ctx.slot == VICTIM:

        def stop_here(point: str, role: str) -> None:
            ctx.log("inject", point=point, role=role)
            os.kill(os.getpid(), signal.SIGSTOP)

        inject.arm(f"after_quorum@{ROUND}", action=stop_here)
    g = torch.Generator().manual_seed(ctx.slot)
    ctx.wait_for_peers(240)
    commits: list[int] = []
    while rounds() < 3 * ROUND:
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).square().mean().backward()
        before = opt.replica_stats.commits
        opt.step()
        if opt.replica_stats.commits > before:
            commits.append(manager.num_participants())
    if algo != "cross_shard":
        opt.finish()
    stats = opt.replica_stats
    quorum = _torchft.quorum_id(manager)
    manager.shutdown(wait=False)
    return {
        "participants": commits,
        "errors": stats.errors,
        "failed": stats.failed,
        "quorum": quorum,
        "state": state_checksum(list(model.parameters())),
    }


def _kill_at_the_point(event: dict[str, Any], controls: Controls) -> None:
    if event["kind"] == "inject":  # it stopped itself there: kill it, do not restart it
        assert controls.stop(event["slot"])
        assert controls.kill(event["slot"])


@pytest.mark.parametrize("algo", ["cross_shard", "diloco_int8"])
def test_a_replica_killed_inside_a_collective_fails_every_survivor_at_once(algo):
    run = run_replicas(
        member,
        REPLICAS,
        args=(algo,),
        min_replicas=2,
        on_event=_kill_at_the_point,
        timeout=300,
    )
    survivors = [v for slot, v in enumerate(run.values) if slot != VICTIM]
    assert run.values[VICTIM] is None  # killed at the point
    assert [e["slot"] for e in run.events if e["kind"] == "inject"] == [VICTIM]
    for slot, v in enumerate(survivors):
        assert v["failed"] >= 1, f"replica {slot} never saw the failure: {v}"
        assert v["errors"], f"replica {slot}: a failed round with no error recorded"
        assert not any("Timed out" in e or "timeout" in e.lower() for e in v["errors"]), (
            f"replica {slot} waited out the collective timeout: {v['errors']}"
        )
        seen = v["participants"]
        first_short = seen.index(3)  # the first commit after the kill
        assert seen[:first_short] == [REPLICAS] * first_short, seen
        assert set(seen[first_short:]) == {3}, (
            f"replica {slot}: a quorum after the kill left a live survivor out "
            f"(participants per commit {seen})"
        )
    assert len({v["state"] for v in survivors}) == 1, survivors
