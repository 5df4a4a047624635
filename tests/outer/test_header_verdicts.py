"""The sync header's verdict on tables a real run meets only by chance, in-process.

:class:`~distoptim.outer.agreement.SyncAgreement` over a channel whose all-gather returns the
table every member would receive (each member's packed header, in member order): the verdict is
computed from the table alone, so every member of the table is judged here as a real run would
judge it. The round trip through real torchft replicas is the fault matrix's ``straggler``
bundle (``tests/ft/test_fault_matrix.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from distoptim.comm.channel import Channel
from distoptim.comm.guard import DesyncError, RoundKind
from distoptim.comm.stats import CommStats
from distoptim.outer.agreement import Header, SyncAgreement


class _Done:
    def wait(self) -> None:
        return None


class _Table(Channel):
    """The members' headers, as the all-gather would return them to member ``rank``."""

    def __init__(self, headers: Sequence[Header], rank: int) -> None:
        self.rows = b"".join(h.pack((0.0, 0.0)) for h in headers)
        self._size, self._rank = len(headers), rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        return self._rank

    def all_gather_single(self, out: torch.Tensor, tensor: torch.Tensor) -> _Done:
        out.copy_(torch.frombuffer(bytearray(self.rows), dtype=torch.uint8))
        return _Done()

    def all_reduce_sum(self, tensor: torch.Tensor) -> _Done:
        raise AssertionError("a header verdict needs no all-reduce")

    def all_to_all_single(self, out: torch.Tensor, tensor: torch.Tensor) -> _Done:
        raise AssertionError("a header verdict needs no all-to-all")


def _header(step: int, fragment: int | None, kind: RoundKind = RoundKind.STEP) -> Header:
    return Header(kind, step, fragment, 4, 0xA1, 0xB2, 0xC3, state=0x5EED)


def _verdicts(headers: list[Header], manager: bool):
    """Every member's verdict (or the exception it raised)."""
    out = []
    for rank, mine in enumerate(headers):
        agreement = SyncAgreement(
            _Table(headers, rank), CommStats(), torch.device("cpu"), "DiLoCo", odd_one_out=manager
        )
        try:
            out.append(agreement.check(mine, [], dict))
        except DesyncError as exc:
            out.append(exc)
    return out


def test_a_straggler_in_a_torchft_quorum_takes_the_furthest_step_on_every_member():
    """Streaming DiLoCo, 2 fragments: a member thawed behind the others by one sync (the
    table CI met: 'fragment 0 after step 36' against 'fragment 1 after step 32')."""
    table = [_header(36, 0), _header(32, 1), _header(36, 0)]
    for verdict in _verdicts(table, manager=True):
        assert not isinstance(verdict, Exception), verdict
        assert verdict.catch_up and verdict.void  # not applied, on every member alike
        assert (verdict.step, verdict.fragment) == (36, 0)
        assert "rank 1 at step 32 behind the furthest member (step 36)" in verdict.void


def test_without_a_manager_members_at_different_steps_are_out_of_step():
    table = [_header(36, 0), _header(32, 1)]
    for verdict in _verdicts(table, manager=False):
        assert isinstance(verdict, DesyncError) and "step counters differ" in str(verdict)


@pytest.mark.parametrize(
    "table",
    [
        [_header(36, 0), _header(36, 1)],  # one step, two fragments: their fragment state differs
        [_header(36, 0), _header(32, None, RoundKind.FINISH)],  # a loop ended early
    ],
    ids=["same-step-other-fragment", "finish-against-step"],
)
def test_in_a_torchft_quorum_what_is_not_a_straggler_stays_out_of_step(table):
    for verdict in _verdicts(table, manager=True):
        assert isinstance(verdict, DesyncError) and "out of step" in str(verdict), verdict
