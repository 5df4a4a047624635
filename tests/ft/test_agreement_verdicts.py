"""The quorum's verdict on decoded words (``distoptim.ft.agreement.judge``), in-process.

The round-trip through real replicas is the fault matrix's; here the verdicts of tables that a
real run meets only by chance are pinned: a joiner that heals into the others' ``finish()``.
"""

from __future__ import annotations

import pytest

from distoptim.comm.guard import ParameterMismatchError, RoundKind
from distoptim.ft.agreement import ReplicaWords, decode, encode, judge
from distoptim.ft.replica import NoPeersError

PLAN, HP, STATE = 0x3EBAB0FFBD63, 0x2366C8BF, 0xE770D21643D9748B


def _finishing(step: int = 174) -> ReplicaWords:
    return ReplicaWords(RoundKind.FINISH, step=step, plan=PLAN, params=0, hparams=HP, state=STATE)


def _joiner(plan: int = PLAN) -> ReplicaWords:
    return ReplicaWords(
        RoundKind.STEP, step=0, plan=plan, params=6, hparams=HP, state=0, healing=True
    )


def _table(words: list[ReplicaWords]) -> list[ReplicaWords]:
    """What every member decodes (through the wire's encoding, as a real round does)."""
    n = len(words)
    summed = sum(encode(w, r, n) for r, w in enumerate(words))
    return decode(summed, n, "CrossShardOptimizer")


def test_a_joiner_meeting_the_others_finish_is_told_nothing_is_left_to_join():
    """CI once saw a warm spare take a killed slot just as the others called finish(): it was
    refused as 'another parameter list' (finish() carries no payload, so 0 parameters)."""
    table = _table([_finishing(), _joiner(), _finishing()])
    with pytest.raises(NoPeersError, match=r"finish the run \(finish\(\) at step 174\)"):
        judge(table, 1, "CrossShardOptimizer")
    for rank in (0, 2):  # the finishing members: their last round does not commit, no error
        verdict = judge(table, rank, "CrossShardOptimizer")
        assert not verdict.ok and "nothing left to join" in verdict.reason


def test_a_joiner_with_another_model_is_still_refused_by_name():
    step = ReplicaWords(RoundKind.STEP, step=9, plan=PLAN, params=6, hparams=HP, state=STATE)
    table = _table([step, _joiner(plan=PLAN + 1), step])
    with pytest.raises(ParameterMismatchError, match="another parameter list"):
        judge(table, 1, "CrossShardOptimizer")
    assert not judge(table, 0, "CrossShardOptimizer").ok
