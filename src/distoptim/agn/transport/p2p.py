"""The ``"p2p"`` transport: the job's TCPStore for control, one 2-rank gloo group per connection.

Owns: connecting a worker to a shard, serving a shard's connections, and moving typed messages
(:mod:`~distoptim.agn.transport.framing`) over ``send``/``recv``. Nothing here imports
``torch.distributed.rpc``.

Rendezvous and control (all keys under the cluster's namespace in the job's ``TCPStore``)
-----------------------------------------------------------------------------------------
* ``shard/<s>/incarnation`` -- a counter each start of shard ``s`` increments (1 on the first
  start, 2 after a restart, ...). A worker waits until it is >= 1 (bounded), and after a lost
  connection until it changes.
* ``shard/<s>/<inc>/next`` and the queue ``shard/<s>/<inc>/requests`` -- a worker takes
  connection number ``k`` from the counter and pushes ``(k, task)`` on the queue; the shard's
  acceptor thread pops requests (a blocking pop, no polling) and serves each connection on its
  own thread. ``close()`` pushes a stop request, which ends the acceptor without any timeout.
* ``shard/<s>/<inc>/pg/<k>/...`` -- the ``PrefixStore`` in which connection ``k``'s 2-rank
  ``ProcessGroupGloo`` (shard rank 0, worker rank 1) makes its own rendezvous.
* ``shard/<s>/<inc>/dropped/<k>`` -- set (to the shard's ``idle_timeout``) when the shard dropped
  connection ``k`` because its worker sent no request for that long; a worker whose connection
  broke reads it to tell this from a shard that died
  (:class:`~distoptim.agn.transport.base.WorkerDroppedError`).

A connection starts with :class:`~distoptim.agn.transport.messages.Hello` (the worker's task,
pid and host; the reply is :class:`~distoptim.agn.transport.messages.Welcome`), then carries one
request and its reply at a time. Every receive has a timeout: a worker waits ``timeout`` for a
reply; a shard waits ``idle_timeout`` for the next request (a worker silent for longer is
dropped; if it comes back it reconnects like a late worker). A timeout closes the connection
(gloo closes the pair), so the next request on it reconnects.

Replies are sent from the live center when possible (see :mod:`distoptim.agn.server`): the shard
sends the reply before it reads the next request and releases the table's read lock once the
bytes are out. A shard reuses each connection's receive buffers from one message to the next.
Same machine, a commit's reply is not even copied: it names where the center lies in the shard's
memory (:mod:`~distoptim.agn.transport.shared_center`), the worker copies it from there into its
parameters and then releases it (the segment's release counter, or its next request), and the
shard keeps the table's read lock until then.

Commits travel **whole** by default: the worker writes its payload (in the segment, or sends it
on the pair), then the shard applies it chunk by chunk and answers, one hand-over each way as for
an echo. A shard started with ``DISTOPTIM_AGN_STREAM=1`` has its workers **stream** them
(:mod:`distoptim.agn.transport.base`), in the chunk plan of the shard's ``chunk_bytes`` (told in
``Welcome``; 0 there: whole): on the pair, one ``send`` per chunk each way (tags
``1 + k``) and the verdict (tag ``1 + n``), so the shard updates chunk ``k`` while chunk
``k + 1`` is on the wire and sends reply chunk ``k`` back while the next ones arrive; in a
shared segment, the progress counters of :mod:`~distoptim.agn.transport.shm` announce each
chunk (x86-64 only; elsewhere commits travel whole in the segment). A wait on a counter is
bounded by the request's timeout and checks between sleeps that the peer's process is alive.
A worker that stops in the middle of a commit (it raised) tells the shard (verdict ``abort``:
the shard restores what it updated) and winds the exchange down, so the connection stays usable.

Failures: a worker whose process ends breaks its connections at once (gloo: "Connection closed
by peer"); the shard counts it dead unless it said ``Finish`` first. A shard whose process ends
breaks its workers' pending requests at once (:class:`~distoptim.agn.transport.base.
ShardLostError`); a worker allowed to wait (``reconnect_timeout``) reconnects to the shard's next
incarnation with bounded backoff.

Same machine: a worker that knows how large its messages to a shard will be
(:meth:`P2PTransport.reserve`, called when an optimizer connects) offers the shard a
shared-memory segment (:mod:`~distoptim.agn.transport.shm`); once the shard has mapped it, the
flat buffers of both directions travel there and only the header uses the pair. A shard on
another machine cannot map it and the buffers stay on the pair. ``shared_memory=False`` (or
``DISTOPTIM_AGN_SHM=0``) keeps everything on the pair.

Tensors must be on the CPU (gloo); process groups are made directly
(``torch.distributed.ProcessGroupGloo``), so they need no default group and are invisible to
``torch.distributed``'s global state.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distoptim.agn.flat import Chunk, chunk_ranges
from distoptim.agn.transport import framing
from distoptim.agn.transport.base import (
    VERDICTS,
    Handler,
    Inflow,
    ParameterServerError,
    Pending,
    ShardLostError,
    Stream,
    Transport,
    WorkerDroppedError,
)
from distoptim.agn.transport.messages import (
    Attach,
    Attached,
    ErrorReply,
    Finish,
    Hello,
    Reply,
    Request,
    Welcome,
)
from distoptim.agn.transport.shared_center import MappedCenters, SharedCenters
from distoptim.agn.transport.shm import PROGRESS_SUPPORTED, Segment
from distoptim.launch import import_dynamo_before_groups

__all__ = ["DEFAULT_IDLE_TIMEOUT", "P2PTransport"]

DEFAULT_IDLE_TIMEOUT = 1800.0
"""Seconds a shard waits for a connected worker's next request before dropping it."""

