"""The bitwise state checksum on one process: its definition, what it always detects, slices.

:func:`reference` recomputes the documented definition in plain Python (bytes -> 16-bit
limbs -> two polynomial sums mod ``2**31 - 1``) so the torch implementation is pinned to the
docstring's formula, across chunk boundaries and mixed dtypes. The sensitivity tests flip every
bit of every element and swap every pair of elements, per dtype; the device test runs the whole
computation on the ``meta`` device (tensors without data: any read back to the host would raise).
"""

from __future__ import annotations

import gc
import itertools
import struct
import sys
import zlib

import pytest
import torch

from distoptim.comm import checksum
from distoptim.comm.checksum import ROOTS, ROW, P, state_checksum

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), (n,), generator=g).to(dtype)


def reference(tensors: list[torch.Tensor], part: int = 0, parts: int = 1) -> int:
    """The module docstring's definition, in plain Python."""
    limbs: list[int] = []
    for t in tensors:
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8).tolist()
        if t.element_size() == 1:
            limbs += raw
        else:
            order = "<" if sys.byteorder == "little" else ">"
            limbs += list(struct.unpack(f"{order}{len(raw) // 2}h", bytes(raw)))
    rows = -(-len(limbs) // ROW)
    begin, end = rows * part // parts * ROW, rows * (part + 1) // parts * ROW
    sums = [0, 0]
    for n in range(begin, min(end, len(limbs))):
        c, j = n % 2, n // 2
        sums[c] = (sums[c] + pow(ROOTS[c], j, P) * limbs[n]) % P
    header = "".join(f"{t.dtype}{tuple(t.shape)};" for t in tensors)
    if parts > 1:
        header += f"part {part}/{parts};"
    return ((sums[0] << 31) | sums[1]) ^ (zlib.crc32(header.encode()) << 32)


def test_matches_its_definition_across_chunks_and_dtypes():
    chunk = checksum._chunk_limbs(torch.device("cpu"))
    # a float32 tensor spanning two chunk boundaries, then tensors of every dtype (odd lengths:
    # later tensors start at odd limbs, and a chunk ends inside a tensor)
    tensors = [sample(torch.float32, chunk + 37, 1)]
    tensors += [sample(d, 13 + i, i) for i, d in enumerate(DTYPES)]
    tensors.append(sample(torch.float32, 7 * 4683, 2).view(7, -1)[:, 1:])  # non-contiguous
    assert state_checksum(tensors) == reference(tensors)
    for part, parts in ((0, 3), (1, 3), (2, 3), (5, 7)):
        assert state_checksum(tensors, part, parts) == reference(tensors, part, parts)
    assert 0 <= state_checksum(tensors) < 2**64


def test_slices_sum_to_the_whole():
    tensors = [sample(torch.float32, 50_000), sample(torch.bfloat16, 999)]
    for parts in (1, 2, 5, 64, 3000):  # more slices than rows: some are empty
        sums = [checksum._sums(tensors, k, parts) for k in range(parts)]
        total = tuple(sum(s[c] for s in sums) % P for c in range(2))
        assert total == checksum._sums(tensors)
    assert state_checksum(tensors, 0, 2) != state_checksum(tensors, 1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_single_bit_flip_is_detected(dtype):
    x = sample(dtype, 9)
    base = state_checksum([x])
    raw = x.view(torch.uint8).reshape(-1)
    for byte, bit in itertools.product(range(raw.numel()), range(8)):
        y = raw.clone()
        y[byte] ^= 1 << bit
        flipped = y.view(dtype).reshape(x.shape)
        assert state_checksum([flipped]) != base, (byte, bit)


def test_a_bit_flip_deep_in_a_large_state_is_detected():
    state = [sample(torch.float32, 300_000), sample(torch.float64, 70_001)]
    base = state_checksum(state)
    for t, index, bit in ((0, 0, 0), (0, 299_999, 31), (1, 35_000, 63), (1, 70_000, 17)):
        other = [s.clone() for s in state]
        bits = other[t].view(torch.int32 if t == 0 else torch.int64)
        bits[index] ^= 1 << bit if bit < 63 else -(1 << 63)
        assert state_checksum(other) != base


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_swap_of_two_unequal_elements_is_detected(dtype):
    x = sample(dtype, 24, 3)
    base = state_checksum([x])
    bits = x.view(torch.uint8).reshape(24, -1)
    for i, k in itertools.combinations(range(24), 2):
        if torch.equal(bits[i], bits[k]):
            continue
        y = x.clone()
        y[i], y[k] = x[k], x[i]
        assert state_checksum([y]) != base, (i, k)


def test_swaps_far_apart_and_across_tensors_are_detected():
    a, b = sample(torch.float32, 200_000, 4), sample(torch.float32, 1_000, 5)
    base = state_checksum([a, b])
    y = a.clone()
    y[3], y[199_998] = a[199_998], a[3]
    assert state_checksum([y, b]) != base
    y, z = a.clone(), b.clone()
    y[10], z[10] = b[10], a[10]
    assert state_checksum([y, z]) != base
    assert state_checksum([b, a]) != state_checksum([a, b])  # the order of the tensors counts


def test_zero_size_tensors_count_by_their_shape():
    words = {
        state_checksum([]),
        state_checksum([torch.empty(0)]),
        state_checksum([torch.empty(0, 3)]),
        state_checksum([torch.empty(3, 0)]),
        state_checksum([torch.empty(0, dtype=torch.float16)]),
        state_checksum([torch.empty(0), torch.empty(0)]),
    }
    assert len(words) == 6
    x = torch.randn(5)
    assert state_checksum([x, torch.empty(0)]) != state_checksum([x])
    assert state_checksum([x, torch.empty(0)]) == reference([x, torch.empty(0)])


def test_bitwise_not_numerically_equal():
    assert state_checksum([torch.tensor([0.0])]) != state_checksum([torch.tensor([-0.0])])
    nan = torch.tensor([float("nan")])
    other_nan = nan.view(torch.int32).bitwise_xor(1).view(torch.float32)
    assert state_checksum([nan]) != state_checksum([other_nan])
    x = torch.zeros(4)
    assert state_checksum([x]) != state_checksum([x.view(2, 2)])
    assert state_checksum([x]) != state_checksum([x.view(torch.int32)])


def test_deterministic_across_layouts_calls_and_threads():
    x = sample(torch.float32, 120_000).view(300, 400)
    word = state_checksum([x.t()])  # reads the logical row-major order
    assert word == state_checksum([x.t().contiguous()])
    assert word == state_checksum([x.t().contiguous()])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert state_checksum([x.t()]) == word
    finally:
        torch.set_num_threads(threads)
    # pinned: the definition does not drift between versions (replicas of one job may mix)
    assert state_checksum([torch.arange(10, dtype=torch.float32)]) == reference(
        [torch.arange(10, dtype=torch.float32)]
    )
    assert state_checksum([torch.arange(10, dtype=torch.float32)]) == 0xD56AB67F48F7A53F


def test_runs_on_the_tensors_device_without_reading_data_back():
    # meta tensors hold no data: a .cpu(), .numpy(), .item() or .tolist() of one would raise
    tensors = [torch.empty(70_000, device="meta"), torch.empty(33, dtype=torch.bfloat16,
                                                                 device="meta")]  # fmt: skip
    acc = checksum._device_sums(tensors, 0, 1)
    assert acc.device.type == "meta" and acc.shape == (2,) and acc.dtype == torch.int64
    acc = checksum._device_sums(tensors, 3, 4)
    assert acc.device.type == "meta"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_state_gives_the_cpu_word():
    tensors = [sample(torch.float32, 3_000_000), sample(torch.bfloat16, 4097)]
    on_gpu = [t.cuda() for t in tensors]
    assert state_checksum(on_gpu) == state_checksum(tensors)
    assert state_checksum(on_gpu, 2, 5) == state_checksum(tensors, 2, 5)


def test_refuses_bad_arguments():
    x = torch.randn(3)
    for part, parts in ((0, 0), (1, 1), (-1, 2), (0, 1.5), (True, 2)):
        with pytest.raises(ValueError, match="part"):
            state_checksum([x], part, parts)
    with pytest.raises(TypeError, match="expected tensors"):
        state_checksum([x, [1.0]])
    with pytest.raises(ValueError, match="one device"):
        state_checksum([x, torch.empty(2, device="meta")])


def test_follows_a_tensor_whose_storage_or_values_change_between_calls():
    a, b = sample(torch.float32, 70_000, 6), sample(torch.float16, 33, 7)
    first = state_checksum([a, b])
    assert state_checksum([a, b]) == first  # the reused views read the same values
    a[69_999] += 1.0  # in place: the same storage, another value
    changed = state_checksum([a, b])
    assert changed != first and changed == reference([a, b])
    a.data = a.clone()  # another storage, equal values: the word follows the values
    assert state_checksum([a, b]) == changed
    a.data = torch.zeros_like(a)
    assert state_checksum([a, b]) == reference([a, b]) != changed
    a.data = torch.zeros(2, 35_000)  # another shape
    assert state_checksum([a, b]) == reference([a, b])


def test_reused_views_do_not_keep_a_dropped_state_alive():
    x = torch.randn(10_000)
    state_checksum([x])
    assert any(key == (id(x),) for key in checksum._views)
    key = (id(x),)
    del x
    gc.collect()
    assert key not in checksum._views
