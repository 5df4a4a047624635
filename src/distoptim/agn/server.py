"""The parameter-server shard: its tables, the requests it serves, checkpoints, membership.

Owns: everything one PS process keeps and does, independent of the transport. A shard holds
one *table* per distributed optimizer (keyed by the optimizer's ``name``, so one cluster can
serve several optimizers, e.g. a generator and a discriminator): the center variables of the
parameters placed on this shard (``AGNCustomGetter``), the server rule the chief seeded it with
(:mod:`distoptim.agn.rules`) and its server optimizer, under the table's lock, with its counters
(:class:`~distoptim.agn.table.Table`).

Requests arrive as typed messages (:mod:`distoptim.agn.transport.messages`);
:meth:`ParameterServer.handle` gives each type its own method. A commit goes down the floors:
:meth:`ParameterServer.commit` finds its table; :meth:`Table.commit
<distoptim.agn.table.Table.commit>` takes the table's lock and counts it (the concurrency and
the math are there); :class:`~distoptim.agn.center_guard.GuardedCommit` applies it chunk by
chunk as it arrives, guarded, with the table's :class:`~distoptim.agn.rules.ServerRule` (and
server optimizer, :mod:`distoptim.agn.server_optimizer`); back here, a due checkpoint is
written before the table's lock is released, and the answer goes out.

Between requests (:meth:`ParameterServer.idle`) a shard takes the backups of its tables' current
versions ahead, chunk by chunk, and stops as soon as a request arrives or a commit waits.

Membership: a worker is *finished* (it said so), *failed* (it said it raised) or *dead* (its
connection broke without a word, a probe found its process gone, or the launcher said it
died). :meth:`wait_for_workers` returns once every worker the cluster knows of is one of those;
``num_worker`` is the expected count and late workers add to it (elastic clusters). A dead
worker that reconnects (p2p) is alive again.

Checkpoints (``checkpoint_dir``, :mod:`distoptim.agn.shard_checkpoint`): every
``checkpoint_every`` accepted commits of a table -- before that table accepts its next commit, so a
restart loses at most ``checkpoint_every`` of its accepted commits (plus the commits in flight,
which their workers see fail) -- when the chief seeds a table, and when the shard stops. A shard
started with an existing checkpoint loads it: its tables are seeded already, so the chief's seed
is ignored (the chief pulls the resumed center like everyone else) and ``version`` continues; a
chief or worker whose model differs from the checkpoint's is told that the checkpoint holds
another model (a stale file in ``checkpoint_dir``), naming it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from distoptim.agn.flat import DEFAULT_CHUNK_BYTES, nbytes
from distoptim.agn.shard_checkpoint import CHECKPOINT_FORMAT, ShardCheckpoint
from distoptim.agn.table import Table
from distoptim.agn.transport.base import Handled, Inflow
from distoptim.agn.transport.messages import (
    Ack,
    Commit,
    Echo,
    EchoReply,
    ErrorReply,
    Finish,
    Hello,
    Ping,
    Pong,
    Pull,
    PullReply,
    Request,
    Seed,
    TableSpec,
    Welcome,
)
from distoptim.agn.transport.shared_center import SharedCenters
from distoptim.comm.link import transmit

__all__ = ["CHECKPOINT_FORMAT", "CHUNK_ENV", "STREAM_ENV", "ParameterServer"]

CHUNK_ENV = "DISTOPTIM_AGN_CHUNK_BYTES"
"""Overrides :data:`~distoptim.agn.flat.DEFAULT_CHUNK_BYTES` for a shard started with it set."""

STREAM_ENV = "DISTOPTIM_AGN_STREAM"
"""``1`` on a shard: its workers stream commits chunk by chunk (p2p); unset or ``0``: each commit
travels whole (the default: fewer hand-overs between the two processes, see docs/agn.md)."""


def _stream_from_env() -> bool:
    raw = os.environ.get(STREAM_ENV, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{STREAM_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def _chunk_bytes_from_env() -> int:
    raw = os.environ.get(CHUNK_ENV)
    if raw is None:
        return DEFAULT_CHUNK_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{CHUNK_ENV} must be a positive number of bytes, got {raw!r}")
    return value


class ParameterServer:
    """One PS shard (``shard`` of ``num_ps``) expecting ``num_worker`` workers.

    A transport calls :meth:`handle` for every request it receives; :meth:`wait_for_workers`
    is the serving loop's end condition. ``incarnation``: 1 + the number of times this shard
    was restarted (told to workers in :class:`~distoptim.agn.transport.messages.Welcome`).
    ``chunk_bytes``: the chunk size of every table's plan (default
    :data:`~distoptim.flat.DEFAULT_CHUNK_BYTES`, or ``DISTOPTIM_AGN_CHUNK_BYTES``): a commit is
    applied chunk by chunk in it. ``stream``: workers stream their commits in that plan (told in
    ``Welcome``; default ``DISTOPTIM_AGN_STREAM``, off). ``store``: the cluster's store (a
    ``torch.distributed.Store``), where the checkpoints written are recorded
    (:class:`~distoptim.agn.shard_checkpoint.ShardCheckpoint`). ``centers``: where tables keep
    their center buffers (:class:`~distoptim.agn.transport.shared_center.SharedCenters`, so
    same-machine workers read replies in place; None: private memory).
    """

    def __init__(
        self,
        shard: int,
        num_ps: int,
        num_worker: int,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        incarnation: int = 1,
        chunk_bytes: int | None = None,
        store: dist.Store | None = None,
        stream: bool | None = None,
        centers: SharedCenters | None = None,
    ) -> None:
        self.shard = shard
        self.num_ps = num_ps
        self.num_worker = num_worker
        self.incarnation = incarnation
        self.chunk_bytes = _chunk_bytes_from_env() if chunk_bytes is None else int(chunk_bytes)
        if self.chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes!r}")
        self.stream = _stream_from_env() if stream is None else bool(stream)
        self.centers = centers
        self._allocate = None if centers is None else centers.allocate
        self.checkpoint_dir = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.checkpoint_every = checkpoint_every
        self._tables: dict[str, Table] = {}
        self._resumed: set[str] = set()
        self._cond = threading.Condition()
        self._finished: set[int] = set()
        self._failed: set[int] = set()
        self._dead: set[int] = set()
        self._hosts: dict[int, str] = {}
        self.started = time.monotonic()
        self._checkpoint: ShardCheckpoint | None = None
        if self.checkpoint_dir is not None:
            self._checkpoint = ShardCheckpoint(self.checkpoint_dir, shard, num_ps, store)
            self.removed_temporaries = self._checkpoint.remove_temporaries()
            path = self._checkpoint.path
            for name, state in self._checkpoint.load().items():
                try:
                    table = Table.from_state(name, state, self.chunk_bytes, self._allocate)
                except Exception as exc:
                    raise ValueError(
                        f"checkpoint {path}: optimizer {name!r} cannot be restored "
                        f"({type(exc).__name__}: {exc}); remove the checkpoint or use another "
                        "checkpoint_dir"
                    ) from exc
                table.saved_state = state
                table.resumed_from = path
                self._tables[name] = table
                self._resumed.add(name)

    # ---- requests ----------------------------------------------------------------------------
    def handle(
        self, request: Request, live_reply: bool = False, inflow: Inflow | None = None
    ) -> Handled:
        """Answer one request (never raises for the worker's mistakes: they become an
        :class:`ErrorReply` that the worker re-raises by type).

        ``live_reply``: the transport sends the reply before anything else can change the center
        and calls :meth:`Handled.sent` afterwards, so replies may reference the live center.
        ``inflow``: a streamed commit's payload arriving and reply leaving, chunk by chunk
        (:class:`~distoptim.agn.transport.base.Inflow`).
        """
        try:
            match request:
                case Commit():
                    return self.commit(request, live_reply, inflow)
                case Pull():
                    return self.pull(request, live_reply)
                case Seed():
                    return self.seed(request)
                case Hello():
                    return Handled(self.hello(request))
                case Finish():
                    return Handled(self.finish(request.task, request.failed))
                case Ping():
                    return Handled(Pong(os.getpid()))
                case Echo():
                    return Handled(EchoReply(request.flats))
                case _:
                    raise TypeError(f"unknown request {type(request).__name__}")
        except (ValueError, TypeError, RuntimeError, TimeoutError) as exc:
            return Handled(ErrorReply(type(exc).__name__, str(exc)))

    def idle(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Between requests: copy ahead what the next commit would copy on its critical path
        (each locked table's backup, :class:`~distoptim.agn.center_guard.Backup`), chunk by chunk,
        stopping as soon as ``interrupted()`` (a request arrived) or a commit waits. A transport
        calls this after a reply is out, while the worker is busy with its next steps."""
        with self._cond:
            tables = list(self._tables.values())
        for t in tables:
            if interrupted():
                return
            t.refresh_backup(interrupted)

    def hello(self, request: Hello) -> Welcome:
        """A worker connected (again: a worker counted dead is alive again)."""
        with self._cond:
            self._dead.discard(request.task)
            self._hosts[request.task] = request.host
        return Welcome(
            self.shard,
            self.incarnation,
            os.getpid(),
            socket.gethostname(),
            self.chunk_bytes if self.stream else 0,
            None if self.centers is None else self.centers.probe(),
        )

    def seed(self, request: Seed) -> Handled:
        """Create table ``request.table`` from the chief's values; if it exists (resumed),
        keep it and check that the chief built the same thing."""
        spec, flats = request.spec, request.flats
        if not isinstance(spec, TableSpec):
            raise TypeError("seed needs a TableSpec")
        layout = spec.layout()
        layout.check(flats, "seed")
        created = False
        with self._cond:
            table = self._tables.get(request.table)
            if table is None:
                table = Table(request.table, spec, flats, self.chunk_bytes, self._allocate)
                table.saved_state = table.state() if self.checkpoint_dir is not None else None
                self._tables[request.table] = table
                self._cond.notify_all()
                created = True
            else:
                table.check_worker(spec.algorithm, layout.signature(), task=-1)
                if table.spec.rule != spec.rule:
                    raise ValueError(
                        f"optimizer {request.table!r} {table.origin()} rule {table.spec.rule!r}, "
                        f"the chief now seeds {spec.rule!r}{table.remedy()}"
                    )
        if created:  # a restart from here on resumes this table (not a seed nobody sends again)
            self.checkpoint()
        with table.stats_lock:
            table.bytes_in += nbytes(flats)
        pull = Pull(request.table, -1, spec.algorithm, layout.signature(), 0.0)
        return self.pull(pull, live_reply=False)

    def pull(self, request: Pull, live_reply: bool = False) -> Handled:
        """The current center (waiting up to ``request.wait_s`` for the chief's seed)."""
        table = self._table(request.table, request.wait_s)
        table.check_worker(request.algorithm, request.signature, request.task)
        locking = table.locking
        if locking:
            table.rw.acquire_read()
        if live_reply:
            flats, version = table.flats, table.version
            after = table.rw.release_read if locking else None
        else:
            try:
                flats, version = table.snapshot(), table.version
            finally:
                if locking:
                    table.rw.release_read()
            after = None
        out = nbytes(flats)
        with table.stats_lock:
            table.bytes_out += out
        transmit(out)
        reply = PullReply(version, flats, resumed=request.table in self._resumed)
        return Handled(reply, after)

    def commit(
        self, request: Commit, live_reply: bool = False, inflow: Inflow | None = None
    ) -> Handled:
        """Apply one commit of worker ``request.task`` to its table
        (:meth:`Table.commit <distoptim.agn.table.Table.commit>`: the math and the arguments) and
        answer it; every ``checkpoint_every`` accepted commits of a table, the checkpoint is on
        disk before the table's lock is released -- before it accepts another commit, so a
        restart loses at most ``checkpoint_every`` of its accepted commits."""
        table = self._table(request.table)
        applied = table.commit(request, live_reply, inflow)
        every = self.checkpoint_every
        if applied.held and applied.accepted and every is not None and applied.version % every == 0:
            try:
                self.checkpoint(held=table)
            except BaseException:
                applied.abandon()
                raise
        return applied.answer()

    # ---- tables --------------------------------------------------------------------------------
    def _table(self, name: str, wait_s: float = 0.0) -> Table:
        deadline = time.monotonic() + wait_s
        with self._cond:
            while name not in self._tables:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"optimizer {name!r} has no center variables on parameter server "
                        f"{self.shard} yet (waited {wait_s:g}s): the chief seeds them in "
                        "make_session_run_hook(is_chief=True, ...).after_create_session(); is "
                        "a chief running, and did it build the same optimizer name?"
                    )
                self._cond.wait(left)
            return self._tables[name]

    # ---- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> str | None:
        return None if self._checkpoint is None else self._checkpoint.path

    def checkpoint(self, held: Table | None = None) -> str | None:
        """Write every table to this shard's checkpoint file (:meth:`ShardCheckpoint.write
        <distoptim.agn.shard_checkpoint.ShardCheckpoint.write>`: ``held``'s write lock is the
        caller's); its path, or None without ``checkpoint_dir``."""
        if self._checkpoint is None:
            return None
        with self._cond:
            tables = dict(self._tables)
        return self._checkpoint.write(tables, held)

    # ---- workers' lifecycle ----------------------------------------------------------------------
    def finish(self, task: int, failed: bool) -> Ack:
        """Worker ``task`` is done (``failed``: it raised)."""
        with self._cond:
            self._dead.discard(task)
            (self._failed if failed else self._finished).add(task)
            self._cond.notify_all()
        return Ack()

    def connection_lost(self, task: int) -> None:
        """Worker ``task``'s connection broke: dead, unless it said it was done."""
        with self._cond:
            if task not in self._finished and task not in self._failed:
                self._dead.add(task)
            self._cond.notify_all()

    def is_done(self, task: int) -> bool:
        with self._cond:
            return task in self._finished or task in self._failed

    def _ended(self) -> set[int]:
        return self._finished | self._failed | self._dead

    def wait_for_workers(
        self,
        gone: Callable[[list[int]], Mapping[int, str]],
        probe_period_s: float = 1.0,
        timeout_s: float | None = None,
        task_count: Callable[[], int] | None = None,
    ) -> None:
        """Return once every worker the cluster knows of has finished, failed or died.

        ``task_count()`` (default: ``num_worker``) is how many tasks exist now (the expected
        ones plus late joiners). Wakes at every ``finish``; every ``probe_period_s`` without news
        it calls ``gone(pending_tasks)``, which maps tasks known to have ended to ``"finished"``,
        ``"failed"`` or ``"dead"``. A task that finished meanwhile is never counted dead.
        ``timeout_s`` bounds the whole wait.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        count = task_count or (lambda: self.num_worker)
        while True:
            n = max(self.num_worker, count())
            with self._cond:
                pending = [t for t in range(n) if t not in self._ended()]
                if not pending:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"parameter server {self.shard}: workers {pending} neither finished nor "
                        f"died within {timeout_s:g}s"
                    )
                self._cond.wait(probe_period_s)
                pending = [t for t in range(n) if t not in self._ended()]
            if pending:
                news = gone(pending)
                with self._cond:
                    for t, how in news.items():
                        if t in self._finished or t in self._failed:
                            continue
                        if how == "finished":
                            self._dead.discard(t)
                            self._finished.add(t)
                        elif how == "failed":
                            self._dead.discard(t)
                            self._failed.add(t)
                        else:
                            self._dead.add(t)

    # ---- read-outs -------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """This shard's tables (param indices, center per parameter, counters) and workers."""
        with self._cond:
            tables = dict(self._tables)
            dead = sorted(self._dead)
            failed = sorted(self._failed)
            finished = sorted(self._finished)
        out: dict[str, Any] = {}
        for name, t in tables.items():
            t.rw.acquire_read()
            try:
                flats = t.snapshot()
            finally:
                t.rw.release_read()
            out[name] = {
                "param_indices": list(t.spec.param_indices),
                "center": [v.clone() for v in t.layout.views(flats)],
                "counters": t.counters(),
                "algorithm": t.spec.algorithm,
                "resumed": name in self._resumed,
            }
        return {
            "shard": self.shard,
            "tables": out,
            "dead_workers": dead,
            "failed_workers": failed,
            "finished_workers": finished,
            "wall_time_s": time.monotonic() - self.started,
            "incarnation": self.incarnation,
        }
