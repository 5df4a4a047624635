"""The center guard: a commit is applied only if the center is finite afterwards.

Owns: how a parameter-server shard refuses a commit whose *result* would not be finite, so
that the center (and the server optimizer's state) stay exactly as they were; the refusal is
counted and reported to the worker with its reason (:class:`Refusal`).

* **Under the table's lock** (``use_locking=True``, and always with a server optimizer): the
  shard applies a commit chunk by chunk (:mod:`distoptim.agn.server`). Before a chunk is
  updated its :class:`Backup` unit -- that range of the center and the server-optimizer state of
  its pieces -- is current: taken ahead, between requests, while the shard is idle, or else
  copied just before the update while the chunk is in the cache. After the update the chunk is
  checked with one ``sum`` while it is still in the cache (:func:`finite_tensor`: a sum is finite
  only if every term is; a non-finite sum of finite terms, an overflow of the sum itself, is
  checked element-wise), so the check costs no extra pass over memory. A non-finite chunk
  refuses the commit: every chunk updated so far is restored from the backup.
* **Without the lock** (``use_locking=False``, bounded rules only): :func:`apply_unlocked`
  applies a commit only when a bound of ``max|c|`` proves its result finite (no backup is
  possible while others write).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.agn.rules import ServerRule

__all__ = [
    "Backup",
    "BackupUnit",
    "Bound",
    "Refusal",
    "apply_unlocked",
    "finite",
    "finite_tensor",
    "unalias_state",
]


def finite_tensor(t: torch.Tensor) -> bool:
    """True iff every element of ``t`` is finite (non-floating tensors are).

    Fast path: a sum reduction (no temporary the size of ``t``) is finite only if every term is
    (NaN and Inf propagate); a non-finite sum may also be an overflow of finite terms, so only
    then is the exact element-wise test run. On a chunk that was just written the sum reads it
    from the cache: the check costs no extra pass over memory.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return True
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


def finite(flats: Mapping[str, torch.Tensor]) -> bool:
    """True iff every element of every buffer is finite (:func:`finite_tensor`)."""
    return all(finite_tensor(t) for t in flats.values())


