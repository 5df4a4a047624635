"""Flat shard layout, reduce-scatter rounds and the control message (one process, no group)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.shard import ShardLayout
from distoptim.comm.shard_reducer import BucketReduceScatter, ControlReduce, ShardRound
from distoptim.comm.shard_transport import NativeTransport
from distoptim.comm.stats import CommStats, ring_allreduce_bytes, ring_half_bytes


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype, requires_grad=True) for n in sizes]


def _solo() -> NativeTransport:
    return NativeTransport(None, 1, 0, [0])


def test_padding_makes_equal_shards_and_pieces_follow_the_members() -> None:
    plan = BucketPlan(_params(3, 5, 2), cap_bytes=1 << 20, pad_to=4, flags=False)
    (bucket,) = plan.buckets
    assert bucket.members == [2, 1, 0] and bucket.numel == 10 and bucket.pad == 2
    assert bucket.padded == 12 and bucket.size == 12  # no flags, no trailer
    layouts = [ShardLayout(plan, 4, r) for r in range(4)]
    assert [lay.shard_size for lay in layouts] == [[3]] * 4
    # member 2 (2 elements) at [0, 2), member 1 at [2, 7), member 0 at [7, 10), pad [10, 12)
    as_tuples = [[(p.member, p.start, p.stop, p.first) for p in lay.pieces[0]] for lay in layouts]
    assert as_tuples == [
        [(2, 0, 2, 0), (1, 2, 3, 0)],
        [(1, 3, 6, 1)],
        [(1, 6, 7, 4), (0, 7, 9, 0)],
        [(0, 9, 10, 2)],  # the rest of rank 3's range is padding
    ]
    assert [lay.owned() for lay in layouts] == [3, 3, 3, 1]
    with pytest.raises(ValueError, match="pad_to=5"):
        ShardLayout(plan, 5, 0)
    with pytest.raises(ValueError, match="rank 4 outside"):
        ShardLayout(plan, 4, 4)
    with pytest.raises(ValueError, match="pad_to"):
        BucketPlan(_params(3), cap_bytes=8, pad_to=0)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    cap=st.integers(4, 200),
    n=st.integers(1, 5),
)
def test_every_element_belongs_to_exactly_one_piece(sizes: list[int], cap: int, n: int) -> None:
    plan = BucketPlan(_params(*sizes), cap_bytes=cap, pad_to=n, flags=False)
    ShardLayout.check(plan, n)
    for bucket in plan.buckets:
        assert bucket.padded % n == 0 and bucket.pad < n


def test_a_shard_round_reads_its_inputs_divides_its_shards_and_carries_the_flags() -> None:
    params = _params(3, 2)
    plan = BucketPlan(params, cap_bytes=1 << 20, pad_to=1, flags=False)
    layout = ShardLayout(plan, 1, 0)
    stats = CommStats()
    control = ControlReduce(plan, words=4, device=torch.device("cpu"), group=None,
                            group_size=1, stats=stats)  # fmt: skip
    grads = {0: torch.tensor([2.0, 4.0, 6.0]), 1: None}
    rnd = ShardRound(
        plan,
        BucketReduceScatter(_solo(), 1, WireFormat.parse(None), stats),
        layout,
        control,
        grads_of=lambda b: [grads[i] for i in b.members],
        buffer_of=lambda b: b.persistent_buffer(),
        divisor=2,
    )
    assert rnd.launchable == len(plan) and not rnd.reduces_in_place
    rnd.launch_next()  # nothing is held back: the words travel in the control message
    (shard,) = rnd.wait_all(lambda t: t.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0])))
    assert shard.tolist() == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert shard.data_ptr() != plan.buckets[0].persistent_buffer().data_ptr()  # the round's
    assert plan.buckets[0].persistent_buffer().tolist() == [0.0, 0.0, 2.0, 4.0, 6.0]  # only read
    assert rnd.present([shard]) == [True, False]
    assert rnd.trailer([shard]).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert rnd.inputs_unchanged()
    grads[0].mul_(2.0)
    assert not rnd.inputs_unchanged()
    assert stats.collectives == 0  # one shard: nothing on the wire


def test_a_16_bit_wire_divides_before_the_sum() -> None:
    plan = BucketPlan(_params(4), cap_bytes=1 << 20, flags=False)
    (bucket,) = plan.buckets
    reducer = BucketReduceScatter(_solo(), 1, WireFormat.parse("fp16"), CommStats())
    buffer = torch.tensor([60000.0, 2.0, 4.0, 8.0])
    out = torch.empty(4)
    pending = reducer.launch(bucket, buffer, out, 4)
    assert pending.wire_out.dtype == torch.float16 and pending.divisor == 1
    assert reducer.finish(pending).tolist() == [15000.0, 0.5, 1.0, 2.0]
    assert buffer.tolist() == [60000.0, 2.0, 4.0, 8.0]


def test_the_byte_model_of_sharding_moves_what_one_all_reduce_moves() -> None:
    for n in (1, 2, 3, 8):
        assert 2 * ring_half_bytes(8000, n) == ring_allreduce_bytes(8000, n)
