"""The lighthouse going away mid-run, coming back, and a joiner that finds nobody: real
replica processes around a real torchft lighthouse that the scenario stops and restarts when
the replicas' logs say training is under way (not after a sleep).

* stopped for good: every replica raises ``LighthouseGoneError`` naming the address (within the
  manager's ``connect_timeout``, long before its ``quorum_timeout``), its state that of its last
  committed step, equal on every replica;
* restarted on the same port: every replica rejoins it and trains on;
* a replica group that arrives after the others finished raises ``NoPeersError``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from distoptim.comm.checksum import state_checksum
from distoptim.ft.lighthouse import HeartbeatWatch, Lighthouse, LighthouseStatus, lighthouse_status
from distoptim.ft.local import Controls, ReplicaContext, run_replicas
from tests.ft import workloads

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

CONNECT_TIMEOUT = 5.0
QUORUM_TIMEOUT = 120.0  # a replica waits this long before QuorumTimeoutError


def _train(ctx: ReplicaContext, min_replica_size: int = 2) -> dict[str, Any]:
    """CrossShard SGD under a manager until the scenario's step; an error comes back as text
    with the state of the last committed step."""
    model, opt, manager = workloads.linear_cross_shard(
        ctx,
        min_replica_size=min_replica_size,
        timeout=10,
        quorum_timeout=QUORUM_TIMEOUT,
        connect_timeout=CONNECT_TIMEOUT,
    )
    g = torch.Generator().manual_seed(ctx.slot)
    error, waited = None, 0.0
    try:
        while True:
            end = ctx.finish_at()
            if end is not None and opt.iterations >= end:
                break
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).square().sum().backward()
            before, began = opt.iterations, time.monotonic()
            opt.step()
            if opt.iterations > before:
                ctx.log("commit", step=opt.iterations)
    except Exception as exc:
        error, waited = f"{type(exc).__name__}: {exc}", time.monotonic() - began
    manager.shutdown(wait=False)
    return {
        "error": error,
        "waited": waited,
        "step": opt.iterations,
        "state": state_checksum(list(model.parameters())),
    }


def trainer(ctx: ReplicaContext) -> dict[str, Any]:
    ctx.wait_for_peers(240)
    return _train(ctx)


def late_joiner(ctx: ReplicaContext) -> dict[str, Any]:
    """Slot 2 starts its manager only after the others returned; slots 0 and 1 train."""
    ctx.wait_for_peers(240)
    if ctx.slot < 2:
        return _train(ctx)
    while not ctx.ending():  # an event of the run (a file a returning replica writes)
        time.sleep(0.05)
    return _train(ctx, min_replica_size=1)


def test_lighthouse_status_reads_a_real_lighthouse():
    with Lighthouse(2) as lighthouse:
        assert lighthouse_status(lighthouse.address) == LighthouseStatus(0, 0)
        address = lighthouse.address
    assert lighthouse_status(address) is None  # nothing answers there any more


def test_heartbeat_watch_measures_live_silences_and_leaves_the_dead_out():
    """A group silent 0.4 s that beats again is a live silence; one that stops for good (a
    killed incarnation) is not, however long it has been silent."""
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    with Lighthouse(1, heartbeat_timeout=5.0) as lighthouse:
        client = LighthouseClient(lighthouse.address, connect_timeout=timedelta(seconds=5))
        watch = HeartbeatWatch(lighthouse.address, every=0.05)
        watch.start()
        client.heartbeat("dead:0")
        client.heartbeat("live:0")
        gap_ends = time.monotonic() + 0.4
        while time.monotonic() < gap_ends:  # the live group's silence, which the watch reads
            time.sleep(0.05)
        client.heartbeat("live:0")
        deadline = time.monotonic() + 10
        while watch.longest_s == 0.0 and time.monotonic() < deadline:
            client.heartbeat("live:0")
            time.sleep(0.05)  # beating, as a manager does, until the watch has read the drop
        figures = watch.stop()
    assert 0.3 <= figures["longest_s"] <= figures["bound_s"] < 5.0, figures  # not "dead:0"
    assert figures["reads"] >= 2, figures


def test_a_lighthouse_that_dies_is_named_and_the_state_is_kept():
    stopped: list[int] = []

    def scenario(e: dict[str, Any], c: Controls) -> None:
        if e["kind"] == "commit" and e["step"] >= 20 and not stopped:
            c.stop_lighthouse()
            stopped.append(e["step"])

    run = run_replicas(trainer, 2, min_replicas=2, on_event=scenario, timeout=300)
    for slot, value in enumerate(run.values):
        assert value["error"] is not None and value["error"].startswith("LighthouseGoneError"), (
            slot,
            value,
        )
        assert "the torchft lighthouse at http://127.0.0.1:" in value["error"], value
        assert "is gone" in value["error"] and "connect_timeout=5s" in value["error"], value
        assert value["waited"] < QUORUM_TIMEOUT / 2, value  # named, not timed out
        assert value["step"] >= 20, value
    assert stopped
    a, b = run.values
    assert (a["step"], a["state"]) == (b["step"], b["state"])  # the last commit, on both


def test_a_lighthouse_restarted_on_its_port_is_rejoined():
    marks: dict[str, int] = {}

    def scenario(e: dict[str, Any], c: Controls) -> None:
        if e["kind"] != "commit":
            return
        if "restarted" not in marks and e["step"] >= 20:
            c.stop_lighthouse()
            c.restart_lighthouse()
            marks["restarted"] = e["step"]
            marks["seen"] = len(c.history)
        elif "restarted" in marks and "end" not in marks:
            after = {x["slot"] for x in c.history[marks["seen"] :] if x["kind"] == "commit"}
            if after == {0, 1}:  # both committed with the new lighthouse
                marks["end"] = e["step"] + 30
                c.finish_at(marks["end"])

    run = run_replicas(trainer, 2, min_replicas=2, on_event=scenario, timeout=300)
    assert "end" in marks, marks
    for slot, value in enumerate(run.values):
        assert value["error"] is None, (slot, value)
        assert value["step"] == marks["end"], (slot, value)
    assert run.values[0]["state"] == run.values[1]["state"]


def test_a_joiner_that_finds_nobody_is_told_so():
    def scenario(e: dict[str, Any], c: Controls) -> None:
        if e["kind"] == "commit" and e["step"] >= 10:
            c.finish_at(15)  # the others stop; the joiner starts once one has returned

    run = run_replicas(late_joiner, 3, min_replicas=2, on_event=scenario, timeout=300)
    assert [v["error"] for v in run.values[:2]] == [None, None], run.values
    joiner = run.values[2]
    assert joiner["error"] is not None and joiner["error"].startswith("NoPeersError"), joiner
    assert "no other replica group is left" in joiner["error"], joiner
    assert joiner["waited"] < QUORUM_TIMEOUT / 2 and joiner["step"] == 0, joiner
