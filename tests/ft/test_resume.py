"""Checkpoint and resume of a fault-tolerant DiLoCo, with real replica groups and lighthouse.

Two replica groups train a managed DiLoCo (H = 8) around a real torchft lighthouse; each saves
its own ``state_dict()`` (model, inner optimizer, DiLoCo) after a committed sync and trains on.
A second run -- new processes, a new lighthouse, a new manager of the same replica id, a
freshly built DiLoCo -- loads those checkpoints and trains to the same step. The resumed run
must end bit for bit where the uninterrupted one did, on every replica: with a lossy wire
that includes the error-feedback residuals the checkpoint carries (a fresh managed optimizer
has not met its quorum yet, so its residual layout is restored when it does).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from distoptim import DiLoCo
from distoptim.comm.checksum import state_checksum
from distoptim.ft.data import SlotShards
from distoptim.ft.local import ReplicaContext, run_replicas
from distoptim.ft.replica import make_manager

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

SAVE_AT, END = 16, 32  # inner steps: the checkpoint after the 2nd sync, the end after the 4th
_N, _DIM, _CLASSES, _BATCH = 256, 8, 3, 8


def _build(ctx: ReplicaContext, wire: str) -> tuple[torch.nn.Module, Any, DiLoCo, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(_DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, _CLASSES)
    )
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = make_manager(
        ctx.lighthouse,
        replica_id=ctx.replica_id,
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        load_state_dict=lambda s: None,  # nobody heals in these runs
        min_replica_size=2,  # every sync has both groups: the runs are comparable
        timeout=30,
        quorum_timeout=120,
        connect_timeout=30,
        init_sync=False,
    )
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = DiLoCo(inner, outer, sync_every=8, wire=wire, manager=manager)
    return model, inner, opt, manager


def _train(ctx: ReplicaContext, model: Any, opt: DiLoCo, until: int) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(_N, _DIM, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    shards = SlotShards(_N, ctx.num_slots, ctx.slot, _BATCH, seed=3)
    while opt.iterations < until:
        idx = shards.batch(opt.iterations)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()


def _result(model: Any, opt: DiLoCo) -> dict[str, Any]:
    return {
        "step": opt.iterations,
        "syncs": opt.syncs,
        "global": state_checksum(list(opt.global_parameters)),
        "model": state_checksum(list(model.parameters())),
        "commits": opt.replica_stats.commits,
    }


def uninterrupted(ctx: ReplicaContext, wire: str, folder: str) -> dict[str, Any]:
    """Train to ``END``, saving this group's checkpoint at ``SAVE_AT`` on the way."""
    model, inner, opt, manager = _build(ctx, wire)
    ctx.wait_for_peers(240)
    _train(ctx, model, opt, SAVE_AT)
    checkpoint = {"model": model.state_dict(), "inner": inner.state_dict(), "opt": opt.state_dict()}
    torch.save(checkpoint, os.path.join(folder, f"{ctx.replica_id}.pt"))
    _train(ctx, model, opt, END)
    manager.shutdown(wait=False)
    return _result(model, opt)


def resumed(ctx: ReplicaContext, wire: str, folder: str) -> dict[str, Any]:
    """A fresh group of the same replica id: load its checkpoint, train to ``END``."""
    model, inner, opt, manager = _build(ctx, wire)
    checkpoint = torch.load(os.path.join(folder, f"{ctx.replica_id}.pt"), weights_only=False)
    model.load_state_dict(checkpoint["model"])
    inner.load_state_dict(checkpoint["inner"])
    opt.load_state_dict(checkpoint["opt"])
    loaded_at = opt.iterations
    ctx.wait_for_peers(240)
    _train(ctx, model, opt, END)
    manager.shutdown(wait=False)
    return {**_result(model, opt), "loaded_at": loaded_at}


@pytest.mark.parametrize("wire", ["int8", "topk:0.25"])
def test_managed_diloco_resumes_bit_for_bit_with_a_lossy_wire(tmp_path, wire):
    whole = run_replicas(uninterrupted, 2, args=(wire, str(tmp_path)), min_replicas=2, timeout=300)
    again = run_replicas(resumed, 2, args=(wire, str(tmp_path)), min_replicas=2, timeout=300)
    for slot, (a, b) in enumerate(zip(whole.values, again.values)):
        assert a["step"] == b["step"] == END and a["syncs"] == END // 8, (slot, a, b)
        assert b["loaded_at"] == SAVE_AT and b["commits"] == (END - SAVE_AT) // 8, (slot, b)
        assert (b["global"], b["model"]) == (a["global"], a["model"]), (slot, a, b)
    assert whole.values[0]["global"] == whole.values[1]["global"]  # the replicas agree
