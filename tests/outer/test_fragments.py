"""Fragments: contiguous, non-empty, balanced by bytes (optimal), and their sync schedule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distoptim.outer.fragments import FragmentSchedule, partition


def _best_max(sizes, parts):
    """Brute force: the smallest possible largest run over all splits into ``parts`` runs."""
    n = len(sizes)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.data())
def test_partition_is_contiguous_complete_and_optimal(sizes, data):
    parts = data.draw(st.integers(1, len(sizes)))
    runs = partition(sizes, parts)
    assert len(runs) == parts
    assert runs[0][0] == 0 and runs[-1][1] == len(sizes)
    assert all(a < b for a, b in runs)  # non-empty
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(runs))  # contiguous
    assert max(sum(sizes[a:b]) for a, b in runs) == _best_max(sizes, parts)


def test_partition_examples():
    assert partition([240, 48, 144, 24], 2) == [(0, 1), (1, 4)]
    assert partition([1, 1, 1, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition([5, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    assert partition([7], 1) == [(0, 1)]
    with pytest.raises(ValueError):
        partition([1, 2], 3)


def test_schedule_offsets_and_launch_steps():
    sched = FragmentSchedule([8, 8, 8, 8], fragments=4, sync_every=8, delay=1)
    assert [f.offset for f in sched.fragments] == [2, 4, 6, 8]
    launches = {t: f.index for t in range(1, 25) if (f := sched.launching_at(t)) is not None}
    assert launches == {
        2: 0,
        4: 1,
        6: 2,
        8: 3,
        10: 0,
        12: 1,
        14: 2,
        16: 3,
        18: 0,
        20: 1,
        22: 2,
        24: 3,
    }
    for t, p in launches.items():  # t ≡ (p + 1)·H/F (mod H)
        assert t % 8 == ((p + 1) * 2) % 8
    assert sched.in_flight_after(2)[0].index == 0 and sched.in_flight_after(2)[1] == 2
    assert sched.in_flight_after(3) is None
    assert sched.in_flight_after(1) is None


def test_plain_diloco_schedule():
    sched = FragmentSchedule([4, 4], fragments=1, sync_every=5, delay=0)
    assert [t for t in range(1, 16) if sched.launching_at(t)] == [5, 10, 15]
    assert all(sched.in_flight_after(t) is None for t in range(20))
