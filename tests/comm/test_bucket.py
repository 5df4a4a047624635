"""distoptim.comm bucket layout, packing, wire format, byte model and fingerprint (one process)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.fingerprint import digest
from distoptim.comm.stats import ring_allreduce_bytes


def _params(*specs: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dt, requires_grad=True) for n, dt in specs]


def test_plan_fills_in_reverse_order_per_dtype_under_the_cap() -> None:
    f32, f64 = torch.float32, torch.float64
    # 4-byte floats: caps of 40 bytes hold 10 elements
    params = _params((4, f32), (3, f64), (4, f32), (4, f32), (2, f64), (20, f32))
    plan = BucketPlan(params, cap_bytes=40)
    # reverse order: p5 (80 B > cap, alone), p4 f64, p3+p2 (32 B), p1 f64 joins p4, p0 new
    assert [b.members for b in plan.buckets] == [[5], [4, 1], [3, 2], [0]]
    assert [b.dtype for b in plan.buckets] == [f32, f64, f32, f32]
    assert plan.bucket_of == [3, 1, 2, 2, 1, 0]
    assert plan.buckets[2].offsets == [0, 4] and plan.buckets[2].numel == 8
    assert plan.buckets[1].size == 5 + 2  # gradients plus one presence flag per member


def test_first_bucket_cap_applies_once_per_dtype() -> None:
    params = _params(*[(4, torch.float32)] * 6)  # 16 B each
    plan = BucketPlan(params, cap_bytes=64, first_cap_bytes=16)
    assert [b.members for b in plan.buckets] == [[5], [4, 3, 2, 1], [0]]
    with pytest.raises(ValueError, match="cap_bytes"):
        BucketPlan(params, cap_bytes=0)


def test_pack_zero_fills_missing_grads_and_never_writes_the_inputs() -> None:
    params = _params((3, torch.float32), (2, torch.float32))
    plan = BucketPlan(params, cap_bytes=1 << 20)
    (bucket,) = plan.buckets
    assert bucket.members == [1, 0]
    g0 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)  # cast on the way in
    before = g0.clone()
    buf = bucket.new_buffer().fill_(7.0)
    bucket.pack(buf, [None, g0])
    assert buf.tolist() == [0.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0]
    assert torch.equal(g0, before)
    assert bucket.present(buf) == [False, True]
    views = bucket.views(buf)
    assert views[1].shape == (3,) and views[1].data_ptr() == buf[2:].data_ptr()
    persistent = bucket.persistent_buffer()
    assert bucket.persistent_buffer() is persistent  # allocated once, reused
    assert bucket.views(persistent) is bucket.views(persistent)


def test_pack_densifies_sparse_grads_and_names_a_wrong_shape() -> None:
    params = [torch.zeros(4, 2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    plan = BucketPlan(params, cap_bytes=1 << 20)
    (bucket,) = plan.buckets
    sparse = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 2), (4, 2), check_invariants=True)
    buf = bucket.new_buffer()
    bucket.pack(buf, [None, sparse])
    assert torch.equal(bucket.views(buf)[1], sparse.to_dense())
    bad = torch.zeros(5)
    with pytest.raises(ValueError, match=r"parameter 1 .* has shape \(5,\), but .* \(3,\)"):
        bucket.pack(buf, [bad, None])
    with pytest.raises(ValueError, match=r"has shape \(1,\)"):  # not even broadcast
        bucket.pack(buf, [torch.zeros(1), None])


def test_wire_format_parses_and_only_narrows_wide_floats() -> None:
    assert WireFormat.parse(None).dtype is None
    fp16 = WireFormat.parse("FP16")
    assert fp16.name == "fp16" and fp16.dtype is torch.float16
    assert fp16.wire_dtype(torch.float32) is torch.float16
    assert fp16.wire_dtype(torch.float64) is torch.float16
    assert fp16.wire_dtype(torch.bfloat16) is torch.bfloat16  # not wider: left alone
    assert fp16.wire_dtype(torch.complex64) is torch.complex64
    bf16 = WireFormat.parse("bf16")
    x = torch.tensor([1.0, 2.5])
    wire = bf16.encode(x)
    assert wire.dtype is torch.bfloat16
    out = torch.zeros(2)
    bf16.decode(wire * 2, out)
    assert out.tolist() == [2.0, 5.0]
    with pytest.raises(ValueError, match="allowed values are None, 'fp16', 'bf16'"):
        WireFormat.parse("int8")
    with pytest.raises(TypeError, match="compression must be"):
        WireFormat.parse(torch.float16)


def test_ring_bytes_and_fingerprint_sensitivity() -> None:
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 4) == 1500
    a = _params((3, torch.float32), (2, torch.float32))
    same = _params((3, torch.float32), (2, torch.float32))
    assert digest(a, {"k": 1}) == digest(same, {"k": 1})
    assert digest(a, {"k": 1}) != digest(a, {"k": 2})
    assert digest(a, {}) != digest(list(reversed(a)), {})
    assert digest(a, {}) != digest(_params((3, torch.float64), (2, torch.float32)), {})
    frozen = _params((3, torch.float32), (2, torch.float32))
    frozen[0].requires_grad_(False)
    assert digest(a, {}) != digest(frozen, {})


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(1, 40), st.sampled_from(["f32", "f64", "f16"])),
        min_size=1,
        max_size=25,
    ),
    cap=st.integers(1, 200),
    first=st.one_of(st.none(), st.integers(1, 200)),
)
def test_plan_invariants(sizes: list[tuple[int, str]], cap: int, first: int | None) -> None:
    dtypes = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16}
    params = _params(*[(n, dtypes[d]) for n, d in sizes])
    plan = BucketPlan(params, cap_bytes=cap, first_cap_bytes=first)
    seen = sorted(i for b in plan.buckets for i in b.members)
    assert seen == list(range(len(params)))  # every parameter exactly once
    first_of: dict[torch.dtype, int] = {}
    for b in plan.buckets:
        first_of.setdefault(b.dtype, b.index)
        assert b.members == sorted(b.members, reverse=True)  # ready (reverse) order
        assert all(params[i].dtype == b.dtype for i in b.members)
        limit = min(first, cap) if first is not None and first_of[b.dtype] == b.index else cap
        assert len(b.members) == 1 or b.payload_bytes <= limit
        offsets = [0]
        for i in b.members[:-1]:
            offsets.append(offsets[-1] + params[i].numel())
        assert b.offsets == offsets
        for i in b.members:
            assert plan.bucket_of[i] == b.index and b.members[plan.slot_of[i]] == i
    # buckets open in ready order: each bucket's first member precedes the next bucket's
    heads = [b.members[0] for b in plan.buckets]
    assert heads == sorted(heads, reverse=True)


def test_plan_follows_a_given_ready_order_and_rejects_a_bad_one() -> None:
    params = _params(*[(4, torch.float32)] * 4)  # 16 B each
    plan = BucketPlan(params, cap_bytes=32, order=[2, 0, 3, 1])
    assert plan.order == [2, 0, 3, 1]
    assert [b.members for b in plan.buckets] == [[2, 0], [3, 1]]
    with pytest.raises(ValueError, match=r"permutation of range\(4\)"):
        BucketPlan(params, cap_bytes=32, order=[0, 1, 1, 2])
