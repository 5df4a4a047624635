"""The amortized state check of a managed CrossShardOptimizer and DiLoCo, across real
replica processes.

Three replica groups around a real lighthouse train a model large enough that a clean round
checks only a slice of the state (``state_slices`` > 1). One replica flips one bit of its
state right after a commit (a named point: CrossShard's commit of :data:`FLIP_AT`, the last
parameter; DiLoCo's sync :data:`D_FLIP_AT`, the global copy of the last parameter): the check
must name it within ``K`` rounds, and the other two must go on and finish with equal states.
The runs without a flip show the slicing never refuses a healthy round (no false alarm).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from distoptim import CrossShardOptimizer, DiLoCo
from distoptim.comm.checksum import state_checksum
from distoptim.ft.data import SlotShards
from distoptim.ft.local import ReplicaContext, run_replicas
from distoptim.ft.replica import make_manager
from distoptim.sync.replicated import state_slices

FLIP_AT, STEPS, WIDTH = 5, 16, 384
D_FLIP_AT, D_EVERY = 3, 2  # DiLoCo: the sync after which a bit flips; H
RUN_TIMEOUT = 600.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(),
                               torch.nn.Linear(WIDTH, 3))  # fmt: skip


def _manager(ctx: ReplicaContext, parts: dict[str, Any]) -> Any:
    """This replica's manager; the state it serves and loads is ``parts`` (name: a module or
    optimizer), read when the manager asks, so a part added after the manager counts."""

    def state() -> dict[str, Any]:
        return copy.deepcopy({name: part.state_dict() for name, part in parts.items()})

    def load(s: dict[str, Any]) -> None:
        for name, part in parts.items():
            part.load_state_dict(s[name])

    return make_manager(
        ctx.lighthouse,
        replica_id=ctx.replica_id,
        state_dict=state,
        load_state_dict=load,
        timeout=30,
        quorum_timeout=120,
        connect_timeout=30,
        init_sync=False,
    )


def _train(
    ctx: ReplicaContext, model: Any, opt: Any, count: str, until: int, flip: Any, at: int | None
) -> dict[str, Any]:
    """Train until ``opt``'s ``count`` (``"iterations"`` or ``"syncs"``) reaches ``until``;
    ``flip()`` runs right after the round that makes it ``at`` (``None``: never). Returns
    ``{"error": ...}`` with what the training raised, ``{}`` if nothing."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(256, WIDTH, generator=g), torch.randint(0, 3, (256,), generator=g)
    shards = SlotShards(256, ctx.num_slots, ctx.slot, 8, seed=3)
    ctx.wait_for_peers(240)
    try:
        while getattr(opt, count) < until:
            idx = shards.batch(opt.iterations)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            before = getattr(opt, count)
            opt.step()
            now = getattr(opt, count)
            if now > before and now == at:
                with torch.no_grad():
                    flip()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {}


def drifting(ctx: ReplicaContext, flip_slot: int | None) -> dict[str, Any]:
    """Train ``STEPS`` committed steps; replica ``flip_slot`` flips a bit after ``FLIP_AT``."""
    model = _model()
    parts: dict[str, Any] = {"model": model}
    manager = _manager(ctx, parts)
    opt = CrossShardOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), manager=manager)
    parts["opt"] = opt

    def flip() -> None:  # the last element: the last slice to be checked
        model[2].bias.view(torch.int32)[-1] ^= 1

    at = FLIP_AT if ctx.slot == flip_slot else None
    result = _train(ctx, model, opt, "iterations", STEPS, flip, at)
    result.update(
        slices=state_slices(list(model.parameters())),
        step=opt.iterations,
        state=state_checksum(list(model.parameters())),
        commits=opt.replica_stats.commits,
    )
    manager.shutdown(wait=False)
    return result


