"""The DDP habit ``if rank == 0: opt.state_dict()`` with weight-update sharding: loud at once.

With ``shard_optimizer_state=True`` each rank holds ``1/n`` of the optimizer state. As torch's
``ZeroRedundancyOptimizer``, ``state_dict()`` runs no collective: the state is gathered by
``consolidate_state_dict(to=...)`` on every rank first. Two gloo ranks check, every rank's
outcome recorded:

* rank 0 alone calls ``state_dict()`` while its peer is in ``dist.barrier()``, in ``step()``,
  or runs nothing: rank 0 gets a ``RuntimeError`` naming ``consolidate_state_dict`` without
  launching a collective, and the peer's call completes as if nothing happened (the group is
  still paired: both ranks then step together and stay bitwise equal);
* ``consolidate_state_dict(to=0)`` on every rank, then ``state_dict()`` on rank 0 (then a
  barrier): the state equals an unsharded optimizer's bitwise; rank 1's ``state_dict()`` is
  refused (it did not receive it), and so is rank 0's after a further ``step()``;
  ``to=None`` gives every rank the same full state.

Before this design the first case waited for the process group's timeout (300 s by default;
here the spawn's 120 s bound would end it).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distoptim import CrossShardOptimizer
from distoptim.launch import spawn


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _optimizer(model: nn.Module, shard: bool) -> CrossShardOptimizer:
    return CrossShardOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.01),
        shard_optimizer_state=shard,
        bucket_cap_mb=0.001,  # several buckets: the parameters split between the ranks
    )


def _step(opt: CrossShardOptimizer, model: nn.Module, rank: int, it: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + it)
    x, y = torch.randn(5, 6, generator=g).double(), torch.randn(5, 3, generator=g).double()
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _lone_state_dict(opt: CrossShardOptimizer) -> dict[str, Any]:
    """Rank 0's ``state_dict()``: its error, and the collectives it launched (none)."""
    before = opt.comm_stats.collectives
    try:
        opt.state_dict()
        outcome: dict[str, Any] = {"error": None}
    except RuntimeError as exc:
        outcome = {"error": str(exc)}
    outcome["collectives"] = opt.comm_stats.collectives - before
    return outcome


def _bundle(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model()
    opt = _optimizer(model, shard=True)
    it = 0
    for _ in range(2):
        _step(opt, model, rank, it)
        it += 1
    # the habit: rank 0 saves, then every rank meets at a barrier (or steps, or does nothing)
    for peer in ("barrier", "step", "nothing"):
        if rank == 0:
            out[f"{peer}/rank0"] = _lone_state_dict(opt)
        if peer == "barrier":
            dist.barrier()
            out["barrier/peer"] = "returned"
        elif peer == "step":  # rank 1 steps; rank 0, refused, steps too
            _step(opt, model, rank, it)
            it += 1
            out["step/peer"] = "stepped"
    # the group is still paired and the replicas equal
    _step(opt, model, rank, it)
    it += 1
    flats = [torch.empty_like(_flat(model)) for _ in range(world)]
    dist.all_gather(flats, _flat(model))
    out["replicas_equal"] = all(torch.equal(f, flats[0]) for f in flats)

    # the protocol: consolidate on every rank, state_dict() on rank 0, then a barrier
    plain_model = _model()
    plain = _optimizer(plain_model, shard=False)
    model = _model()
    opt = _optimizer(model, shard=True)
    for k in range(3):
        _step(plain, plain_model, rank, k)
        _step(opt, model, rank, k)
    out["params_equal"] = torch.equal(_flat(model), _flat(plain_model))
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        out["consolidated"] = opt.state_dict()
        out["consolidated/again"] = opt.state_dict()
    else:
        out["consolidated/rank1"] = _lone_state_dict(opt)
    dist.barrier()
    out["plain"] = copy.deepcopy(plain.state_dict())  # later steps update it in place
    opt.consolidate_state_dict(to=None)
    out["everyone"] = copy.deepcopy(opt.state_dict())
    _step(opt, model, rank, 3)
    _step(plain, plain_model, rank, 3)
    out["stale"] = _lone_state_dict(opt)
    return out


@pytest.fixture(scope="module")
def bundle() -> list[dict[str, Any]]:
    return spawn(_bundle, 2, timeout=120)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peer", ["barrier", "step", "nothing"])
def test_state_dict_on_rank0_alone_is_refused_at_once_whatever_the_peer_runs(
    bundle: list[dict[str, Any]], peer: str
) -> None:
    rank0 = bundle[0][f"{peer}/rank0"]
    assert rank0["error"] is not None and rank0["collectives"] == 0, rank0
    assert "consolidate_state_dict(to=0) on every rank first" in rank0["error"]
    assert "rank 0 of the group holds only its 1/2 of the optimizer state" in rank0["error"]
    if peer == "barrier":
        assert bundle[1]["barrier/peer"] == "returned"
    if peer == "step":
        assert bundle[1]["step/peer"] == "stepped"
    assert f"{peer}/rank0" not in bundle[1]  # rank 1 never called state_dict() here
    for out in bundle:
        assert out["replicas_equal"]


@pytest.mark.timeout(300)
def test_consolidated_state_dict_equals_the_unsharded_state(
    bundle: list[dict[str, Any]],
) -> None:
    rank0, rank1 = bundle
    for out in bundle:
        assert out["params_equal"]
    assert _same(rank0["consolidated"], rank0["plain"])
    assert _same(rank0["consolidated/again"], rank0["plain"])
    refused = rank1["consolidated/rank1"]
    assert refused["collectives"] == 0 and refused["error"] is not None
    assert "the state was consolidated to rank 0 of the group, not to it" in refused["error"]
    for out in bundle:  # to=None: every rank holds it
        assert _same(out["everyone"], out["plain"])
        assert _same(out["everyone"], rank0["plain"])


@pytest.mark.timeout(300)
def test_a_consolidated_state_is_refused_after_a_further_step(
    bundle: list[dict[str, Any]],
) -> None:
    for out in bundle:
        stale = out["stale"]
        assert stale["collectives"] == 0 and stale["error"] is not None
        assert "no consolidate_state_dict() call since its last step or load" in stale["error"]
