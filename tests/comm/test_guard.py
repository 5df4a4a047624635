"""The sequence guard's pieces on one process: words through a trailer, verdicts, pass counting.

The SUM all-reduce of the trailers is emulated by adding the ranks' trailers (what gloo/NCCL
compute), in the wire dtypes compression can choose, so the exactness claims are checked where
they matter. The multi-rank behaviour is in ``tests/test_desync.py``.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distoptim.comm.bucket import BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.guard import (
    CHUNKS,
    DesyncError,
    GuardCodec,
    GuardWords,
    ParameterMismatchError,
    RoundKind,
    check_round,
    plan_word,
)
from distoptim.comm.overlap import BackwardOverlap, PassCounter, sentinels
from distoptim.comm.reducer import BucketAllReduce, ReduceRound
from distoptim.comm.stats import CommStats


def _words(**kw: object) -> GuardWords:
    base = {"kind": RoundKind.STEP, "step": 7, "passes": 1, "plan": 0xABCDEF012345, "params": 4}
    base.update(kw)
    return GuardWords(**base)  # type: ignore[arg-type]


def _reduce(rows: list[GuardWords], dtype: torch.dtype, wire: str | None) -> list[GuardWords]:
    """What every rank reads after the SUM all-reduce of each rank's trailer."""
    n = len(rows)
    codecs = [GuardCodec(n, r, list(range(10, 10 + n))) for r in range(n)]
    fmt = WireFormat.parse(wire)
    total = None
    for codec, words in zip(codecs, rows):
        trailer = torch.full((codec.size,), 99.0, dtype=dtype)  # write() must zero it
        codec.write(trailer, words)
        sent = fmt.encode(trailer)
        total = sent.clone() if total is None else total + sent
    out = torch.empty(codecs[0].size, dtype=dtype)
    fmt.decode(total, out)
    tables = [c.read(out) for c in codecs]
    assert all(t == tables[0] for t in tables)
    return tables[0]


@pytest.mark.parametrize(
    ("dtype", "wire"),
    [
        (torch.float32, None),
        (torch.float64, None),
        (torch.float32, "bf16"),
        (torch.float64, "fp16"),
        (torch.bfloat16, None),
        (torch.float16, None),
        (torch.complex64, None),
    ],
)
def test_words_survive_the_sum_in_every_wire_dtype(dtype: torch.dtype, wire: str | None) -> None:
    rows = [
        _words(step=(1 << 40) - 1, passes=0, edited=True),
        _words(kind=RoundKind.FINISH, step=3, passes=2, plan=(1 << 48) - 1, params=0),
        _words(kind=RoundKind.REPAIR, step=0, passes=65535, plan=0, replanned=True),
    ]
    assert _reduce(rows, dtype, wire) == rows


def test_wide_values_saturate_and_negative_ones_are_refused() -> None:
    (row,) = _reduce([_words(step=1 << 50, passes=1 << 20, params=1 << 30)], torch.float32, None)
    assert (row.step, row.passes, row.params) == ((1 << 40) - 1, 65535, (1 << 24) - 1)
    with pytest.raises(ValueError, match="must be >= 0"):
        GuardCodec(1, 0, [0]).write(torch.zeros(CHUNKS), _words(step=-1))
    with pytest.raises(ValueError, match="do not fit"):
        GuardCodec(2, 2, [0, 1])


def test_a_trailer_that_is_not_whole_chunks_means_mispaired_collectives() -> None:
    codec = GuardCodec(2, 0, [0, 1])
    t = torch.zeros(codec.size)
    codec.write(t, _words())
    with pytest.raises(DesyncError, match="did not pair"):
        codec.read(t * 0.5 + 0.25)  # e.g. summed with a gradient bucket
    bad_kind = torch.zeros(codec.size)
    with pytest.raises(DesyncError, match="not valid"):
        codec.read(bad_kind)  # kind 0: no rank wrote here


def test_verdicts_are_deterministic_in_the_table() -> None:
    same = [_words(), _words()]
    v = check_round(same, [0, 1])
    assert not v.repeat
    v = check_round([_words(edited=True), _words()], [0, 1])
    assert v.edited and v.repeat and not v.replanned
    v = check_round([_words(), _words(replanned=True)], [0, 1])
    assert v.replanned and v.repeat
    with pytest.raises(ParameterMismatchError, match=r"(?s)rank 3: step.*rank 5:") as info:
        check_round([_words(), _words(plan=1)], [3, 5])
    assert len(info.value.table) == 2
    cases = [
        (_words(passes=2), "an extra backward"),
        (_words(step=8), "step counters differ"),
        (_words(kind=RoundKind.FINISH), "finish"),
        (_words(kind=RoundKind.PAIRS), "different operations"),
    ]
    for other, diagnosis in cases:
        with pytest.raises(DesyncError, match=diagnosis) as info:
            check_round([_words(), other], [0, 1])
        assert not isinstance(info.value, ParameterMismatchError)
        assert "no update was applied" in str(info.value)


