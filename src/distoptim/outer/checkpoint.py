"""The outer family's checkpoints: what the wrapper state holds, and its checks before loading.

Owns the ``"wrapper"`` entry of a :class:`~distoptim.outer.diloco.DiLoCo` ``state_dict`` (its
keys, :data:`WRAPPER_KEYS`) and :func:`check_wrapper_state`, which validates a loaded entry
against the optimizer before anything changes: the configuration, the global copy, the outer
optimizer's state, the error-feedback residuals of every fragment and bucket, and the sync in
flight (it must be the one the schedule has in flight at the checkpoint's step, with payload
slots of the right shapes), and the rank of the replica that wrote it (a replica's checkpoint
loads on that replica only); and the warning a checkpoint taken between syncs gets
(:func:`warn_between_syncs`). What the entries mean and how they are loaded is
:mod:`distoptim.outer.diloco`'s.

Also the header check of the other format, the DCP checkpoint that reshards to another group
size (:func:`check_sharded_header`, and :func:`check_quorum_layout` for a torchft-managed
group's; the format is :mod:`distoptim.outer.sharded_state`'s).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distoptim.checks import type_name
from distoptim.outer.exchange import FragmentExchange
from distoptim.outer.fragments import FragmentSchedule
from distoptim.protocol import check_inner_state_dict

__all__ = [
    "LAYOUT_KEYS",
    "NEWER_KEYS",
    "SHARDED_FORMAT",
    "ExchangeLayout",
    "WRAPPER_KEYS",
    "check_quorum_layout",
    "check_sharded_header",
    "check_tensors",
    "check_wrapper_state",
    "layout_free",
    "warn_between_syncs",
]

WRAPPER_KEYS = ("config", "global", "outer", "residuals", "pending", "syncs")
"""The keys every checkpoint's wrapper entry holds."""
NEWER_KEYS = ("rank", "synced_at", "closed_at", "layout")
"""Keys written since the replica's rank is checked; a checkpoint without them still loads
(no rank check, no fragment counted as synced, nothing closed early; residuals checked against
the exchanges' current layout). ``layout``: per fragment, the ``[size, rank]`` of the channel
its residuals and slots were laid out for (checked by the optimizer: a managed one restores it)."""


@dataclass(frozen=True)
class ExchangeLayout:
    """The residuals and payload slots a fragment's exchange has over some channel layout
    (what a checkpoint's entries are checked against when it is not the current one)."""

    residuals: list[dict[str, torch.Tensor]]
    slots: list[torch.Tensor]


def _config_diff(saved: Any, mine: dict[str, Any]) -> Any:
    """The configuration keys a checkpoint's ``saved`` config differs in (or "not a dict")."""
    if not isinstance(saved, dict):
        return "not a dict"
    return sorted(k for k in {*mine, *saved} if mine.get(k) != saved.get(k))


