"""sync/group_slices.py: each process of a group of full copies reduces its slice of a bucket;
the all-gather hands every process the whole bucket back (3 gloo ranks, uneven sizes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distoptim.comm.stats import CommStats
from distoptim.launch import spawn
from distoptim.sync.group_slices import GroupSlices

SIZES = (7, 2, 1, 9)  # fewer elements than processes too: empty slices
DTYPES = (torch.float32, torch.float32, torch.float64, torch.float32)


def _slices(rank: int, world: int) -> dict:
    slices = GroupSlices(dist.group.WORLD, rank, world)
    heads = [torch.zeros(n, dtype=d) for n, d in zip(SIZES, DTYPES)]
    owned = []
    for head in heads:
        part = slices.part(head)
        part.fill_(rank + 1)  # what this process "reduced": its slice only
        owned.append(part.numel())
    stats = CommStats()
    slices.gather(heads, stats)
    return {"heads": heads, "owned": owned, "sent": stats.bytes_sent}


def test_the_slices_partition_each_bucket_and_the_gather_returns_every_one():
    results = spawn(_slices, 3, timeout=120)
    for i, n in enumerate(SIZES):
        chunk = -(-n // 3)
        want = torch.tensor([1 + min(j // chunk, 2) for j in range(n)], dtype=DTYPES[i])
        for r in results:
            assert torch.equal(r["heads"][i], want), (i, r["heads"][i], want)
        assert sum(r["owned"][i] for r in results) == n  # every element reduced once
    assert all(r["sent"] > 0 for r in results)


def test_group_slices_checks_its_place():
    with pytest.raises(ValueError, match=r"needs size >= 2"):
        GroupSlices(None, 0, 1)
    with pytest.raises(ValueError, match=r"rank 3 of a group of 2"):
        GroupSlices(None, 3, 2)
    slices = GroupSlices(None, 1, 2)
    assert slices.part(torch.arange(5.0)).tolist() == [3.0, 4.0]
    assert slices.part(torch.arange(1.0)).numel() == 0