def test_every_flag_and_the_hyperparameter_word_survive_the_sum() -> None:
    rows = [
        _words(hyper=(1 << 32) - 1, uncounted=True, passes=0, local_edit=True),
        _words(kind=RoundKind.STATE, foreign=True, replanned=True, hyper=0),
        _words(kind=RoundKind.SYNC, edited=True, hyper=12345),
        _words(kind=RoundKind.SLOTS),
    ]
    assert _reduce(rows, torch.bfloat16, None) == rows


def test_an_uncounted_pass_agrees_with_any_count_of_one_or_more() -> None:
    unseen = _words(passes=0, uncounted=True)
    assert not check_round([unseen, _words(passes=1)], [0, 1]).repeat
    assert not check_round([unseen, _words(passes=2), _words(passes=2)], [0, 1, 2]).repeat
    assert not check_round([unseen, unseen], [0, 1]).repeat
    for other in (_words(passes=0), [_words(passes=1), _words(passes=2)]):
        others = other if isinstance(other, list) else [other]
        with pytest.raises(DesyncError, match="backward passes since the last step"):
            check_round([unseen, *others], list(range(1 + len(others))))


def test_different_hyperparameters_are_a_desync_naming_the_sides() -> None:
    with pytest.raises(DesyncError, match=r"ranks \[3, 7\] / ranks \[5\]") as info:
        check_round(
            [_words(hyper=1), _words(hyper=2), _words(hyper=1)],
            [3, 5, 7],
            explain_hyperparameters=lambda: "group 0: lr: rank 3 0.1, rank 5 0.2",
        )
    assert not isinstance(info.value, ParameterMismatchError)
    assert "LR scheduler stepped on some ranks only" in str(info.value)
    assert str(info.value).endswith("group 0: lr: rank 3 0.1, rank 5 0.2")


def test_collective_calls_on_some_ranks_are_named() -> None:
    cases = [
        (
            RoundKind.STATE,
            "consolidate_state_dict() called on rank(s) [1] only while the others are in step()",
        ),
        (RoundKind.SLOTS, "get_slot()/get_slot_names()/variables() called on rank(s) [1] only"),
        (RoundKind.FINISH, "finish() called on rank(s) [1] only"),
        (RoundKind.SYNC, "synchronize() called on rank(s) [1] only"),
    ]
    for kind, text in cases:
        with pytest.raises(DesyncError, match=re.escape(text)):
            check_round([_words(), _words(kind=kind)], [0, 1])


def test_informative_marks_name_their_ranks_without_a_repeat() -> None:
    v = check_round([_words(local_edit=True), _words(foreign=True), _words()], [4, 5, 6])
    assert not v.repeat and v.local_edits == (4,) and v.foreign == (5,)


def test_plan_word_is_48_bits_of_the_digest() -> None:
    assert plan_word(bytes(range(32))) == int.from_bytes(bytes(range(6)), "little")
    assert plan_word(b"\xff" * 32) == (1 << 48) - 1


# ---- the trailer in the bucket layout ---------------------------------------------------------
def _params(*sizes: int) -> list[torch.Tensor]:
    return [torch.zeros(n, requires_grad=True) for n in sizes]


def test_the_trailer_sits_in_the_last_bucket_after_the_flags() -> None:
    params = _params(3, 2, 4)
    plan = BucketPlan(params, cap_bytes=16, trailer=5)
    assert [b.trailer for b in plan.buckets] == [0] * (len(plan) - 1) + [5]
    last = plan.buckets[-1]
    assert last.size == last.numel + len(last.members) + 5 and last.head == last.size - 5
    buf = last.new_buffer().fill_(7.0)
    last.pack(buf, [torch.ones(p.numel()) for p in (params[i] for i in last.members)])
    assert last.trailer_of(buf).tolist() == [7.0] * 5  # pack leaves the trailer alone
    assert last.present(buf) == [True] * len(last.members)
    empty = BucketPlan([], cap_bytes=16, trailer=4, trailer_dtype=torch.float64)
    assert len(empty) == 1 and empty.buckets[0].size == 4
    assert empty.buckets[0].dtype is torch.float64 and empty.buckets[0].members == []
    with pytest.raises(ValueError, match="trailer"):
        BucketPlan(params, cap_bytes=16, trailer=-1)