_STOP = b"stop"
_FOREVER = timedelta(days=3650)
_MAX_BACKOFF = 1.0
_FIRST_WINDOW_S = 5.0
"""A first connection waits this long for the incarnation it asked (doubling on each retry)
before it reads the incarnation again: a shard that dies before serving it and is restarted
serves the new incarnation's queue, never the old one's."""


def _store(addr: str, port: int, namespace: str, timeout: float) -> dist.Store:
    """A fresh store client (blocking waits hold a client's socket: one client per waiter)."""
    base = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(namespace, base)


def _seconds(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


class _Idle(TimeoutError):
    """No message began to arrive by the deadline (the peer sent nothing: it is idle)."""


class _Pipe:
    """One end of a connection: a 2-rank gloo group, typed messages in both directions, and
    (same machine) the shared segment the flat buffers travel in. ``replies``: this end sends
    replies (the shard's end), so its buffers go to the segment's reply region."""

    def __init__(self, pg: dist.ProcessGroup, peer: int, replies: bool) -> None:
        self.pg = pg
        self.peer = peer
        self.replies = replies
        self.segment: Segment | None = None
        self.announced = 0  # chunks this end announced on its segment progress counter
        # replies read in place (shared_center): the shard's centers, when its peer maps them;
        # the worker's mapped regions; the release count; a reply read in place, unreleased
        self.centers: SharedCenters | None = None
        self.mapped: MappedCenters | None = None
        self.released = 0
        self.unreleased = False

    def place(
        self, flats: dict[str, torch.Tensor], in_place: bool = False
    ) -> list[framing.Place] | None:
        """Where ``flats`` travel: with ``in_place``, in the shard's center regions when they
        all lie there (and the peer maps them); else offsets in the segment, where they already
        are or in this end's region (None: no segment, or they do not fit)."""
        if in_place and self.centers is not None and flats:
            found = [self.centers.locate(t) for t in flats.values()]
            if all(f is not None for f in found):
                return found  # type: ignore[return-value]
        seg = self.segment
        if seg is None or not flats:
            return None
        placed = seg.place([t.numel() * t.element_size() for t in flats.values()], self.replies)
        if placed is None:
            return None
        return [
            where if (where := seg.offset_of(t)) is not None else at
            for t, at in zip(flats.values(), placed)
        ]

    def send(
        self,
        message: Any,
        stream: framing.StreamInfo | None = None,
        copy: bool = True,
        in_place: bool = False,
    ) -> tuple[list[Any], bool]:
        """Start sending ``message``: ``(works, read_in_place)``; the works must be waited, and
        a message read in place must be released by the peer (:meth:`wait_released`).
        ``stream``: only the header goes now (the buffers follow chunk by chunk); ``copy``: put
        buffers that are not in the segment there now (else the caller does, chunk by chunk);
        ``in_place``: the buffers may be read where they are (:meth:`place`)."""
        flats = getattr(message, "flats", None) or {}
        offsets = self.place(flats, in_place)
        shared = offsets is not None and any(isinstance(o, tuple) for o in offsets)
        if offsets is not None and copy and not shared:
            seg = self.segment
            assert seg is not None
            for t, off in zip(flats.values(), offsets):
                assert isinstance(off, int)
                if not seg.holds(t, off):
                    seg.view(off, t.dtype, t.numel()).copy_(t)
        header, extra, buffers = framing.encode(message, offsets, stream)
        works = [self.pg.send([header], self.peer, 0)]
        if extra is not None:
            works.append(self.pg.send([extra], self.peer, 0))
        for i, buf in enumerate(buffers):
            works.append(self.pg.send([buf], self.peer, 1 + i))
        return works, shared

    def post(self) -> tuple[torch.Tensor, Any]:
        """Start receiving the next message's header: ``(header, work)`` for :meth:`recv`
        (``work.is_completed()`` tells whether a message began to arrive)."""
        header = torch.empty(framing.HEADER_BYTES, dtype=torch.uint8)
        return header, self.pg.recv([header], self.peer, 0)

    def release(self) -> None:
        """Worker: done with the last reply read in place (the shard may change it again)."""
        if self.unreleased and self.segment is not None:
            self.unreleased = False
            self.released += 1
            self.segment.release.publish(self.released)

    def wait_released(self, deadline: float, probe: Any) -> None:
        """Shard: wait (bounded, ``probe`` between sleeps) until the worker released the reply
        it reads in place."""
        assert self.segment is not None
        self.released += 1
        self.segment.release.wait(self.released, deadline, probe)

    def recv(
        self,
        deadline: float,
        into: dict[str, torch.Tensor] | None = None,
        pool: dict[framing.BufferSpec, torch.Tensor] | None = None,
        idle: bool = False,
        posted: tuple[torch.Tensor, Any] | None = None,
    ) -> tuple[Any, list[framing.BufferSpec], framing.StreamInfo | None]:
        """Receive one message by ``deadline`` (``time.monotonic()``): ``(message, its buffer
        specs, its stream info)``. Buffers in the shared segment are views of it (valid until
        the next message); the others are received into ``into`` where key, dtype and size
        match, else into ``pool``'s (reused), else new ones. A streamed message's ``flats`` are
        where its chunks will arrive (nothing is received yet: see :class:`_PipeInflow`).
        ``idle``: a message that did not begin by ``deadline`` raises :class:`_Idle`.
        ``posted``: the header's receive, started earlier (:meth:`post`)."""
        header, work = posted if posted is not None else self.post()
        try:
            work.wait(_seconds(deadline))
        except RuntimeError as exc:
            if idle and "Timed out" in str(exc):
                raise _Idle(str(exc)) from exc
            raise
        n, meta = framing.decode_header(header)
        if meta is None:
            extra = torch.empty(n, dtype=torch.uint8)
            self.pg.recv([extra], self.peer, 0).wait(_seconds(deadline))
            meta = bytes(extra.numpy())
        message, specs, stream = framing.finish_decode(meta)
        if not specs:
            return message, specs, stream
        flats: dict[str, torch.Tensor] = {}
        works = []
        for i, spec in enumerate(specs):
            if spec.region is not None:  # the shard's own memory, read in place (released)
                if self.mapped is None:
                    raise framing.FramingError("a buffer in place, but no region can be mapped")
                flats[spec.key] = self.mapped.view(spec.region, spec.offset, spec.dtype, spec.numel)
                self.unreleased = True
                continue
            if spec.offset >= 0:
                if self.segment is None:
                    raise framing.FramingError(
                        "a buffer in shared memory, but no segment is attached"
                    )
                flats[spec.key] = self.segment.view(spec.offset, spec.dtype, spec.numel)
                continue
            buf = self._buffer(spec, into, pool)
            if stream is None:
                works.append(self.pg.recv([buf], self.peer, 1 + i))
            flats[spec.key] = buf
        for w in works:
            w.wait(_seconds(deadline))
        message.flats = flats
        return message, specs, stream

    @staticmethod
    def _buffer(
        spec: framing.BufferSpec,
        into: dict[str, torch.Tensor] | None,
        pool: dict[framing.BufferSpec, torch.Tensor] | None,
    ) -> torch.Tensor:
        t = None if into is None else into.get(spec.key)
        if t is not None and t.dtype == spec.dtype and t.numel() == spec.numel:
            return t
        if pool is not None:
            t = pool.get(spec)
            if t is None:
                t = pool[spec] = torch.empty(spec.numel, dtype=spec.dtype)
            return t
        return torch.empty(spec.numel, dtype=spec.dtype)

    def close(self) -> None:
        self.segment = None
        with contextlib.suppress(Exception):
            self.pg.shutdown()


def _views(
    flats: dict[str, torch.Tensor], ranges: list[tuple[str, int, int]]
) -> list[torch.Tensor]:
    return [flats[key][a:b] for key, a, b in ranges]


def _seg_views(
    seg: Segment, specs: list[framing.BufferSpec], reply: bool
) -> dict[str, torch.Tensor]:
    """The views of a message with ``specs`` laid out in a region of ``seg``."""
    placed = seg.place([s.numel * s.dtype.itemsize for s in specs], reply)
    if placed is None:
        raise framing.FramingError("a streamed message that does not fit the shared segment")
    return {s.key: seg.view(o, s.dtype, s.numel) for s, o in zip(specs, placed)}


class _PipeInflow(Inflow):
    """The shard's end of a streamed commit on a connection (see the module docstring)."""

    def __init__(
        self,
        pipe: _Pipe,
        specs: list[framing.BufferSpec],
        flats: dict[str, torch.Tensor],
        info: framing.StreamInfo,
        deadline: float,
        probe: Any,
    ) -> None:
        self._pipe = pipe
        self._deadline = deadline
        self._probe = probe
        self._ranges = chunk_ranges([(s.key, s.dtype, s.numel) for s in specs], info.chunk_bytes)
        self._n = len(self._ranges)
        self._payload = _views(flats, self._ranges)
        self._base = info.base
        self._waited = self._published = 0
        self._verdict: str | None = None
        self._sends: list[Any] = []
        self._seg = pipe.segment if specs and specs[0].offset >= 0 else None
        if self._seg is not None:
            self.live = False
            self._reply: dict[str, torch.Tensor] | None = _seg_views(self._seg, specs, True)
            self._reply_views = _views(self._reply, self._ranges)
            self._recvs: list[Any] = []
        else:
            self.live = True
            self._reply = None
            self._recvs = [pipe.pg.recv([v], pipe.peer, 1 + k) for k, v in enumerate(self._payload)]
            self._code = torch.zeros(1, dtype=torch.int64)
            self._recvs.append(pipe.pg.recv([self._code], pipe.peer, 1 + self._n))

    def wait(self, chunk: int) -> None:
        while self._waited <= chunk:
            k = self._waited
            if self._seg is not None:
                self._seg.request_progress.wait(self._base + k + 1, self._deadline, self._probe)
            else:
                self._recvs[k].wait(_seconds(self._deadline))
            self._waited += 1

    def reply_buffers(self) -> dict[str, torch.Tensor] | None:
        return self._reply

    def publish(self, chunk: int, data: torch.Tensor) -> None:
        if chunk != self._published:
            raise RuntimeError(f"reply chunk {chunk} published out of order")
        pipe = self._pipe
        if self._seg is not None:
            pipe.announced += 1
            self._seg.reply_progress.publish(pipe.announced)
        else:
            self._sends.append(pipe.pg.send([data], pipe.peer, 1 + chunk))
        self._published += 1

    def verdict(self) -> str:
        if self._verdict is None:
            self.wait(self._n - 1)
            if self._seg is not None:
                self._seg.request_progress.wait(
                    self._base + self._n + 1, self._deadline, self._probe
                )
                code = self._seg.verdict.value
            else:
                self._recvs[self._n].wait(_seconds(self._deadline))
                code = int(self._code)
            words = {c: w for w, c in framing.VERDICT_CODES.items()}
            if code not in words:
                raise framing.FramingError(f"bad verdict code {code} on a streamed commit")
            self._verdict = words[code]
        return self._verdict

    def finish(self) -> None:
        """Take what the handler did not (an error): every chunk, the verdict, and publish the
        remaining reply chunks, so the connection stays in step."""
        self.wait(self._n - 1)
        self.verdict()
        source = self._reply_views if self._seg is not None else self._payload
        for k in range(self._published, self._n):
            self.publish(k, source[k])

    def wait_sent(self, deadline: float) -> None:
        _wait_all(self._sends, deadline)


def _process_gone(pid: int, host: str) -> bool:
    """Whether process ``pid`` on ``host`` is known to have ended (False when unknown)."""
    if host != socket.gethostname() or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (dead, not yet reaped) is gone too
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _wait_all(works: list[Any], deadline: float) -> None:
    for w in works:
        w.wait(_seconds(deadline))


@dataclass
class _Channel:
    """A worker's connection to one shard (one request at a time)."""

    shard: int
    incarnation: int
    pipe: _Pipe
    lock: threading.Lock
    number: int = 0  # the connection number k (store keys shard/<s>/<inc>/.../<k>)
    pid: int = 0  # the shard's process (from Welcome)
    host: str = ""
    chunk_bytes: int = 0  # the shard's chunk plan (from Welcome; 0: no streaming)
    broken: bool = False
    shm_refused: bool = False  # the shard could not map a segment (another machine)

    def probe(self) -> None:
        """Raise if the shard's process is known to have ended."""
        if _process_gone(self.pid, self.host):
            raise ShardLostError(self.shard, f"parameter server {self.shard}'s process ended")


class _P2PPending(Pending):
    def __init__(
        self,
        transport: P2PTransport,
        channel: _Channel,
        works: list[Any],
        into: dict[str, torch.Tensor] | None,
        timeout: float,
        what: str,
    ) -> None:
        self._t = transport
        self._ch = channel
        self._works = works
        self._into = into
        self._timeout = timeout
        self._what = what
        self._started = time.monotonic()
        self._done = False

    def wait(self) -> Reply:
        if self._done:
            raise RuntimeError("a pending request can be waited once")
        self._done = True
        ch = self._ch
        deadline = self._started + self._timeout
        try:
            _wait_all(self._works, deadline)
            return ch.pipe.recv(deadline, into=self._into)[0]
        except Exception as exc:
            ch.broken = True
            raise self._t._lost(ch, self._what, exc, time.monotonic() - self._started) from exc
        finally:
            ch.lock.release()

    def release(self) -> None:
        with self._ch.lock:
            self._ch.pipe.release()


class _P2PStream(Stream):
    """A worker's streamed commit on one connection (see the module docstring); holds the
    connection's lock from its start until :meth:`wait` or :meth:`abandon` returns."""

    def __init__(
        self,
        transport: P2PTransport,
        ch: _Channel,
        request: Request,
        chunks: list[Chunk],
        into: dict[str, torch.Tensor] | None,
        timeout: float,
    ) -> None:
        self._t = transport
        self._ch = ch
        self._started = time.monotonic()
        self._timeout = timeout
        self._deadline = self._started + timeout
        self._what = type(request).__name__
        pipe = ch.pipe
        flats: dict[str, torch.Tensor] = request.flats  # type: ignore[attr-defined]
        self._ranges = [(c.key, c.start, c.stop) for c in chunks]
        self._n = len(chunks)
        self._payload = _views(flats, self._ranges)
        self._next_ready = self._next_arrived = 0
        self._finished = False
        self._closed = False
        self._sends: list[Any] = []
        specs = [framing.BufferSpec(k, t.dtype, t.numel()) for k, t in flats.items()]
        offsets = pipe.place(flats) if PROGRESS_SUPPORTED else None
        self._seg = pipe.segment if offsets is not None else None
        if self._seg is not None:
            seg = self._seg
            region = _seg_views(seg, specs, False)
            self._copy = [  # payload chunks that are not in the segment yet: copied when ready
                None if seg.offset_of(flats[k]) is not None else region[k][a:b]
                for k, a, b in self._ranges
            ]
            self.reply_flats = _seg_views(seg, specs, True)
            self._reply_base = seg.reply_progress.value
            info = framing.StreamInfo(ch.chunk_bytes, pipe.announced)
            self._recvs: list[Any] = []
        else:
            self._copy = [None] * self._n
            self.reply_flats = {s.key: pipe._buffer(s, into, None) for s in specs}
            info = framing.StreamInfo(ch.chunk_bytes)
        self._sends += pipe.send(request, info, copy=False)[0]
        if self._seg is None:
            self._recvs = [
                pipe.pg.recv([v], pipe.peer, 1 + k)
                for k, v in enumerate(_views(self.reply_flats, self._ranges))
            ]

    def _fail(self, exc: BaseException) -> ParameterServerError:
        self._ch.broken = True
        self._release()
        return self._t._lost(self._ch, self._what, exc, time.monotonic() - self._started)

    def _release(self) -> None:
        if not self._closed:
            self._closed = True
            self._ch.lock.release()

    def ready(self, chunk: int) -> None:
        if chunk != self._next_ready or self._closed:
            raise RuntimeError(f"payload chunk {chunk} made ready out of order")
        pipe = self._ch.pipe
        try:
            if self._seg is not None:
                dst = self._copy[chunk]
                if dst is not None:
                    dst.copy_(self._payload[chunk])
                pipe.announced += 1
                self._seg.request_progress.publish(pipe.announced)
            else:
                self._sends.append(pipe.pg.send([self._payload[chunk]], pipe.peer, 1 + chunk))
        except Exception as exc:
            raise self._fail(exc) from exc
        self._next_ready += 1

    def finish(self, verdict: str) -> None:
        if verdict not in VERDICTS or self._next_ready != self._n or self._finished:
            raise RuntimeError(f"finish({verdict!r}) after {self._next_ready}/{self._n} chunks")
        pipe = self._ch.pipe
        code = framing.VERDICT_CODES[verdict]
        try:
            if self._seg is not None:
                self._seg.verdict.value = code
                pipe.announced += 1
                self._seg.request_progress.publish(pipe.announced)
            else:
                word = torch.tensor([code], dtype=torch.int64)
                self._sends.append(pipe.pg.send([word], pipe.peer, 1 + self._n))
        except Exception as exc:
            raise self._fail(exc) from exc
        self._finished = True

    def arrived(self, chunk: int) -> None:
        try:
            while self._next_arrived <= chunk:
                k = self._next_arrived
                if self._seg is not None:
                    self._seg.reply_progress.wait(
                        self._reply_base + k + 1, self._deadline, self._ch.probe
                    )
                else:
                    self._recvs[k].wait(_seconds(self._deadline))
                self._next_arrived += 1
        except Exception as exc:
            raise self._fail(exc) from exc

    def wait(self) -> Reply:
        if self._closed:
            raise RuntimeError("a stream can be waited once")
        if not self._finished:
            raise RuntimeError("finish() a stream before waiting for its reply")
        self.arrived(self._n - 1)
        try:
            _wait_all(self._sends, self._deadline)
            reply = self._ch.pipe.recv(self._deadline, into=self.reply_flats)[0]
        except Exception as exc:
            raise self._fail(exc) from exc
        self._release()
        return reply

    def abandon(self) -> None:
        if self._closed:
            return
        try:
            while self._next_ready < self._n:
                self.ready(self._next_ready)
            if not self._finished:
                self.finish("abort")
            self.wait()
        except Exception:
            self._ch.broken = True
        finally:
            self._release()


class P2PTransport(Transport):
    """Point-to-point transport over the job's ``TCPStore`` (``addr:port``, under ``namespace``).

    Worker side: :meth:`connect` (every shard, at start), :meth:`send`, :meth:`reconnect`,
    :meth:`close`. Shard side: :meth:`serve`, :meth:`close`. ``timeout``: how long a worker
    waits for a reply, and to set up a connection; ``idle_timeout``: how long a shard waits for
    a connected worker's next request.
    """

    name = "p2p"
    supports_restart = True

    def __init__(
        self,
        addr: str,
        port: int,
        namespace: str,
        *,
        num_ps: int,
        timeout: float,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        shared_memory: bool = True,
    ) -> None:
        import_dynamo_before_groups()  # see distoptim.launch: groups must be freed at exit
        self.addr, self.port, self.namespace = addr, port, namespace
        self.num_ps = num_ps
        self.timeout = timeout
        self.idle_timeout = idle_timeout
        self.shared_memory = shared_memory and os.environ.get("DISTOPTIM_AGN_SHM", "1") != "0"
        self._store = _store(addr, port, namespace, timeout)
        self._mapped = MappedCenters()  # shards' center regions this worker reads in place
        self._channels: dict[int, _Channel] = {}
        self._reserved: dict[int, int] = {}  # shard -> bytes the worker asked to reserve
        self._task: int | None = None
        self._closed = False
        # shard side
        self._handler: Handler | None = None
        self._acceptor: threading.Thread | None = None
        self._serving: list[threading.Thread] = []
        self._serving_lock = threading.Lock()
        self._stopping = threading.Event()

    # ---- worker side ------------------------------------------------------------------------
    def connect(self, task: int, timeout: float) -> None:
        """Connect worker ``task`` to every shard, waiting up to ``timeout`` for them to be up."""
        self._task = task
        deadline = time.monotonic() + timeout
        for s in range(self.num_ps):
            self._channels[s] = self._open(s, deadline)

    def incarnation(self, shard: int) -> int:
        return self._channels[shard].incarnation

    def current_incarnation(self, shard: int) -> int:
        """The shard's latest incarnation according to the store (0: never started)."""
        return int(self._store.add(f"shard/{shard}/incarnation", 0))

    def _open(self, shard: int, deadline: float, lost: _Channel | None = None) -> _Channel:
        """Connect to ``shard`` by ``deadline``.

        ``lost``: the connection that just broke. Its incarnation is tried again only while its
        process may be alive (a shard that dropped an idle worker, a transient error): briefly,
        with growing attempts; when that process is known gone (same host), only a newer
        incarnation is awaited. A first connection (``lost`` None) tries the current incarnation
        for :data:`_FIRST_WINDOW_S`, doubling, and reads the incarnation again between tries.
        """
        assert self._task is not None
        backoff, attempt, window = 0.01, 1.0, _FIRST_WINDOW_S
        last_error: BaseException | None = None
        while True:
            inc = self.current_incarnation(shard)
            wait_s = min(self.timeout, deadline - time.monotonic())
            if lost is not None and inc == lost.incarnation:
                wait_s = 0.0 if _process_gone(lost.pid, lost.host) else min(wait_s, attempt)
                attempt *= 2
            elif lost is None:  # the incarnation may die before serving us: look again later
                wait_s = min(wait_s, window)
                window *= 2
            if inc >= 1 and wait_s > 0:
                try:
                    return self._open_once(shard, inc, wait_s)
                except Exception as exc:  # the shard died meanwhile, or is restarting
                    last_error = exc
            if time.monotonic() + backoff > deadline:
                raise ParameterServerError(
                    f"worker {self._task} could not connect to parameter server {shard} in time "
                    f"(last error: {last_error!r}). Is the shard running, and started with the "
                    "same store and namespace?"
                ) from last_error
            time.sleep(backoff)
            backoff = min(_MAX_BACKOFF, backoff * 2)

    def _open_once(self, shard: int, inc: int, wait_s: float) -> _Channel:
        assert self._task is not None
        k = int(self._store.add(f"shard/{shard}/{inc}/next", 1))
        self._store.queue_push(f"shard/{shard}/{inc}/requests", pickle.dumps((k, self._task)))
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(f"shard/{shard}/{inc}/pg/{k}", self._store),
            1,
            2,
            timedelta(seconds=wait_s),
        )
        pipe = _Pipe(pg, 0, replies=False)
        try:
            hello = Hello(self._task, os.getpid(), socket.gethostname())
            end = time.monotonic() + max(wait_s, self.timeout)
            _wait_all(pipe.send(hello)[0], end)
            reply = pipe.recv(end)[0]
            if not isinstance(reply, Welcome):
                raise ParameterServerError(f"parameter server {shard} answered hello with {reply}")
        except BaseException:
            pipe.close()
            raise
        if (
            reply.centers is not None
            and self.shared_memory
            and MappedCenters.can_map(reply.centers)
        ):
            pipe.mapped = self._mapped  # offered with Attach (same machine)
        return _Channel(
            shard,
            reply.incarnation,
            pipe,
            threading.Lock(),
            k,
            reply.pid,
            reply.host,
            reply.chunk_bytes,
        )

    def send(
        self,
        shard: int,
        request: Request,
        timeout: float,
        into: dict[str, torch.Tensor] | None = None,
    ) -> Pending:
        ch = self._connected(shard)
        what = type(request).__name__
        self._hold(ch)
        try:
            works = ch.pipe.send(request)[0]
        except Exception as exc:
            raise self._broke(ch, what, exc) from exc
        return _P2PPending(self, ch, works, into, timeout, what)

    def chunk_bytes(self, shard: int) -> int:
        ch = self._channels.get(shard)
        return 0 if ch is None else ch.chunk_bytes

    def stream(
        self,
        shard: int,
        request: Request,
        chunks: Sequence[Chunk],
        timeout: float,
        into: dict[str, torch.Tensor] | None = None,
    ) -> Stream | None:
        ch = self._connected(shard)
        flats = getattr(request, "flats", None)
        if not ch.chunk_bytes or not flats or not chunks:
            return None
        self._hold(ch)
        try:
            return _P2PStream(self, ch, request, list(chunks), into, timeout)
        except Exception as exc:
            raise self._broke(ch, type(request).__name__, exc) from exc

    def reserve(self, shard: int, nbytes: int) -> bool:
        """Make the connection to ``shard`` carry messages of up to ``nbytes`` of flat buffers
        in shared memory (when the shard is on this machine); returns whether it does."""
        self._reserved[shard] = max(nbytes, self._reserved.get(shard, 0))
        ch = self._channels.get(shard)
        if ch is None or not self.shared_memory or ch.shm_refused:
            return False
        current = ch.pipe.segment
        if current is not None and current.message_bytes >= nbytes:
            return True
        seg = Segment.create(nbytes)
        if seg is None:
            return False
        try:
            maps = ch.pipe.mapped is not None
            attach = Attach(seg.path, seg.nbytes, seg.token, maps_centers=maps)
            reply = self.send(shard, attach, self.timeout).wait()
        finally:
            seg.unlink()  # both ends have it mapped (or it was refused): no name to leave behind
        if isinstance(reply, Attached) and reply.ok:
            with ch.lock:
                ch.pipe.segment = seg
            return True
        ch.shm_refused = True
        return False

    def outbox(self, shard: int, nbytes: list[int]) -> list[torch.Tensor] | None:
        ch = self._channels.get(shard)
        seg = None if ch is None else ch.pipe.segment
        if seg is None:
            return None
        offsets = seg.place(nbytes, reply=False)
        if offsets is None:
            return None
        return [seg.data[o : o + n] for o, n in zip(offsets, nbytes)]

    def _connected(self, shard: int) -> _Channel:
        """This worker's connection to ``shard`` (``RuntimeError`` before :meth:`connect`)."""
        ch = self._channels.get(shard)
        if ch is None:
            raise RuntimeError(f"not connected to parameter server {shard} (connect() first)")
        return ch

    @staticmethod
    def _hold(ch: _Channel) -> None:
        """Take ``ch`` for one exchange (its lock, released when the exchange ends), or raise
        :class:`ShardLostError` if it broke earlier (the lock is not kept). A reply still read
        in place is released first (the shard waits for that before it reads a request)."""
        ch.lock.acquire()
        if ch.broken:
            ch.lock.release()
            raise ShardLostError(ch.shard, "the connection broke earlier")
        ch.pipe.release()

    def _broke(self, ch: _Channel, what: str, exc: BaseException) -> ParameterServerError:
        """Starting ``what`` on held ``ch`` failed: mark it broken, release it, and return the
        error to raise."""
        ch.broken = True
        ch.lock.release()
        return self._lost(ch, what, exc, 0.0)

    def _lost(
        self, ch: _Channel, what: str, exc: BaseException, elapsed: float
    ) -> ParameterServerError:
        if isinstance(exc, ParameterServerError):
            return exc
        text = (
            f"parameter server {ch.shard} (incarnation {ch.incarnation}) did not complete "
            f"{what} ({elapsed:.1f}s, timeout {self.timeout:g}s): {exc}"
        )
        if "Timed out" in str(exc):
            return ParameterServerError(text)
        idle = self._dropped_after(ch)
        if idle is not None:
            return WorkerDroppedError(
                ch.shard,
                f"parameter server {ch.shard} dropped worker {self._task}'s connection because "
                f"the worker sent it no request for idle_timeout={idle}s (a pause between steps "
                "longer than that: evaluation, saving, a debugger); the shard itself is alive. "
                "Raise the shards' idle_timeout (agn.spawn(..., idle_timeout=SECONDS), "
                "Cluster.from_env(idle_timeout=SECONDS) or ClusterOptions(idle_timeout=SECONDS)), "
                "or start workers with reconnect_timeout > 0 to reconnect after such a drop "
                "(the commit in flight is then lost)",
            )
        return ShardLostError(ch.shard, text)

    def _dropped_after(self, ch: _Channel) -> str | None:
        """The shard's ``idle_timeout`` if it dropped connection ``ch`` for idleness, else None."""
        key = f"shard/{ch.shard}/{ch.incarnation}/dropped/{ch.number}"
        try:
            return self._store.get(key).decode() if self._store.check([key]) else None
        except Exception:  # the store is gone too: the job is ending, say what was seen
            return None

    def reconnect(self, shard: int, timeout: float) -> int:
        """Drop the broken connection to ``shard`` and connect to its next incarnation."""
        old = self._channels.pop(shard, None)
        if old is not None:
            with old.lock:
                old.pipe.close()
            self._mapped.forget(old.pid)
        ch = self._open(shard, time.monotonic() + timeout, lost=old)
        self._channels[shard] = ch
        if shard in self._reserved:
            self.reserve(shard, self._reserved[shard])
        return ch.incarnation

    # ---- shard side -------------------------------------------------------------------------
    def serve(self, handler: Handler) -> None:
        """Accept connections to ``handler`` (shard ``handler.shard``, its incarnation)."""
        self._handler = handler
        self._acceptor = threading.Thread(
            target=self._accept, name=f"agn-ps{handler.shard}-accept", daemon=True
        )
        self._acceptor.start()

    def _prefix(self) -> str:
        assert self._handler is not None
        return f"shard/{self._handler.shard}/{self._handler.incarnation}"

    def _accept(self) -> None:
        store = _store(self.addr, self.port, self.namespace, _FOREVER.total_seconds())
        queue = f"{self._prefix()}/requests"
        while True:
            try:
                value = store.queue_pop(queue)
            except Exception:
                if self._stopping.is_set():
                    return
                raise
            if value == _STOP or self._stopping.is_set():
                return
            k, task = pickle.loads(value)
            thread = threading.Thread(
                target=self._serve_connection,
                args=(k, task),
                name=f"agn-ps-conn{k}-worker{task}",
                daemon=True,
            )
            with self._serving_lock:
                self._serving.append(thread)
            thread.start()

    def _serve_connection(self, k: int, task: int) -> None:
        handler = self._handler
        assert handler is not None
        store = _store(self.addr, self.port, self.namespace, self.timeout)
        try:
            pg = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{self._prefix()}/pg/{k}", store),
                0,
                2,
                timedelta(seconds=self.timeout),
            )
        except Exception:
            return  # the worker went away before the connection was made
        pipe = _Pipe(pg, 1, replies=True)
        pool: dict[framing.BufferSpec, torch.Tensor] = {}
        try:
            first = pipe.recv(time.monotonic() + self.timeout)[0]
            if not isinstance(first, Hello) or first.task != task:
                return
            handled = handler.handle(first)
            _wait_all(pipe.send(handled.reply)[0], time.monotonic() + self.timeout)

            def probe() -> None:
                if _process_gone(first.pid, first.host):
                    raise ShardLostError(handler.shard, f"worker {task}'s process ended")

            posted = None  # the next request's header, received while the shard works ahead
            while not self._stopping.is_set():
                try:
                    request, specs, info = pipe.recv(
                        time.monotonic() + self.idle_timeout, pool=pool, idle=True, posted=posted
                    )
                    posted = None
                except _Idle:  # the worker is told why, should it come back (WorkerDroppedError)
                    with contextlib.suppress(Exception):
                        store.set(f"{self._prefix()}/dropped/{k}", f"{self.idle_timeout:g}")
                    handler.connection_lost(task)
                    return
                except Exception:
                    handler.connection_lost(task)
                    return
                if isinstance(request, Attach):  # the transport's own business
                    pipe.segment = Segment.attach(request.path, request.nbytes, request.token)
                    if pipe.segment is not None and request.maps_centers:
                        pipe.centers = handler.centers  # replies to commits read in place
                    _wait_all(
                        pipe.send(Attached(pipe.segment is not None))[0],
                        time.monotonic() + self.timeout,
                    )
                    continue
                deadline = time.monotonic() + self.timeout
                inflow = None
                if info is not None:
                    flats = request.flats  # type: ignore[attr-defined]
                    inflow = _PipeInflow(pipe, specs, flats, info, deadline, probe)
                handled = handler.handle(request, live_reply=True, inflow=inflow)
                try:
                    if inflow is not None:
                        inflow.finish()
                    works, shared = pipe.send(handled.reply, in_place=handled.in_place)
                    _wait_all(works, deadline)
                    if inflow is not None:
                        inflow.wait_sent(deadline)
                    if shared:  # the worker reads the center itself: unchanged until it is done
                        pipe.wait_released(deadline, probe)
                except Exception:
                    handler.connection_lost(task)
                    return
                finally:
                    handled.sent()
                if isinstance(request, Finish) and not isinstance(handled.reply, ErrorReply):
                    return
                posted = pipe.post()  # work ahead until the worker's next request begins
                handler.idle(posted[1].is_completed)
        except Exception:
            handler.connection_lost(task)
        finally:
            pipe.close()

    def gone(self, tasks: Sequence[int]) -> list[int]:
        return []  # a broken connection already told the shard (connection_lost)

    # ---- both -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ch in self._channels.values():
            with ch.lock:
                ch.pipe.close()
        self._channels.clear()
        if self._acceptor is not None:
            self._stopping.set()
            with contextlib.suppress(Exception):
                self._store.queue_push(f"{self._prefix()}/requests", _STOP)
            self._acceptor.join(self.timeout)
            with self._serving_lock:
                threads = list(self._serving)
            for t in threads:  # each ends after its worker's Finish (or its loss)
                t.join(min(5.0, self.timeout))
