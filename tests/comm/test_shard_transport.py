"""Sharding's transports: reduce-scatter and in-place all-gather, on 4 gloo ranks and subgroups.

The pairwise exchange (gloo's default for sharding) is checked bitwise against its documented
summation order, against gloo's own collectives and the all-reduce stand-in (up to rounding),
with several buckets in flight at once, in the full group (n = 4: the path with a temporary)
and in subgroups of 2 whose group ranks differ from the global ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from distoptim.comm.shard_transport import (
    AllReduceStandIn,
    NativeTransport,
    PairwiseExchange,
    ShardTransport,
    transport_for,
)
from distoptim.launch import spawn

SIZES = (12, 40, 4)  # three buckets in flight together (elements, multiples of 4 and 2)


def _regions(rank: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(size, generator=g, dtype=torch.float64) for size in SIZES]


def _check(kind: type[ShardTransport], group: Any, ranks: list[int]) -> dict[str, Any]:
    n, r = len(ranks), ranks.index(dist.get_rank())
    t = kind(group, n, r, ranks)
    mine = _regions(dist.get_rank(), n)
    every = [_regions(q, n) for q in ranks]  # every member's inputs, rebuilt locally
    inputs = [x.clone() for x in mine]
    launched = [
        t.reduce_scatter(x, torch.empty(x.numel() // n, dtype=x.dtype), b)
        for b, x in enumerate(mine)
    ]
    results = []
    for result, pending in launched:
        pending.wait()
        results.append(result)
    exact, close = True, True
    for b, (result, size) in enumerate(zip(results, SIZES)):
        s = size // n
        piece = [every[q][b][r * s : (r + 1) * s] for q in range(n)]
        ordered = piece[(r - 1) % n].clone()  # the pairwise order: r-1, r-2, ..., r+1, then r
        for k in range(2, n):
            ordered += piece[(r - k) % n]
        ordered += piece[r]
        exact &= torch.equal(result, ordered)
        close &= torch.allclose(result, sum(piece), rtol=1e-12, atol=1e-12)
    flats = [torch.full((size,), -1.0, dtype=torch.float64) for size in SIZES]
    for flat, size in zip(flats, SIZES):
        s = size // n
        flat[r * s : (r + 1) * s] = torch.arange(s, dtype=torch.float64) + 100 * r
    works = [t.all_gather(flat, b) for b, flat in enumerate(flats)]
    for work in works:
        work.wait()
    gathered = all(
        torch.equal(flat, torch.cat([torch.arange(size // n) + 100.0 * q for q in range(n)]))
        for flat, size in zip(flats, SIZES)
    )
    return {
        "exact": exact,
        "close": close,
        "input_kept": all(torch.equal(a, b) for a, b in zip(mine, inputs)),
        "gathered": gathered,
    }


def _transports(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    everyone = list(range(world))
    for kind in (PairwiseExchange, NativeTransport, AllReduceStandIn):
        out[kind.name] = _check(kind, None, everyone)
    halves = [[0, 2], [1, 3]]
    group, _ = dist.new_subgroups_by_enumeration(halves)
    mine = next(h for h in halves if rank in h)
    out["subgroup"] = _check(PairwiseExchange, group, mine)
    out["chosen"] = type(transport_for(None, world, rank, everyone)).__name__
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_transports_reduce_scatter_and_all_gather_in_place() -> None:
    for out in spawn(_transports, 4, timeout=180):
        assert out["chosen"] == "PairwiseExchange"  # gloo
        for key in ("pairwise", "subgroup"):
            assert out[key] == {
                "exact": True, "close": True, "input_kept": True, "gathered": True
            }, key  # fmt: skip
        assert out["native"]["close"] and out["native"]["input_kept"]
        assert out["native"]["gathered"]
        assert out["all_reduce"]["close"] and not out["all_reduce"]["input_kept"]
        assert out["all_reduce"]["gathered"]
