"""The center guard: a commit is applied only if the center is finite afterwards.

Owns: how a parameter-server shard refuses a commit whose *result* would not be finite, so
that the center (and the server optimizer's state) stay exactly as they were; the refusal is
counted and reported to the worker with its reason (:class:`Refusal`).

* **Under the table's lock** (``use_locking=True``, and always with a server optimizer):
  :class:`GuardedCommit` applies a commit chunk by chunk as it arrives. Before a chunk is
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

from distoptim.agn.flat import Chunk, FlatLayout
from distoptim.agn.rules import ServerRule
from distoptim.agn.server_optimizer import ServerOptimizer
from distoptim.agn.transport.base import Inflow

__all__ = [
    "Backup",
    "BackupUnit",
    "Bound",
    "GuardedCommit",
    "Refusal",
    "apply_unlocked",
    "backup_for",
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


def backup_for(
    flats: Mapping[str, torch.Tensor],
    chunks: list[Chunk],
    server_opt: ServerOptimizer | None,
    chunkwise: bool,
) -> Backup:
    """The backup of a table whose center is ``flats`` in the chunk plan ``chunks``: one unit per
    chunk (with the server-optimizer state of the chunk's pieces when ``chunkwise``), plus one
    unit holding all of a server optimizer stepped whole."""
    units = [
        BackupUnit(
            [(c.key, c.start, c.stop)],
            server_opt.chunk_params[c.index] if server_opt is not None and chunkwise else [],
        )
        for c in chunks
    ]
    if server_opt is not None and not chunkwise:
        units.append(BackupUnit([], list(server_opt.params)))
    return Backup(flats, units, None if server_opt is None else server_opt.optimizer)


class GuardedCommit:
    """One commit applied to a table's center under its write lock, guarded (module docstring).

    :meth:`run` applies it as its chunks arrive and publishes each reply chunk as soon as it is
    final: a chunkwise table (``ServerRule.elementwise``, and an element-wise server optimizer)
    updates and checks chunk ``k`` while chunk ``k + 1`` is still arriving; any other table
    waits for the whole payload, updates it whole, then checks and publishes chunk by chunk.
    ``source`` is where the reply's chunks are read: the center, or its backup (the center as it
    was) for a rule with ``reply_before_update``.

    Invariant: once :meth:`run` returned a refusal -- or raised (the worker vanished mid-stream,
    or the rule raised) -- the center, the server optimizer's state and its hyperparameters are
    exactly what they were before the commit.
    """

    def __init__(
        self,
        rule: ServerRule,
        center: Mapping[str, torch.Tensor],
        views: list[torch.Tensor],
        layout: FlatLayout,
        chunks: list[Chunk],
        backup: Backup,
        version: int,
        server_opt: ServerOptimizer | None,
        payload: Mapping[str, torch.Tensor],
        refused_by_worker: bool = False,
        hparams: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        self.rule = rule
        self.center = center
        self.views = views
        self.layout = layout
        self.chunks = chunks if payload else []
        self.chunkwise = rule.elementwise and (server_opt is None or server_opt.chunkwise)
        self.backup = backup
        self.version = version
        self.server_opt = server_opt
        self.payload = payload
        self.refusal: Refusal | None = Refusal("payload") if refused_by_worker else None
        self.units: list[int] = []  # the backup units updated so far
        self.source = backup.center if rule.reply_before_update else center
        self._storages = {t.untyped_storage().data_ptr() for t in payload.values()}
        self._kept_hparams = None
        if self.refusal is None and hparams and server_opt is not None:
            self._kept_hparams = server_opt.follow(hparams)

    def run(self, inflow: Inflow) -> Refusal | None:
        """Apply the commit as it arrives through ``inflow`` and publish the reply chunks; why it
        was refused (it is undone), or None: it is applied."""
        try:
            self._stream(inflow)
        except BaseException:
            self._undo()
            raise
        if self.refusal is not None:
            self._undo()
        return self.refusal

    def _stream(self, inflow: Inflow) -> None:
        target = inflow.reply_buffers()
        if self.chunkwise:
            for chunk in self.chunks:
                inflow.wait(chunk.index)
                self._apply_chunk(chunk)
                inflow.publish_chunk(chunk, self.source, target)
            self._verdict(inflow.verdict() if self.chunks else "ok")
            return
        for chunk in self.chunks:
            inflow.wait(chunk.index)
        verdict = inflow.verdict() if self.chunks else "ok"
        self._apply_whole(verdict)
        for chunk in self.chunks:
            self._check_chunk(chunk)
            inflow.publish_chunk(chunk, self.source, target)
        self._verdict(verdict)

    def _fresh(self, unit: int) -> None:
        """Backup unit ``unit`` shows the current version (taken now unless taken ahead)."""
        if self.backup.versions[unit] != self.version:
            self.backup.take(unit, self.center, self.version)

    def _apply_chunk(self, chunk: Chunk) -> None:
        """Chunk ``chunk`` of the payload arrived: update that chunk of the center (its backup
        current first) and check it while in cache -- unless the commit is refused already."""
        if self.refusal is None:
            self._fresh(chunk.index)
            self.units.append(chunk.index)
            self.refusal = self._update_chunk(chunk)
        elif self.rule.reply_before_update:
            self._fresh(chunk.index)  # the reply is the backup's
        self._blame(chunk)  # before the reply may overwrite the payload

    def _update_chunk(self, chunk: Chunk) -> Refusal | None:
        opt = self.server_opt
        if opt is not None:
            with opt.only(chunk.index) as params:
                self.rule.apply(params, chunk.piece_views(self.payload), opt.optimizer)
            unalias_state(opt.optimizer, params, self._storages)
        else:
            self.rule.apply([chunk.of(self.center)], [chunk.of(self.payload)], None)
        return None if finite_tensor(chunk.of(self.center)) else Refusal("result")

    def _apply_whole(self, verdict: str) -> None:
        """Every chunk arrived (and the worker said ``verdict``): update the whole center at once,
        every backup unit current first."""
        applying = self.refusal is None and verdict == "ok"
        every_unit = list(range(len(self.backup.units)))
        if applying or self.rule.reply_before_update:  # to restore from, or the reply
            for u in every_unit:
                self._fresh(u)
        if not applying:
            return
        self.units = every_unit
        update = self.layout.views(self.payload)
        opt = self.server_opt
        if opt is not None:
            order = opt.params
            by_id = {id(v): g for v, g in zip(self.views, update)}
            self.rule.apply(order, [by_id[id(p)] for p in order], opt.optimizer)
            unalias_state(opt.optimizer, order, self._storages)
        else:
            self.rule.apply(self.views, update, None)

    def _check_chunk(self, chunk: Chunk) -> None:
        """After :meth:`_apply_whole`: check chunk ``chunk`` of the result while in cache."""
        checked = self.units and self.refusal is None
        if checked and not finite_tensor(chunk.of(self.center)):
            self.refusal = Refusal("result")
        self._blame(chunk)

    def _blame(self, chunk: Chunk) -> None:
        """A commit refused for its result was refused for its payload if this chunk of it holds
        NaN/Inf (checked only once refused)."""
        refused_for_result = self.refusal is not None and self.refusal.reason == "result"
        if refused_for_result and not finite_tensor(chunk.of(self.payload)):
            self.refusal = Refusal("payload")

    def _verdict(self, word: str) -> None:
        """Fold in the worker's verdict on a streamed commit."""
        if self.refusal is None and word == "refuse":
            self.refusal = Refusal("payload")
        elif self.refusal is None and word == "abort":
            self.refusal = Refusal("abandoned")

    def _undo(self) -> None:
        """The center as it was (every updated unit restored from the backup); the commit's
        hyperparameters do not stick."""
        for u in self.units:
            self.backup.restore(u, self.center)
        if self._kept_hparams is not None:
            assert self.server_opt is not None
            self.server_opt.restore_hyperparameters(self._kept_hparams)


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
