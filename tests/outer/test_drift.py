"""DiLoCo when one replica's parameters drift from the others mid-run, and absurd bucket caps.

* A parameter frozen (``requires_grad_(False)``) on one replica only, between two syncs, or a
  parameter replaced in that replica's inner optimizer: ``ParameterMismatchError`` (a
  ``DesyncError``) on every replica at the next sync, naming the parameter -- the plan
  fingerprint of the sync header follows the parameters as they are, as CrossShardOptimizer's
  rounds do. Frozen on every replica alike, training goes on (the replicas agree).
* ``bucket_cap_mb`` outside ``(0, 1 TiB]`` (``1e303``, ``inf``, ``0``) is a ``ValueError``
  naming the option at construction, the same range and wording as CrossShardOptimizer's.

One 2-rank spawn runs the multi-rank cases; each case builds its own optimizer, and a case that
raises leaves the ranks paired (they raised in the same header), which the next case shows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from distoptim import CrossShardOptimizer, DiLoCo
from distoptim.comm.guard import DesyncError, ParameterMismatchError
from distoptim.launch import spawn

SYNC_EVERY = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _diloco(model: nn.Module) -> DiLoCo:
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return DiLoCo(inner, outer, sync_every=SYNC_EVERY)


def _step(opt: DiLoCo, model: nn.Module, rank: int, it: int) -> None:
    g = torch.Generator().manual_seed(10 * rank + it)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _case(rank: int, change: str, who: tuple[int, ...]) -> dict[str, Any]:
    """Train to a sync, apply ``change`` on the ranks ``who`` after step 1 of the next
    period, and record what the next sync does on this rank."""
    model = _model()
    opt = _diloco(model)
    out: dict[str, Any] = {"error": None}
    try:
        for it in range(2 * SYNC_EVERY):
            if it == SYNC_EVERY + 1 and rank in who:
                if change == "freeze":
                    model[2].weight.requires_grad_(False)
                else:  # a parameter replaced in the inner optimizer (same shape and values)
                    group = opt.wrapped.param_groups[0]
                    group["params"][2] = nn.Parameter(group["params"][2].detach().clone())
            _step(opt, model, rank, it)
    except DesyncError as exc:
        out = {"error": type(exc).__name__, "message": str(exc), "desync": True}
    out["syncs"] = opt.syncs
    out["iterations"] = opt.iterations
    return out


def _bundle(rank: int, world: int) -> dict[str, Any]:
    return {
        "freeze_on_rank1": _case(rank, "freeze", (1,)),
        "replace_on_rank1": _case(rank, "replace", (1,)),
        "freeze_on_both": _case(rank, "freeze", (0, 1)),
    }


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn(_bundle, 2, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("freeze_on_rank1", "(2, 8) torch.float32 frozen"),
        ("replace_on_rank1", "(2, 8) torch.float32 replaced"),
    ],
)
def test_a_parameter_changed_on_one_replica_is_refused_on_every_replica(
    two_ranks: list[dict[str, Any]], case: str, says: str
) -> None:
    for rank, out in enumerate(two_ranks):
        o = out[case]
        assert o["error"] == ParameterMismatchError.__name__, (rank, o)
        assert o["iterations"] == 2 * SYNC_EVERY - 1  # raised in the sync of step 2H
        assert o["syncs"] == 1  # the first sync stood
        assert "parameters" in o["message"], o["message"]
    assert two_ranks[0][case]["message"] == two_ranks[1][case]["message"]
    assert says in two_ranks[0][case]["message"], two_ranks[0][case]["message"]


@pytest.mark.timeout(300)
def test_a_parameter_frozen_on_every_replica_trains_on(two_ranks: list[dict[str, Any]]) -> None:
    for out in two_ranks:
        o = out["freeze_on_both"]
        assert o["error"] is None, o
        assert o["syncs"] == 2 and o["iterations"] == 2 * SYNC_EVERY


@pytest.mark.parametrize("cap", [1e303, float("inf"), 0, -1, 2.0**20 + 1])
def test_an_absurd_bucket_cap_is_named_as_in_cross_shard(cap: float) -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ValueError, match="bucket_cap_mb") as mine:
        DiLoCo(inner, outer, sync_every=2, bucket_cap_mb=cap)
    with pytest.raises(ValueError) as theirs:  # refused before it looks for a process group
        CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=cap)
    assert str(mine.value) == str(theirs.value)
    assert "(0, 1048576]" in str(mine.value)


def test_the_largest_bucket_cap_is_accepted() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    assert DiLoCo(inner, outer, sync_every=2, bucket_cap_mb=2.0**20).bucket_cap_mb == 2.0**20
