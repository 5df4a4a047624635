"""A quorum that never comes is named: a survivor whose only peer froze (stopped at a named
point of a round, and left so) raises ``QuorumTimeoutError`` at the end of its manager's
``quorum_timeout``, naming itself, the timeout and how many replica groups the lighthouse hears
from -- not torchft's bare ``TimeoutError: status: Cancelled``. Real replica processes around a
real torchft lighthouse; the freeze is injected (:mod:`distoptim.ft.inject`), not timed.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

from distoptim.ft import inject
from distoptim.ft.local import Controls, ReplicaContext, run_replicas
from tests.ft import workloads

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

QUORUM_TIMEOUT = 5.0
MAX_STEPS = 2_000  # a bound, in case the survivor never stops


def trainer(ctx: ReplicaContext) -> dict[str, Any]:
    """CrossShard SGD under a manager; slot 1 stops itself after its 5th quorum (and stays
    frozen: the scenario kills it once slot 0 returned). Slot 0's error comes back as text."""
    model, opt, manager = workloads.linear_cross_shard(
        ctx, min_replica_size=2, timeout=5, quorum_timeout=QUORUM_TIMEOUT, connect_timeout=5
    )
    if ctx.slot == 1:

        def freeze(point: str, role: str) -> None:
            ctx.log("inject", point=point, role=role)
            os.kill(os.getpid(), signal.SIGSTOP)

        inject.arm("after_quorum:contributor@5", action=freeze)
    ctx.wait_for_peers(240)
    g = torch.Generator().manual_seed(ctx.slot)
    error = None
    try:
        while opt.iterations < MAX_STEPS:
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).square().sum().backward()
            opt.step()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    manager.shutdown(wait=False)
    return {"error": error, "step": opt.iterations}


def test_a_survivor_whose_peers_never_come_back_is_told_so_by_name():
    frozen: list[int] = []

    def scenario(e: dict[str, Any], c: Controls) -> None:
        if e["kind"] == "inject":
            assert c.stop(e["slot"])  # stopped by itself: registered, left frozen
            frozen.append(e["slot"])
        elif e["kind"] == "returned" and e["slot"] == 0 and frozen:
            assert c.kill(frozen[0])  # the survivor gave up: the frozen one is not needed

    run = run_replicas(trainer, 2, min_replicas=2, on_event=scenario, timeout=300)
    assert frozen == [1], frozen
    survivor = run.values[0]
    error = survivor["error"]
    assert error is not None and error.startswith("QuorumTimeoutError: "), survivor
    assert "replica 'replica_0': no quorum formed within" in error, error
    assert f"quorum_timeout={QUORUM_TIMEOUT:g}s" in error, error
    assert "hears from 1 replica group(s), this one included" in error, error
    assert 4 <= survivor["step"] < MAX_STEPS, survivor  # it trained, then waited in vain