def check_wrapper_state(
    state: Any,
    *,
    owner: str,
    config: dict[str, Any],
    global_: Sequence[torch.Tensor],
    outer: torch.optim.Optimizer,
    exchanges: Sequence[FragmentExchange | ExchangeLayout],
    schedule: FragmentSchedule,
    step: int,
    rank: int,
) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``state`` (a checkpoint's ``"wrapper"`` entry)
    fits this optimizer: its ``config``, this replica's ``rank`` in its group, global copy
    ``global_``, ``outer`` optimizer, the ``exchanges``' residuals and payload slots, and the
    sync ``schedule`` has in flight after ``step`` (the checkpoint's step) unless the checkpoint
    says it was closed early. ``owner`` names the optimizer. ``exchanges`` give each fragment's
    residuals and slots in the layout the checkpoint's are checked against. Changes nothing.
    """
    where = "state_dict['wrapper']"
    if not isinstance(state, dict):
        raise TypeError(f"{where} must be a dict, got {type_name(state)}")
    if set(state) - set(NEWER_KEYS) != set(WRAPPER_KEYS):
        raise ValueError(
            f"{where} must have the keys {list(WRAPPER_KEYS + NEWER_KEYS)}, got {sorted(state)} "
            f"(a {owner} checkpoint holds its global copy and outer state)"
        )
    saved = state["config"]
    if not isinstance(saved, dict) or saved != config:
        diff = _config_diff(saved, config)
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
    if "rank" in state:
        _check_rank(state["rank"], rank, config.get("num_replicas"), owner)
    synced_at = state.get("synced_at", [-1] * len(exchanges))
    if (
        not isinstance(synced_at, list)
        or len(synced_at) != len(exchanges)
        or not all(_is_int(s) and s >= -1 for s in synced_at)
    ):
        raise ValueError(
            f"{where}['synced_at'] must be a list of {len(exchanges)} ints >= -1, got {synced_at!r}"
        )
    closed_at = state.get("closed_at", -1)
    if not _is_int(closed_at) or closed_at < -1:
        raise ValueError(f"{where}['closed_at'] must be an int >= -1, got {closed_at!r}")
    _check_pending(state["pending"], exchanges, schedule, step, closed_at)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_rank(saved: Any, rank: int, replicas: Any, owner: str) -> None:
    """A replica's checkpoint loads on that replica only (replicas differ between syncs)."""
    if not _is_int(saved) or saved < 0:
        raise ValueError(f"state_dict['wrapper']['rank'] must be an int >= 0, got {saved!r}")
    if saved == rank:
        return
    raise ValueError(
        f"{owner}: this checkpoint is replica {saved}'s (of a group of {replicas}), but this is "
        f"replica {rank}: between syncs the replicas differ (local parameters, inner optimizer "
        "state, error-feedback residuals), so each replica resumes from its own checkpoint. To "
        "start every replica from one checkpoint, take its global copy -- the same in every "
        "replica's checkpoint: for p, g in zip(params, sd['wrapper']['global']): "
        "p.data.copy_(g), params in the inner optimizer's order -- and build the optimizers "
        "afresh; or save after opt.finish(), when every replica's model holds the global "
        "model, and load only the model's state_dict on every replica."
    )


def _check_pending(
    pending: Any,
    exchanges: Sequence[FragmentExchange | ExchangeLayout],
    schedule: FragmentSchedule,
    step: int,
    closed_at: int,
) -> None:
    """The saved in-flight sync must be the one the schedule has in flight at that step --
    none if it was launched at or before ``closed_at`` (finish() applied it, or it was
    refused)."""
    where = "state_dict['wrapper']['pending']"
    if not isinstance(pending, dict) or sorted(pending) != [
        "fragment",
        "launched_at",
        "payload",
    ]:
        raise ValueError(f"{where} must be a dict of fragment, launched_at, payload")
    expected = schedule.in_flight_after(step)
    if expected is not None and expected[1] <= closed_at:
        expected = None
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


def warn_between_syncs(owner: str, stacklevel: int) -> None:
    """The warning of a ``state_dict()`` taken while local parameters differ across replicas."""
    warnings.warn(
        f"{owner}.state_dict() between syncs: this replica's parameters, like the model's "
        "state_dict(), are its local values, which differ across replicas until the next sync. "
        "That is what resuming this replica needs (each replica saves and loads its own "
        "checkpoint). For the trained model call opt.finish() on every replica first (every "
        "replica's model then holds the global model), or read opt.global_parameters (the "
        "global copy, the same on every replica, in the inner optimizer's parameter order). "
        "Said once per optimizer.",
        UserWarning,
        stacklevel=stacklevel,
    )


SHARDED_FORMAT = "distoptim.DiLoCo/dcp-1"
"""The format tag of a DCP checkpoint of the outer family (:mod:`distoptim.outer.sharded_state`)."""
LAYOUT_KEYS = ("group_layout",)
"""Configuration keys that say how a replica group is laid out: a DCP checkpoint reshards
across them (another number of processes per group), so they are not compared."""


def layout_free(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` without the keys a DCP checkpoint reshards across (:data:`LAYOUT_KEYS`)."""
    return {k: v for k, v in config.items() if k not in LAYOUT_KEYS}


def check_sharded_header(
    header: Any,
    *,
    owner: str,
    config: dict[str, Any],
    shapes: Sequence[tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    residuals: Sequence[str] | Callable[[Any], Sequence[str]],
    schedule: FragmentSchedule,
) -> dict[str, Any]:
    """The header of a DCP checkpoint (``(SHARDED_FORMAT, fields)``), checked against this
    optimizer: the format, the configuration but for the group's layout (the same options and
    number of replica groups), every parameter's global shape and dtype, the residuals kept
    (``residuals``, or a function of the header's ``quorum`` field that returns them: under a
    torchft manager they follow the quorum the checkpoint's group last synced in), the
    counters, and nothing in flight at its step. Returns the fields (``quorum`` set, ``None``
    in a checkpoint written before it existed); raises ``ValueError`` naming the first
    difference; changes nothing."""
    if not (isinstance(header, tuple) and len(header) == 2 and header[0] == SHARDED_FORMAT):
        raise ValueError(
            f"not a {owner} DCP checkpoint: its header is {str(header)[:80]!r}, not "
            f"({SHARDED_FORMAT!r}, ...)"
        )
    fields = header[1]
    want = {"config", "iterations", "syncs", "synced_at", "closed_at", "shapes", "dtypes",
            "residuals", "inner_groups", "outer_groups"}  # fmt: skip
    if not isinstance(fields, dict) or set(fields) - {"quorum"} != want:
        got = sorted(fields) if isinstance(fields, dict) else type_name(fields)
        raise ValueError(f"{owner} DCP checkpoint: its header holds {got}, not {sorted(want)}")
    fields = {"quorum": None, **fields}
    mine, saved = layout_free(config), fields["config"]
    if not isinstance(saved, dict) or saved != mine:
        diff = _config_diff(saved, mine)
        managed = [isinstance(c, dict) and c.get("num_replicas") == 0 for c in (saved, mine)]
        if managed[0] != managed[1]:
            why = (
                "a torchft-managed optimizer's checkpoint (num_replicas 0: the quorum's) and "
                "one of replica groups without a manager are two formats; each loads only "
                "into its own kind"
            )
        elif managed[1]:
            why = "only the processes per replica group and the number of groups may differ"
        else:
            why = (
                "only the processes per replica group may differ: the number of replica "
                "groups must be the same"
            )
        raise ValueError(
            f"{owner} DCP checkpoint of another configuration (differs in {diff}): checkpoint "
            f"{saved!r}, this optimizer {mine!r} ({why})"
        )
    got_shapes = [tuple(s) for s in fields["shapes"]]
    if got_shapes != [tuple(s) for s in shapes]:
        wrong = [
            f"parameter {i}: saved {s}, here {tuple(m)}"
            for i, (s, m) in enumerate(zip(got_shapes, shapes))
            if s != tuple(m)
        ]
        raise ValueError(
            f"{owner} DCP checkpoint: its parameters' global shapes are not this optimizer's "
            f"({len(got_shapes)} saved, {len(shapes)} here): "
            f"{'; '.join(wrong[:4]) or 'the counts differ'} -- a checkpoint of another model?"
        )
    if list(fields["dtypes"]) != [str(d) for d in dtypes]:
        raise ValueError(
            f"{owner} DCP checkpoint: its parameters' dtypes {list(fields['dtypes'])} are not "
            f"this optimizer's {[str(d) for d in dtypes]}"
        )
    if callable(residuals):
        residuals = residuals(fields["quorum"])
    if list(fields["residuals"]) != list(residuals):
        raise ValueError(
            f"{owner} DCP checkpoint keeps the residuals {list(fields['residuals'])}, this "
            f"optimizer {list(residuals)}"
        )
    step, closed_at = fields["iterations"], fields["closed_at"]
    counters = {"iterations": 0, "syncs": 0, "closed_at": -1}
    for key, low in counters.items():
        if not _is_int(fields[key]) or fields[key] < low:
            raise ValueError(f"{owner} DCP checkpoint: {key} must be an int >= {low}")
    synced_at = fields["synced_at"]
    if (
        not isinstance(synced_at, list)
        or len(synced_at) != len(schedule)
        or not all(_is_int(s) and s >= -1 for s in synced_at)
    ):
        raise ValueError(
            f"{owner} DCP checkpoint: synced_at must be a list of {len(schedule)} ints >= -1, "
            f"got {synced_at!r}"
        )
    expected = schedule.in_flight_after(step)
    if expected is not None and expected[1] > closed_at:
        raise ValueError(
            f"{owner} DCP checkpoint at step {step}: the schedule has fragment "
            f"{expected[0].index} in flight there, which this format does not hold"
        )
    return fields


def check_quorum_layout(owner: str, quorum: Any, fragments: int) -> list[tuple[int, int]]:
    """A managed DCP checkpoint's ``quorum`` header field: per fragment, the ``[size, rank]``
    of the quorum its residuals were laid out for (its group's rank there is no identity: any
    group may load the checkpoint). ``ValueError`` unless it is ``fragments`` such pairs with
    ``0 <= rank < size``."""
    if not isinstance(quorum, list) or len(quorum) != fragments:
        raise ValueError(
            f"{owner} DCP checkpoint: not one of a torchft-managed optimizer (its header's "
            f"quorum is {quorum!r}, not {fragments} [size, rank] pairs)"
        )
    out = []
    for entry in quorum:
        if (
            not isinstance(entry, (list, tuple))
            or len(entry) != 2
            or not all(_is_int(v) for v in entry)
            or not 0 <= entry[1] < entry[0]
        ):
            raise ValueError(
                f"{owner} DCP checkpoint: its header's quorum must hold [size, rank] pairs "
                f"with 0 <= rank < size, got {entry!r}"
            )
        out.append((entry[0], entry[1]))
    return out
