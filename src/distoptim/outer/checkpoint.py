"""The outer family's checkpoints: what the wrapper state holds, and its checks before loading.

Owns the ``"wrapper"`` entry of a :class:`~distoptim.outer.diloco.DiLoCo` ``state_dict`` (its
keys, :data:`WRAPPER_KEYS`) and :func:`check_wrapper_state`, which validates a loaded entry
against the optimizer before anything changes: the configuration, the global copy, the outer
optimizer's state, the error-feedback residuals of every fragment and bucket, and the sync in
flight (it must be the one the schedule has in flight at the checkpoint's step, with payload
slots of the right shapes). What the entries mean and how they are loaded is
:mod:`distoptim.outer.diloco`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from distoptim.checks import type_name
from distoptim.outer.exchange import FragmentExchange
from distoptim.outer.fragments import FragmentSchedule
from distoptim.protocol import check_inner_state_dict

__all__ = ["WRAPPER_KEYS", "check_tensors", "check_wrapper_state"]

WRAPPER_KEYS = ("config", "global", "outer", "residuals", "pending", "syncs")


def check_wrapper_state(
    state: Any,
    *,
    owner: str,
    config: dict[str, Any],
    global_: Sequence[torch.Tensor],
    outer: torch.optim.Optimizer,
    exchanges: Sequence[FragmentExchange],
    schedule: FragmentSchedule,
    step: int,
) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``state`` (a checkpoint's ``"wrapper"`` entry)
    fits this optimizer: its ``config``, global copy ``global_``, ``outer`` optimizer, the
    ``exchanges``' residuals and payload slots, and the sync ``schedule`` has in flight after
    ``step`` (the checkpoint's step). ``owner`` names the optimizer. Changes nothing.
    """
    where = "state_dict['wrapper']"
    if not isinstance(state, dict):
        raise TypeError(f"{where} must be a dict, got {type_name(state)}")
    if sorted(state) != sorted(WRAPPER_KEYS):
        raise ValueError(
            f"{where} must have the keys {list(WRAPPER_KEYS)}, got {sorted(state)} (a "
            f"{owner} checkpoint holds its global copy and outer state)"
        )
    saved = state["config"]
    if not isinstance(saved, dict) or saved != config:
        diff = (
            sorted(k for k in {*config, *saved} if config.get(k) != saved.get(k))
            if isinstance(saved, dict)
            else "not a dict"
        )
        raise ValueError(
            f"{where}['config'] is from another configuration (differs in {diff}): "
            f"checkpoint {saved!r}, this optimizer {config!r}"
        )
    check_tensors(f"{where}['global']", state["global"], [p for p in global_])
    if not isinstance(state["outer"], dict):
        raise TypeError(f"{where}['outer'] must be a dict, got {type_name(state['outer'])}")
    check_inner_state_dict(outer, state["outer"])
    residuals = state["residuals"]
    if not isinstance(residuals, list) or len(residuals) != len(exchanges):
        raise ValueError(f"{where}['residuals'] must be a list of {len(exchanges)} lists")
    for p, (saved, exchange) in enumerate(zip(residuals, exchanges)):
        if not isinstance(saved, list) or len(saved) != len(exchange.residuals):
            raise ValueError(
                f"{where}['residuals'][{p}] must be a list of {len(exchange.residuals)} "
                "dicts of residuals (one per bucket)"
            )
        for k, (entry, mine) in enumerate(zip(saved, exchange.residuals)):
            if not isinstance(entry, dict) or sorted(entry) != sorted(mine):
                raise ValueError(f"{where}['residuals'][{p}][{k}] must be a dict of {sorted(mine)}")
            check_tensors(
                f"{where}['residuals'][{p}][{k}]",
                [entry[name] for name in mine],
                list(mine.values()),
            )
    syncs = state["syncs"]
    if isinstance(syncs, bool) or not isinstance(syncs, int) or syncs < 0:
        raise ValueError(f"{where}['syncs'] must be an int >= 0, got {syncs!r}")
    _check_pending(state["pending"], exchanges, schedule, step)


def _check_pending(
    pending: Any, exchanges: Sequence[FragmentExchange], schedule: FragmentSchedule, step: int
) -> None:
    """The saved in-flight sync must be the one the schedule has in flight at that step."""
    where = "state_dict['wrapper']['pending']"
    if not isinstance(pending, dict) or sorted(pending) != [
        "fragment",
        "launched_at",
        "payload",
    ]:
        raise ValueError(f"{where} must be a dict of fragment, launched_at, payload")
    expected = schedule.in_flight_after(step)
    want = (-1, -1) if expected is None else (expected[0].index, expected[1])
    got = (pending["fragment"], pending["launched_at"])
    if got != want:
        raise ValueError(
            f"{where} says fragment {got[0]!r} launched at step {got[1]!r} is in flight, but "
            f"at step {step} the schedule has "
            + (
                "nothing in flight"
                if expected is None
                else f"fragment {want[0]} launched at step {want[1]} in flight"
            )
        )
    payload = pending["payload"]
    if not isinstance(payload, list) or len(payload) != len(exchanges):
        raise ValueError(f"{where}['payload'] must be a list of {len(exchanges)} lists")
    for p, (saved, exchange) in enumerate(zip(payload, exchanges)):
        check_tensors(f"{where}['payload'][{p}]", saved, exchange.slots)


def check_tensors(where: str, saved: Any, mine: Sequence[torch.Tensor]) -> None:
    """``saved`` must be a list of tensors with the shapes and dtypes of ``mine``."""
    if not isinstance(saved, (list, tuple)) or len(saved) != len(mine):
        raise ValueError(f"{where} must be a list of {len(mine)} tensors, got {type_name(saved)}")
    for i, (t, ref) in enumerate(zip(saved, mine)):
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type_name(t)
            raise ValueError(
                f"{where}[{i}] must be a {ref.dtype} tensor of shape {tuple(ref.shape)}, got {got}"
            )