def test_averaging_divides_gradients_and_flags_but_not_the_trailer() -> None:
    params = _params(2)
    plan = BucketPlan(params, cap_bytes=1 << 20, trailer=3)
    reducer = BucketAllReduce(None, 1, WireFormat.parse(None), CommStats())
    rnd = ReduceRound(
        plan, reducer, lambda b: [torch.tensor([4.0, 8.0])], lambda b: b.new_buffer(), 4
    )
    assert rnd.launchable == 0  # the only bucket carries the trailer: held for wait_all
    (buf,) = rnd.wait_all(lambda t: t.copy_(torch.tensor([1.0, 2.0, 3.0])))
    assert buf.tolist() == [1.0, 2.0, 0.25, 1.0, 2.0, 3.0]


# ---- counting backward passes ------------------------------------------------------------------
def test_sentinels_are_first_last_and_between() -> None:
    params = _params(*range(1, 11))
    assert [p.numel() for p in sentinels(params)] == [1, 4, 7, 10]
    assert sentinels(params[:3]) == params[:3]


def test_pass_counter_counts_passes_not_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    counter = PassCounter()
    counter.watch(sentinels(list(model.parameters())))
    x = torch.randn(3, 4)
    for expected in (1, 2, 3):
        model(x).sum().backward()
        assert counter.completed == expected
    torch.autograd.grad(model(x).sum(), list(model.parameters()))  # the TF path: not counted
    assert counter.completed == 3
    model[1](x).sum().backward()  # reaches no sentinel (parameters 0, 4, 7 and 11 of 12)
    assert counter.completed == 3
    counter.reset()
    model(x).sum().backward()
    assert counter.completed == 1
    counter.unwatch()
    model(x).sum().backward()
    assert counter.completed == 1


def test_pass_counter_stamps_edits_after_backward_and_rewrites_during_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
    params = list(model.parameters())
    counter = PassCounter()
    counter.watch(sentinels(params))
    x = torch.randn(3, 4)
    model(x).sum().backward()
    assert counter.completed == 1 and not counter.foreign
    assert not counter.edited_since_pass()
    nn.utils.clip_grad_norm_(params, 1e-3)  # edits every gradient in place
    assert counter.edited_since_pass()
    counter.reset()
    assert not counter.edited_since_pass()  # nothing counted since

    # a hook that rewrites .grad during backward, after autograd accumulated it (as DDP's
    # reducer does at finalize_backward): foreign
    def rewrite() -> None:
        for p in params:
            p.grad.mul_(0.5)

    handle = params[0].register_post_accumulate_grad_hook(
        lambda p: torch.autograd.Variable._execution_engine.queue_callback(rewrite)
    )
    model(x).sum().backward()
    assert counter.foreign and not counter.edited_since_pass()
    handle.remove()
    counter.reset()
    model(x).sum().backward()
    assert not counter.foreign


def test_overlap_holds_the_last_bucket_for_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    params = list(model.parameters())
    plan = BucketPlan(params, cap_bytes=1, trailer=2)  # one parameter per bucket
    stats = CommStats()
    reducer = BucketAllReduce(None, 1, WireFormat.parse(None), stats)
    rounds: list[ReduceRound] = []

    def round_for_launch() -> ReduceRound:
        if not rounds:
            rounds.append(
                ReduceRound(
                    plan,
                    reducer,
                    lambda b: [params[i].grad for i in b.members],
                    lambda b: b.persistent_buffer(),
                    1,
                )
            )
        return rounds[0]

    counter = PassCounter()
    overlap = BackwardOverlap(plan, 1, counter, round_for_launch, stats)
    overlap.attach()
    F.mse_loss(model(torch.randn(3, 4)), torch.zeros(3, 2)).backward()
    (rnd,) = rounds
    assert counter.completed == 1
    assert rnd.next_bucket == len(plan) - 1  # everything but the trailer's bucket
    assert rnd.inputs_unchanged()
    params[-1].grad.mul_(2.0)  # bucket 0 holds the last-registered parameter: launched
    assert not rnd.inputs_unchanged()
    assert sorted(overlap.observed) == list(range(len(params)))
    overlap.detach()
    assert counter.listeners == []
