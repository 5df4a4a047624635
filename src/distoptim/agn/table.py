"""One table of a parameter-server shard: one optimizer's center on this shard, and its commits.

Owns: :class:`Table` -- the center variables of the parameters placed on this shard, stored as
one flat buffer per dtype (:class:`~distoptim.agn.flat.FlatLayout`), in parameter order, with its
chunk plan; the server rule the chief seeded it with (:mod:`distoptim.agn.rules`) and, for rules
that use one, the **server optimizer** (:mod:`distoptim.agn.server_optimizer`): a new instance of
the worker's wrapped optimizer class with its hyperparameters (per param group), whose state
lives here, over views into the center; the center guard's backup and bound
(:mod:`distoptim.agn.center_guard`); the table's read-write lock (:class:`ReadWriteLock`); its
counters -- ``version`` (accepted commits = the global step), commits per worker, refused
commits (and how many for a non-finite *result*), the staleness histogram, bytes in/out; the
state a checkpoint keeps of it; and how a commit is applied to it (:meth:`Table.commit`).

Concurrency and math of a commit (:meth:`Table.commit`), one request per shard per worker
commit::

    with the table's write lock (if use_locking, or the rule uses an optimizer):
        staleness = version - version_at_workers_last_pull
        for each chunk k of the payload, as it arrives (flat.Chunk):
            the backup of chunk k is current (taken ahead while idle, else copied now)
            center[k] <- rule(center[k], payload[k]); check center[k] is finite (in cache)
            reply chunk k <- center[k] (the backup's, i.e. the old one, for EASGD); publish it
        accepted (every chunk finite, the worker's verdict "ok"): version += 1
        refused: every updated chunk restored from the backup -- center, optimizer state and
                 hyperparameters exactly as before; the reply is the (unchanged) center

A rule applies chunk by chunk when it is element-wise (``ServerRule.elementwise``; with a server
optimizer, that optimizer too: :mod:`distoptim.agn.server_optimizer`); otherwise the shard waits
for the whole payload, applies it whole, then checks and publishes chunk by chunk. A transport
that streams (p2p) overlaps all of this with the transfer; one that does not (rpc) hands over the
whole payload and takes the reply from the spent payload buffers.

Replies from the live center: when the transport sends a reply before anything else can change
the center (p2p), reply chunks are sent from the center itself (no copy) or copied into the
connection's shared segment while in cache -- or, for a whole commit to a worker on the same
machine, not copied at all: the center's buffers live where such workers map them
(``allocate``, :mod:`~distoptim.agn.transport.shared_center`) and the worker reads them in
place. The write lock is then downgraded to a read lock, held until the reply's bytes are out
(read in place: until the worker released them). Readers (replies, pulls) proceed together; a
commit waits for them (writers first, so commits are not starved). With ``use_locking=False``
additive rules run without the lock (Hogwild!-style: a concurrent pull may see a partly applied
update, as with TF's ``use_locking=False``), whole, guarded by a bound
(:func:`~distoptim.agn.center_guard.apply_unlocked`). Counters are always exact (their own lock).
"""

from __future__ import annotations

import io
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from distoptim.agn.center_guard import (
    Backup,
    Bound,
    GuardedCommit,
    Refusal,
    apply_unlocked,
    backup_for,
)
from distoptim.agn.flat import nbytes
from distoptim.agn.server_optimizer import ServerOptimizer
from distoptim.agn.transport.base import Arrived, Handled, Inflow
from distoptim.agn.transport.messages import Commit, CommitReply, TableSpec
from distoptim.comm.link import transmit

