"""One table of a parameter-server shard: one optimizer's center on this shard, and its locks.

Owns: :class:`Table` -- the center variables of the parameters placed on this shard, stored as
one flat buffer per dtype (:class:`~distoptim.agn.flat.FlatLayout`) with its chunk plan; the
server rule and, for rules that use one, the server optimizer
(:mod:`distoptim.agn.server_optimizer`); the center guard's backup and bound
(:mod:`distoptim.agn.center_guard`); the table's read-write lock (:class:`ReadWriteLock`); its
counters; and the state a checkpoint keeps of it. How requests use a table is
:mod:`distoptim.agn.server`.
"""

from __future__ import annotations

import io
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from distoptim.agn.center_guard import (
    Backup,
    BackupUnit,
    Bound,
    Refusal,
    finite_tensor,
    unalias_state,
)
from distoptim.agn.flat import Chunk
from distoptim.agn.server_optimizer import ServerOptimizer
from distoptim.agn.transport.messages import TableSpec

__all__ = ["ReadWriteLock", "Table"]


class ReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers (no writer starvation).

    ``downgrade()`` turns the caller's write lock into a read lock atomically.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    def downgrade(self) -> None:
        with self._cond:
            self._writer = False
            self._readers += 1
            self._cond.notify_all()

    @property
    def writers_waiting(self) -> bool:
        """Whether a writer waits (a reader doing optional work should make way)."""
        return self._writers_waiting > 0