def test_a_one_bit_drift_is_named_within_one_cycle_of_slices_and_the_others_go_on():
    run = run_replicas(drifting, 3, args=(2,), timeout=RUN_TIMEOUT)
    good, odd = run.values[:2], run.values[2]
    slices = odd["slices"]
    assert 2 <= slices < STEPS - FLIP_AT  # the test needs slicing, and a whole cycle to run
    assert "DesyncError" in odd.get("error", ""), odd
    assert "synchronised state" in odd["error"] and "than the majority" in odd["error"]
    # the flip came after commit FLIP_AT; its slice is checked within the next `slices` rounds
    assert FLIP_AT <= odd["step"] <= FLIP_AT + slices, odd
    for v in good:
        assert "error" not in v, v
        assert v["step"] == STEPS
    assert good[0]["state"] == good[1]["state"]


def test_slicing_raises_no_false_alarm_and_all_commit():
    run = run_replicas(drifting, 2, args=(None,), timeout=RUN_TIMEOUT)
    for v in run.values:
        assert "error" not in v, v
        assert v["step"] == STEPS and v["slices"] >= 2
    assert run.values[0]["state"] == run.values[1]["state"]


def diloco_drifting(ctx: ReplicaContext, flip_slot: int | None) -> dict[str, Any]:
    """DiLoCo (H = :data:`D_EVERY`) for ``D_FLIP_AT + 2 K`` syncs; replica ``flip_slot``
    flips a bit of its global copy after sync ``D_FLIP_AT``. Records which slicings its
    headers' state words used (``parts``: the real checksum runs, the spy only counts)."""
    from distoptim.outer import managed as managed_module

    model = _model()
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    parts_seen: list[int] = []
    checksum = managed_module.state_checksum

    def spy(tensors: Any, part: int = 0, parts: int = 1) -> int:
        parts_seen.append(parts)
        return checksum(tensors, part, parts)

    managed_module.state_checksum = spy  # type: ignore[assignment]
    manager = _manager(ctx, {"model": model, "inner": inner})
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = DiLoCo(inner, outer, sync_every=D_EVERY, manager=manager)

    def flip() -> None:  # a mantissa bit no later outer step rounds away
        list(opt.global_parameters)[-1].view(torch.int32)[-1] ^= 1 << 10

    # the state word's tensors: the global copy and the outer momentum, of the same shapes
    slices = state_slices(list(model.parameters()) * 2)
    syncs = D_FLIP_AT + 2 * slices
    at = D_FLIP_AT if ctx.slot == flip_slot else None
    result = _train(ctx, model, opt, "syncs", syncs, flip, at)
    result.update(
        slices=slices,
        syncs_wanted=syncs,
        syncs=opt.syncs,
        state=state_checksum(list(opt.global_parameters)),
        parts_seen=parts_seen,
        failed=opt.replica_stats.failed,
    )
    manager.shutdown(wait=False)
    return result


def test_diloco_a_one_bit_drift_is_named_within_one_cycle_of_slices_and_the_others_go_on():
    run = run_replicas(diloco_drifting, 3, args=(2,), timeout=RUN_TIMEOUT)
    good, odd = run.values[:2], run.values[2]
    slices = odd["slices"]
    assert slices >= 2, odd  # the test needs slicing
    assert "ParameterMismatchError" in odd.get("error", ""), odd
    assert "not bit-for-bit equal" in odd["error"] and "refused" in odd["error"], odd
    # the flip came after sync D_FLIP_AT; its slice is checked within the next `slices` syncs
    assert D_FLIP_AT <= odd["syncs"] <= D_FLIP_AT + slices, odd
    assert odd["parts_seen"][-1] == slices, odd  # the check that caught it: a slice
    for v in good:
        assert "error" not in v, v
        assert v["syncs"] == v["syncs_wanted"], v
    assert good[0]["state"] == good[1]["state"]


def test_diloco_slicing_raises_no_false_alarm_and_all_commit():
    run = run_replicas(diloco_drifting, 2, args=(None,), timeout=RUN_TIMEOUT)
    for v in run.values:
        assert "error" not in v, v
        assert v["syncs"] == v["syncs_wanted"] and v["failed"] == 0, v
        # the first sync checks the whole state, the clean ones after it slices of it
        assert v["parts_seen"][0] == 1 and set(v["parts_seen"][1:]) == {v["slices"]}, v
    assert run.values[0]["state"] == run.values[1]["state"]
