"""Fault tolerance on torchft, with real replicas: killed, stopped, restarted, healed.

Each scenario runs real replica processes around an in-process lighthouse
(:func:`distoptim.ft.local.run_replicas`) and acts on what they log, not on the clock: a kill
when training is under way, a SIGSTOP once the restarted replica has joined, SIGCONT a few
steps later, a donor killed while a joiner heals from it. Every scenario asserts that the
survivors finish, that every restarted replica took part in at least one commit with the others,
and that at every commit the replicas that committed hold bitwise-equal synchronised state.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from distoptim import CrossShardOptimizer, DiLoCo
from distoptim.ft.lighthouse import Lighthouse
from distoptim.ft.local import Controls, ReplicaRun, run_replicas
from distoptim.ft.replica import make_manager
from distoptim.ft.replicas import InsufficientReplicasError
from tests.ft import workloads

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 420  # seconds: a bound on a hung scenario; they take well under a minute
FAR = 96  # steps between a scenario's "stop at" and where the replicas are when it says so
# (the scenario reads their logs a little behind; every replica must still be short of it)


def _joined(run: ReplicaRun, slot: int) -> bool:
    return any(e["kind"] == "commit" and e["slot"] == slot and e["inc"] > 0 for e in run.events)


class _KillStopScenario:
    """Kill replica 1 mid-training and restart it; once it has committed with the others,
    SIGSTOP replica 2; SIGCONT it 15 steps later; end once it committed again."""

    def __init__(self) -> None:
        self.phase = "warmup"
        self.top = 0
        self.mark = 0

    def __call__(self, e: dict[str, Any], c: Controls) -> None:
        if e["kind"] != "commit":
            return
        self.top = max(self.top, e["step"])
        if self.phase == "warmup" and e["step"] >= 20:
            assert c.kill(1)
            c.restart(1)
            self.phase = "joining"
        elif self.phase == "joining" and e["slot"] == 1 and e["inc"] == 1:
            assert c.stop(2)
            self.mark, self.phase = self.top, "stopped"
        elif self.phase == "stopped" and e["slot"] == 0 and e["step"] >= self.mark + 15:
            c.cont(2)
            self.mark, self.phase = e["step"], "thawed"
        elif self.phase == "thawed" and e["slot"] == 2 and e["step"] > self.mark:
            c.finish_at(self.top + FAR)
            self.phase = "ending"


def test_cross_shard_survives_a_kill_and_a_stop_and_heals_bit_for_bit():
    scenario = _KillStopScenario()
    run = run_replicas(workloads.cross_shard, 3, on_event=scenario, timeout=RUN_TIMEOUT)
    assert scenario.phase == "ending", scenario.phase
    finals = run.values
    assert all(v is not None and "refused" not in v for v in finals), finals
    assert len({v["state"] for v in finals}) == 1  # one model at the end, bit for bit
    assert len({v["step"] for v in finals}) == 1
    by_step = workloads.commits_agree(run, "step")
    assert len(by_step) >= finals[0]["step"] - 1
    assert _joined(run, 1)
    assert finals[1]["heals"] >= 1  # the restarted replica took a peer's state
    assert finals[2]["heals"] >= 1  # so did the one that was frozen while the others went on
    actions = [(a.action, a.slot) for a in run.chaos]
    assert ("kill", 1) in actions and ("stop", 2) in actions


# the donors stop themselves as they copy their state for a healing peer (distoptim.ft.inject)
DONORS = {"0": "heal_donor", "2": "heal_donor"}


class _DonorScenario:
    """Kill replica 1 after a few syncs and restart it; kill the first replica that serves it
    its state -- stopped by its own trigger inside the heal, so exactly mid-heal whatever the
    load -- and restart that one too (a later donor's trigger is let go); end once both
    committed again."""

    def __init__(self) -> None:
        self.phase = "warmup"
        self.top = 0
        self.donor: int | None = None

    def __call__(self, e: dict[str, Any], c: Controls) -> None:
        if e["kind"] == "commit":
            self.top = max(self.top, e["step"])
        if e["kind"] == "inject" and self.phase != "joining":
            assert c.stop(e["slot"])  # stopped by itself: registered, and continued
            c.cont(e["slot"])
        if self.phase == "warmup" and e["kind"] == "commit" and e["syncs"] >= 6:
            assert c.kill(1)
            c.restart(1)
            self.phase = "joining"
        elif self.phase == "joining" and e["kind"] == "inject":
            self.donor = e["slot"]
            assert e["point"] == "heal_donor" and self.donor != 1, e
            assert c.kill(self.donor)  # while the joiner fetches its checkpoint
            c.restart(self.donor)
            self.phase = "healing"
        elif (
            self.phase == "healing"
            and e["kind"] == "commit"
            and e["slot"] == self.donor
            and e["inc"] > 0
            and _seen_commit_of(c, 1)
        ):
            c.finish_at(self.top + FAR)
            self.phase = "ending"


def _seen_commit_of(c: Controls, slot: int) -> bool:
    return c.seen(lambda e: e["kind"] == "commit" and e["slot"] == slot and e["inc"] > 0)


def test_streaming_diloco_int8_survives_a_donor_killed_mid_heal():
    scenario = _DonorScenario()
    run = run_replicas(
        workloads.streaming_diloco,
        3,
        args=("int8", DONORS),
        on_event=scenario,
        timeout=RUN_TIMEOUT,
    )
    assert scenario.phase == "ending", scenario.phase
    finals = run.values
    assert all(v is not None for v in finals), finals
    assert len({v["state"] for v in finals}) == 1  # the global copy, bit for bit
    assert len({v["model"] for v in finals}) == 1  # after finish(): the model too
    workloads.commits_agree(run, "syncs")
    assert _joined(run, 1) and _joined(run, scenario.donor)
    assert finals[1]["heals"] >= 1


class _MidSyncScenario:
    """Kill replica 2 as it enters its third sync and restart it at once; once it committed
    with the others, kill replica 0 as it enters a sync too; end once both committed again."""

    def __init__(self) -> None:
        self.phase = "warmup"
        self.top = 0

    def __call__(self, e: dict[str, Any], c: Controls) -> None:
        if e["kind"] == "commit":
            self.top = max(self.top, e["step"])
        if self.phase == "second" and _seen_commit_of(c, 0):
            c.finish_at(self.top + FAR)
            self.phase = "ending"
        if e["kind"] != "syncing":
            return
        if self.phase == "warmup" and e["slot"] == 2 and e["step"] >= 24:
            assert c.kill(2)  # as it enters the sync: the others' sync fails or goes on without it
            c.restart(2)
            self.phase = "joining"
        elif self.phase == "joining" and e["slot"] == 0 and _seen_commit_of(c, 2):
            assert c.kill(0)
            c.restart(0)
            self.phase = "second"


@pytest.mark.parametrize("workload", ["diloco", "local_sgd", "diloco_joins"])
def test_diloco_and_local_sgd_survive_kills_mid_sync(workload):
    scenario = _MidSyncScenario()
    fn = getattr(workloads, workload)
    run = run_replicas(fn, 3, on_event=scenario, timeout=RUN_TIMEOUT)
    assert scenario.phase == "ending", scenario.phase
    finals = run.values
    assert all(v is not None for v in finals), finals
    assert len({v["state"] for v in finals}) == 1  # the global copy, bit for bit
    assert len({v["model"] for v in finals}) == 1  # after finish(): the model too
    assert len({v["step"] for v in finals}) == 1
    workloads.commits_agree(run, "syncs")
    assert _joined(run, 2) and _joined(run, 0)
    assert finals[2]["heals"] >= 1 and finals[0]["heals"] >= 1
    kills = [a.slot for a in run.chaos if a.action == "kill"]
    assert kills == [2, 0]
    if workload == "diloco_joins":  # join(): each restarted replica's first step was a sync
        for slot in (2, 0):
            first = next(
                e for e in run.events if e["kind"] == "commit" and e["slot"] == slot and e["inc"]
            )
            assert first["calls"] == 1 and first["heals"] == 1, first


class _MismatchScenario:
    """End once the two good replicas have committed 10 steps (after the odd one left)."""

    def __call__(self, e: dict[str, Any], c: Controls) -> None:
        if e["kind"] == "commit" and e["slot"] == 0 and e["step"] == 10:
            c.finish_at(10 + FAR)


def test_a_replica_with_another_model_is_refused_by_name_and_the_others_go_on():
    run = run_replicas(workloads.odd_width, 3, on_event=_MismatchScenario(), timeout=RUN_TIMEOUT)
    good, odd = run.values[:2], run.values[2]
    assert "refused" in odd and "ParameterMismatchError" in odd["refused"], odd
    assert "member" in odd["refused"] and "parameter list" in odd["refused"]
    assert all(v["step"] == 10 + FAR for v in good) and good[0]["state"] == good[1]["state"]
    workloads.commits_agree(run, "step")


# ---- one process: the errors a user meets first ---------------------------------------------
def test_manager_must_be_a_torchft_manager_and_replaces_group():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"manager must be a torchft.Manager"):
        CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), manager=object())
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(TypeError, match=r"manager must be a torchft.Manager"):
        DiLoCo(inner, outer, sync_every=2, manager="m")


def test_min_replica_size_that_can_never_be_met_is_an_error_not_a_spin():
    with Lighthouse(min_replicas=1, join_timeout=0.2) as lighthouse:
        model = torch.nn.Linear(3, 1)
        opt: CrossShardOptimizer | None = None
        manager = make_manager(
            lighthouse.address,
            replica_id="alone",
            state_dict=lambda: {"m": model.state_dict()},
            load_state_dict=lambda s: None,
            min_replica_size=2,
            quorum_timeout=2,
            timeout=5,
            init_sync=False,
        )
        try:
            opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), manager=manager)
            start = time.monotonic()
            with pytest.raises(InsufficientReplicasError, match=r"min_replica_size=2"):
                while time.monotonic() - start < 60:
                    opt.zero_grad()
                    model(torch.ones(4, 3)).sum().backward()
                    opt.step()
            assert time.monotonic() - start < 30
            assert opt.iterations == 0  # nothing was ever applied
            with pytest.raises(ValueError, match=r"group must be None"):
                DiLoCo(
                    torch.optim.SGD(model.parameters(), lr=0.1),
                    torch.optim.SGD(model.parameters(), lr=0.7),
                    sync_every=2,
                    group=[[0]],
                    manager=manager,
                )
        finally:
            manager.shutdown(wait=False)