def _max_abs(flats: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``max|x|`` per buffer (NaN when a NaN is present; Inf when an Inf is)."""
    out = {}
    for k, t in flats.items():
        if t.numel() == 0:
            out[k] = 0.0
            continue
        lo, hi = torch.aminmax(t)
        lo_f, hi_f = float(lo), float(hi)
        out[k] = math.nan if math.isnan(lo_f) or math.isnan(hi_f) else max(-lo_f, hi_f)
    return out


@dataclass
class Refusal:
    """Why a commit was not applied: ``"payload"`` (NaN/Inf sent, found by the shard or by the
    worker), ``"result"`` (the center would have become non-finite) or ``"abandoned"`` (the
    worker stopped in the middle of sending it; not counted as a refusal)."""

    reason: str

    def describe(self) -> str:
        if self.reason == "payload":
            return "the commit contained NaN/Inf"
        if self.reason == "abandoned":
            return "the worker abandoned the commit while sending it"
        return "applying the commit would have made the center non-finite (NaN/Inf)"


@dataclass
class BackupUnit:
    """What one piece of a :class:`Backup` covers: ranges ``(key, start, stop)`` of the center
    and the server-optimizer parameters whose state goes with them."""

    ranges: list[tuple[str, int, int]]
    params: list[torch.Tensor] = field(default_factory=list)


class Backup:
    """A copy of a table's center and server-optimizer state, unit by unit, each tagged with the
    table version it shows (``None``: stale).

    A unit is a chunk of the center with the optimizer state of its pieces (so a chunk can be
    backed up just before it is updated, while it is in the cache, or ahead, between requests),
    plus, for an optimizer stepped whole, one unit holding all of its state. Restoring a unit
    puts the center range and the state back exactly, including state that did not exist yet
    (it is removed).
    """

    def __init__(
        self,
        flats: Mapping[str, torch.Tensor],
        units: list[BackupUnit],
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.center = {k: torch.empty_like(v) for k, v in flats.items()}
        self.units = units
        self.versions: list[int | None] = [None] * len(units)
        self._optimizer = optimizer
        self._state: dict[int, dict[str, Any] | None] = {}  # id(param) -> entries (None: none)
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}

    def take(self, unit: int, flats: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy unit ``unit`` as of ``version`` (the caller holds the table's lock)."""
        u = self.units[unit]
        for key, lo, hi in u.ranges:
            self.center[key][lo:hi].copy_(flats[key][lo:hi])
        opt = self._optimizer
        if opt is not None:
            for p in u.params:
                live = opt.state.get(p)
                if not live:
                    self._state[id(p)] = None
                    continue
                entries: dict[str, Any] = {}
                for name, value in live.items():
                    if isinstance(value, torch.Tensor):
                        buf = self._bufs.get((id(p), name))
                        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                            buf = self._bufs[id(p), name] = torch.empty_like(value)
                        buf.copy_(value)
                        entries[name] = buf
                    else:
                        entries[name] = value
                self._state[id(p)] = entries
        self.versions[unit] = version

    def restore(self, unit: int, flats: Mapping[str, torch.Tensor]) -> None:
        """Put unit ``unit`` back into the live center and optimizer state."""
        u = self.units[unit]
        for key, lo, hi in u.ranges:
            flats[key][lo:hi].copy_(self.center[key][lo:hi])
        opt = self._optimizer
        if opt is None:
            return
        for p in u.params:
            entries = self._state.get(id(p))
            if not entries:
                opt.state.pop(p, None)
                continue
            live = opt.state[p]
            for name, value in entries.items():
                if isinstance(value, torch.Tensor) and isinstance(live.get(name), torch.Tensor):
                    live[name].copy_(value)
                elif isinstance(value, torch.Tensor):
                    live[name] = value.clone()
                else:
                    live[name] = value
            for name in list(live):
                if name not in entries:
                    del live[name]


def unalias_state(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor], storages: set[int]
) -> None:
    """Replace state tensors of ``params`` that share one of ``storages`` (storage data
    pointers of a commit's buffers) by copies.

    An optimizer may keep a reference to the gradient it stepped with; the commit's buffers are
    reused by the transport for the next message, so such a reference must own its memory.
    """
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            continue
        for name, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in storages:
                state[name] = value.clone()


def _dtype_max(t: torch.Tensor) -> float:
    return float(torch.finfo(t.dtype).max)


@dataclass
class Bound:
    """An upper bound of ``max|c|`` per center buffer, for commits applied without the lock."""

    value: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def apply_unlocked(
    rule: ServerRule,
    center: Mapping[str, torch.Tensor],
    center_views: list[torch.Tensor],
    update: Mapping[str, torch.Tensor],
    update_views: list[torch.Tensor],
    bound: Bound,
) -> Refusal | None:
    """Apply a bounded rule without the table's lock (``use_locking=False``), guarded.

    No backup is possible while others write, so the commit is applied only when a bound proves
    the result finite: every new element is a sum of at most ``rule.max_terms`` terms bounded by
    ``max|c|`` and ``max|u|``, so ``terms * max(max|c|, max|u|) < FLT_MAX`` (the dtype's largest
    finite value) guarantees it. The shard keeps an upper bound of ``max|c|`` (exact after
    seeding, grown by ``max|u|`` per commit -- reserved before applying, so concurrent commits
    see each other's growth); one read pass over the payload (``aminmax``, which also catches
    NaN/Inf) per commit. A commit the bound cannot prove safe is refused.
    """
    if not rule.bounded_by_inputs:
        raise RuntimeError(f"{type(rule).__name__} needs the table's lock (use_locking=True)")
    m_u = _max_abs(update)
    if any(math.isnan(v) or math.isinf(v) for v in m_u.values()):
        return Refusal("payload")
    with bound.lock:
        if not bound.value:
            bound.value = _max_abs(center)
        before = dict(bound.value)
        safe = all(rule.max_terms * max(before[k], m_u[k]) < _dtype_max(center[k]) for k in center)
        if safe:
            bound.value = {k: before[k] + (rule.max_terms - 1) * m_u[k] for k in center}
    if not safe:
        return Refusal("result")
    rule.apply(center_views, update_views, None)
    return None