__all__ = ["AppliedCommit", "ReadWriteLock", "Table"]


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
    """One optimizer's center on this shard (see the module docstring): ``flats`` (the center
    buffers), ``views`` (per variable), ``chunks`` (the chunk plan), ``server_opt``/``optimizer``
    (or None), ``backup`` (locked tables) and ``bound`` (the guard's), ``rw`` (the lock),
    ``version`` and the other counters (under ``stats_lock``), ``saved_state`` (as of its latest
    checkpoint)."""

    def __init__(
        self,
        name: str,
        spec: TableSpec,
        flats: Mapping[str, torch.Tensor],
        chunk_bytes: int,
        allocate: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.name = name
        self.spec = spec
        self.layout = spec.layout()
        if allocate is None:
            self.flats = {k: v.detach().clone().contiguous() for k, v in flats.items()}
        else:  # where same-machine workers read replies in place (p2p)
            self.flats = allocate(flats)
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
            self.backup = backup_for(self.flats, self.chunks, self.server_opt, self.chunkwise)
        self.bound = Bound()
        self.saved_state: dict[str, Any] | None = None  # as of its latest checkpoint
        self.resumed_from: str | None = None  # the checkpoint file it was loaded from
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

    def commit(
        self, request: Commit, live_reply: bool = False, inflow: Inflow | None = None
    ) -> AppliedCommit:
        """Apply one commit of worker ``request.task`` (see the module docstring for the math).

        ``request.flats`` is consumed: its buffers may carry the reply. ``inflow``: the
        transport's end of a streamed commit (None: the payload is all here, and the reply is
        written into it). ``live_reply``: the reply may reference the live center (the transport
        sends it before anything else can change the center). A locked table's write lock is
        still held on return (:class:`AppliedCommit`).
        """
        payload = request.flats
        if not request.refused_by_worker:
            self.layout.check(payload, "commit payload")
        if inflow is None:  # the reply goes from the center (live) or in the spent payload
            whole = payload and not request.refused_by_worker and not live_reply
            inflow = Arrived(payload if whole else None)
        if not self.locking:
            return self._commit_unlocked(request, inflow)
        assert self.backup is not None
        self.rw.acquire_write()
        try:
            staleness = self.version - request.pulled_version
            guarded = GuardedCommit(
                self.spec.rule,
                self.flats,
                self.views,
                self.layout,
                self.chunks,
                self.backup,
                self.version,
                self.server_opt,
                payload,
                request.refused_by_worker,
                request.hparams,
            )
            refusal = guarded.run(inflow)
            accepted = refusal is None
            version = self.count_commit(request.task, staleness, refusal, payload)
            if accepted and inflow.streamed:
                reply_flats: dict[str, torch.Tensor] = {}  # the published chunks are the reply
            elif accepted:
                reply_flats = inflow.reply_buffers() or dict(guarded.source)
            elif live_reply:
                reply_flats = self.flats  # sent before the center can change (read lock)
            elif payload and not request.refused_by_worker:
                reply_flats = payload  # the spent payload buffers carry the center
                torch._foreach_copy_(list(payload.values()), [self.flats[k] for k in payload])
            else:
                reply_flats = self.snapshot()
        except BaseException:
            self.rw.release_write()
            raise
        streamed = accepted and inflow.streamed
        return AppliedCommit(
            self, version, staleness, refusal, reply_flats, streamed, held=True, live=live_reply
        )

    def _commit_unlocked(self, request: Commit, inflow: Inflow) -> AppliedCommit:
        """A commit to a table without the lock (``use_locking=False``, bounded rules):
        applied whole once it arrived, guarded by a bound; the reply is the center as it is."""
        payload = request.flats
        rule = self.spec.rule
        chunks = self.chunks if payload and not request.refused_by_worker else []
        for chunk in chunks:
            inflow.wait(chunk.index)
        verdict = inflow.verdict() if chunks else "ok"
        staleness = self.version - request.pulled_version
        refusal: Refusal | None = None
        if request.refused_by_worker or verdict == "refuse":
            refusal = Refusal("payload")
        elif verdict == "abort":
            refusal = Refusal("abandoned")
        source = self.flats
        if refusal is None:
            if rule.reply_before_update:
                source = self.snapshot()  # others may change the center meanwhile
            refusal = apply_unlocked(
                rule, self.flats, self.views, payload, self.layout.views(payload), self.bound
            )
            if refusal is not None:
                source = self.flats
        target = inflow.reply_buffers()
        if not inflow.streamed:
            target = None  # the reply is the center as it is (Hogwild!), or the snapshot
        for chunk in chunks:
            inflow.publish_chunk(chunk, source, target)
        accepted = refusal is None
        version = self.count_commit(request.task, staleness, refusal, payload)
        if inflow.streamed and chunks and accepted:
            reply_flats: dict[str, torch.Tensor] = {}
        elif target is not None and chunks:
            reply_flats = dict(target)
        else:
            reply_flats = dict(source)
        streamed = inflow.streamed and bool(chunks) and accepted
        return AppliedCommit(self, version, staleness, refusal, reply_flats, streamed)

    def count_commit(
        self,
        task: int,
        staleness: int,
        refusal: Refusal | None,
        payload: Mapping[str, torch.Tensor],
    ) -> int:
        """Count one finished commit (accepted: a new version, the worker's commit and its
        staleness; refused for a reason other than being abandoned: a refusal) and the bytes it
        moved; returns the version after it."""
        with self.stats_lock:
            if refusal is None:
                self.version += 1
                self.commits[task] += 1
                self.staleness[staleness] += 1
            elif refusal.reason != "abandoned":
                self.refused += 1
                self.refused_result += int(refusal.reason == "result")
            self.bytes_in += nbytes(payload)
            self.bytes_out += nbytes(self.flats)
            return self.version

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.flats.items()}

    def origin(self) -> str:
        """Where this table came from, in words: ``"was seeded by the chief as"`` or ``"was
        resumed from checkpoint PATH, which holds"``."""
        if self.resumed_from is None:
            return "was seeded by the chief as"
        return f"was resumed from checkpoint {self.resumed_from}, which holds"

    def remedy(self) -> str:
        """What to do about a mismatch with a resumed table (a stale checkpoint), or ``""``."""
        if self.resumed_from is None:
            return ""
        return (
            ". The checkpoint is from another run: remove it or use another checkpoint_dir "
            "(or build the model it was written with)"
        )

    def check_worker(self, algorithm: str, signature: tuple, task: int) -> None:
        """Raise ``ValueError`` unless ``task`` (-1: the chief's seed) runs this table's
        algorithm on the same model (parameter order, shapes, dtypes)."""
        who = "the chief" if task < 0 else f"worker {task}"
        if algorithm != self.spec.algorithm:
            raise ValueError(
                f"{who} runs {algorithm} but optimizer {self.name!r} {self.origin()} "
                f"{self.spec.algorithm}: every worker must wrap the same algorithm{self.remedy()}"
            )
        if signature != self.layout.signature():
            if self.resumed_from is None:
                held = f"the chief seeded {list(self.layout.signature())}"
            else:
                held = f"{self.origin()} {list(self.layout.signature())}"
            raise ValueError(
                f"{who}'s parameters for optimizer {self.name!r} on this shard are "
                f"{list(signature)}; {held}: every worker must build the same model (same "
                f"parameter order, shapes and dtypes){self.remedy()}"
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
    def from_state(
        cls,
        name: str,
        state: dict[str, Any],
        chunk_bytes: int,
        allocate: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> Table:
        t = cls(name, state["spec"], state["flats"], chunk_bytes, allocate)
        if t.server_opt is not None and state["optimizer"] is not None:
            t.server_opt.load_state_dict(torch.load(io.BytesIO(state["optimizer"])))
        t.load_counters(state["counters"])
        return t


@dataclass
class AppliedCommit:
    """A commit applied to a table (accepted or refused) and not answered yet.

    With ``held``, the table's write lock is still held, so that the shard can write a due
    checkpoint before the table accepts another commit; :meth:`answer` then releases it -- or,
    for a ``live`` reply, downgrades it to a read lock released once the reply's bytes are out
    (:meth:`Handled.sent <distoptim.agn.transport.base.Handled.sent>`) -- and :meth:`abandon`
    releases it when something failed before the answer.
    """

    table: Table
    version: int
    """The table's version after this commit."""
    staleness: int
    refusal: Refusal | None
    reply_flats: dict[str, torch.Tensor]
    """The reply buffers (empty when the reply chunks were already streamed)."""
    streamed: bool
    held: bool = False
    live: bool = False

    @property
    def accepted(self) -> bool:
        return self.refusal is None

    def abandon(self) -> None:
        """Release the write lock without answering."""
        if self.held:
            self.held = False
            self.table.rw.release_write()

    def answer(self) -> Handled:
        """Release (or downgrade) the lock and give the reply; its bytes, the size of the center,
        go through the emulated link."""
        after: Callable[[], None] | None = None
        if self.held:
            self.held = False
            if self.live:
                self.table.rw.downgrade()
                after = self.table.rw.release_read
            else:
                self.table.rw.release_write()
        transmit(nbytes(self.table.flats))
        in_place = self.live and not self.streamed
        reply = CommitReply(
            refused=self.refusal is not None,
            version=self.version,
            staleness=self.staleness,
            flats=self.reply_flats,
            reason="" if self.refusal is None else self.refusal.describe(),
            streamed=self.streamed,
        )
        return Handled(reply, after, in_place)