class Table:
    def __init__(
        self, name: str, spec: TableSpec, flats: Mapping[str, torch.Tensor], chunk_bytes: int
    ) -> None:
        self.name = name
        self.spec = spec
        self.layout = spec.layout()
        self.flats = {k: v.detach().clone().contiguous() for k, v in flats.items()}
        self.views = self.layout.views(self.flats)
        self.chunks = self.layout.chunks(chunk_bytes)
        rule = spec.rule
        self.server_opt = (
            ServerOptimizer(spec, self.views, self.chunks, self.flats, rule.elementwise)
            if rule.uses_optimizer
            else None
        )
        self.optimizer = None if self.server_opt is None else self.server_opt.optimizer
        self.chunkwise = rule.elementwise and (self.server_opt is None or self.server_opt.chunkwise)
        self.backup: Backup | None = None
        if self.locking:
            units = [
                BackupUnit(
                    [(c.key, c.start, c.stop)],
                    self.server_opt.chunk_params[c.index]
                    if self.server_opt is not None and self.chunkwise
                    else [],
                )
                for c in self.chunks
            ]
            if self.server_opt is not None and not self.chunkwise:
                units.append(BackupUnit([], list(self.server_opt.params)))
            self.backup = Backup(self.flats, units, self.optimizer)
        self.bound = Bound()
        self.saved_state: dict[str, Any] | None = None  # as of its latest checkpoint
        self.refreshing = threading.Lock()
        self.rw = ReadWriteLock()
        self.stats_lock = threading.Lock()
        self.version = 0
        self.commits: Counter[int] = Counter()
        self.refused = 0
        self.refused_result = 0
        self.staleness: Counter[int] = Counter()
        self.bytes_in = 0
        self.bytes_out = 0

    @property
    def locking(self) -> bool:
        """Whether commits take the write lock (see the module docstring)."""
        return self.spec.use_locking or self.spec.rule.uses_optimizer

    def refresh_backup(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Take the backup units that are not current now, unit by unit, until ``interrupted()``
        or a commit waits for the lock (unless another thread is taking them already)."""
        backup = self.backup
        if backup is None or not self.refreshing.acquire(blocking=False):
            return
        try:
            self.rw.acquire_read()
            try:
                for u in range(len(backup.units)):
                    if self.rw.writers_waiting or interrupted():
                        return
                    if backup.versions[u] != self.version:
                        backup.take(u, self.flats, self.version)
            finally:
                self.rw.release_read()
        finally:
            self.refreshing.release()

    def _fresh(self, unit: int) -> None:
        """Backup unit ``unit`` shows the current version (the caller holds the write lock)."""
        assert self.backup is not None
        if self.backup.versions[unit] != self.version:
            self.backup.take(unit, self.flats, self.version)

    def apply_chunk(
        self, chunk: Chunk, payload: Mapping[str, torch.Tensor], storages: set[int]
    ) -> Refusal | None:
        """Update chunk ``chunk`` of the center with the payload's, checked (write lock held;
        its backup unit is current)."""
        rule = self.spec.rule
        if self.server_opt is not None:
            with self.server_opt.only(chunk.index) as params:
                rule.apply(params, chunk.piece_views(payload), self.server_opt.optimizer)
            unalias_state(self.server_opt.optimizer, params, storages)
        else:
            rule.apply([chunk.of(self.flats)], [chunk.of(payload)], None)
        return None if finite_tensor(chunk.of(self.flats)) else Refusal("result")

    def apply_whole(self, payload: Mapping[str, torch.Tensor], storages: set[int]) -> None:
        """Update the whole center at once (a rule or optimizer that is not element-wise; the
        backup is current)."""
        rule = self.spec.rule
        update = self.layout.views(payload)
        if self.server_opt is not None:
            order = self.server_opt.params
            by_id = {id(v): g for v, g in zip(self.views, update)}
            rule.apply(order, [by_id[id(p)] for p in order], self.server_opt.optimizer)
            unalias_state(self.server_opt.optimizer, order, storages)
        else:
            rule.apply(self.views, update, None)

    def restore(self, units: list[int]) -> None:
        assert self.backup is not None
        for u in units:
            self.backup.restore(u, self.flats)

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.flats.items()}

    def check_worker(self, algorithm: str, signature: tuple, task: int) -> None:
        if algorithm != self.spec.algorithm:
            raise ValueError(
                f"worker {task} runs {algorithm} but optimizer {self.name!r} was seeded by the "
                f"chief as {self.spec.algorithm}: every worker must wrap the same algorithm"
            )
        if signature != self.layout.signature():
            raise ValueError(
                f"worker {task}'s parameters for optimizer {self.name!r} on this shard are "
                f"{list(signature)}, the chief seeded {list(self.layout.signature())}: every "
                "worker must build the same model (same parameter order, shapes and dtypes)"
            )

    def counters(self) -> dict[str, Any]:
        with self.stats_lock:
            return {
                "version": self.version,
                "commits": dict(self.commits),
                "refused": self.refused,
                "refused_result": self.refused_result,
                "staleness": dict(self.staleness),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
            }

    def load_counters(self, c: dict[str, Any]) -> None:
        self.version = int(c["version"])
        self.commits = Counter({int(k): int(v) for k, v in c["commits"].items()})
        self.refused = int(c["refused"])
        self.refused_result = int(c.get("refused_result", 0))
        self.staleness = Counter({int(k): int(v) for k, v in c["staleness"].items()})
        self.bytes_in = int(c["bytes_in"])
        self.bytes_out = int(c["bytes_out"])

    def state(self, locked: bool = False) -> dict[str, Any]:
        """Everything a checkpoint keeps, consistent: taken under the read lock, or under the
        write lock the caller holds (``locked``)."""
        if not locked:
            self.rw.acquire_read()
        try:
            opt_state = None
            if self.server_opt is not None:
                buf = io.BytesIO()  # deep copy of the state, detached from live tensors
                torch.save(self.server_opt.state_dict(), buf)
                opt_state = buf.getvalue()
            return {
                "spec": self.spec,
                "flats": self.snapshot(),
                "optimizer": opt_state,
                "counters": self.counters(),
            }
        finally:
            if not locked:
                self.rw.release_read()

    @classmethod
    def from_state(cls, name: str, state: dict[str, Any], chunk_bytes: int) -> Table:
        t = cls(name, state["spec"], state["flats"], chunk_bytes)
        if t.server_opt is not None and state["optimizer"] is not None:
            t.server_opt.load_state_dict(torch.load(io.BytesIO(state["optimizer"])))
        t.load_counters(state["counters"])
        return t
