"""A worker's side of a p2p connection: the open channel and its requests in flight.

Owns: ``_Channel`` (a worker's connection to one shard incarnation), ``_P2PPending`` (a request
whose reply is awaited) and ``_P2PStream`` (a commit streamed chunk by chunk), and telling a
peer process that is gone from one that is slow. The protocol is in
:mod:`distoptim.agn.transport.p2p`'s docstring.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from distoptim.agn.flat import Chunk
from distoptim.agn.transport import framing
from distoptim.agn.transport.base import (
    VERDICTS,
    ParameterServerError,
    Pending,
    ShardLostError,
    Stream,
)
from distoptim.agn.transport.messages import (
    Reply,
    Request,
)
from distoptim.agn.transport.pair import _Pipe, _seconds, _seg_views, _views, _wait_all
from distoptim.agn.transport.shm import PROGRESS_SUPPORTED

if TYPE_CHECKING:
    from distoptim.agn.transport.p2p import P2PTransport

DROPPED = "dropped"
"""How the notice a shard leaves for a connection it ended begins when it dropped it for
idleness (followed by its ``idle_timeout``); otherwise the notice is :data:`CLOSED`."""
CLOSED = "closed"

_NOTICE_CHECK_S = 0.5
"""How often a streamed commit waiting on a shared-memory counter after a long pause looks for
the shard's drop notice in the store."""


def _watchable(pid: int, host: str) -> bool:
    """Whether this process can tell that process ``pid`` on ``host`` ended: it is on this
    host (by name) and visible here. Shared memory is used only with such a peer: a wait on
    it (the shard keeps the table's read lock until the worker has read its reply; a worker
    waits on the shard's progress counters) is cut short when the peer dies. Another host
    sharing this kernel's ``/dev/shm`` (a container or network namespace with its own
    hostname) could map the segment, but its death would be seen only at the request's
    timeout, while every other worker's commit waits for the lock."""
    return host == socket.gethostname() and pid > 0 and not _process_gone(pid, host)


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
    idle_timeout: float = 0.0  # the shard's (from Welcome): it drops a connection this quiet
    answered: float = 0.0  # when the last request that was answered started (monotonic)

    def probe(self) -> None:
        """Raise if the shard's process is known to have ended."""
        if _process_gone(self.pid, self.host):
            raise ShardLostError(self.shard, f"parameter server {self.shard}'s process ended")

    def may_be_dropped(self) -> bool:
        """Whether the shard may have dropped this connection for idleness by now: it began to
        wait for the next request after answering the last one, which started at ``answered``,
        so a drop needs at least ``idle_timeout`` since then."""
        return self.idle_timeout > 0 and time.monotonic() - self.answered >= self.idle_timeout


class _P2PPending(Pending):
    def __init__(
        self,
        transport: P2PTransport,
        channel: _Channel,
        works: list[Any],
        reply: tuple[torch.Tensor, Any],
        into: dict[str, torch.Tensor] | None,
        timeout: float,
        what: str,
        started: float,
    ) -> None:
        self._t = transport
        self._ch = channel
        self._works = works
        self._reply = reply  # the reply header's receive, posted before the request was sent
        self._into = into
        self._timeout = timeout
        self._what = what
        self._started = started
        self._done = False

    def wait(self) -> Reply:
        if self._done:
            raise RuntimeError("a pending request can be waited once")
        self._done = True
        ch = self._ch
        deadline = self._started + self._timeout
        try:
            # the reply first: a receive is told at once when the pair breaks, while a send
            # that gloo queued on a pair the shard closed is never told and would wait out
            # the deadline. Once the reply is here, the shard has read the whole request.
            reply = ch.pipe.recv(deadline, into=self._into, posted=self._reply)[0]
            _wait_all(self._works, deadline)
        except Exception as exc:
            ch.broken = True
            raise self._t._lost(ch, self._what, exc, time.monotonic() - self._started) from exc
        finally:
            ch.lock.release()
        ch.answered = self._started
        return reply

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
        self._next_notice_check = 0.0
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
        self._reply_header = pipe.post()  # before the request (see _P2PPending.wait)
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
                        self._reply_base + k + 1, self._deadline, self._probe
                    )
                else:
                    self._recvs[k].wait(_seconds(self._deadline))
                self._next_arrived += 1
        except Exception as exc:
            raise self._fail(exc) from exc

    def _probe(self) -> None:
        """Between sleeps on a reply counter: raise if the shard's process ended or (after a
        pause long enough for it) the shard left notice that it dropped this connection -- the
        counter lives in shared memory, which does not break with the pair."""
        ch = self._ch
        ch.probe()
        now = time.monotonic()
        if ch.may_be_dropped() and now >= self._next_notice_check:
            self._next_notice_check = now + _NOTICE_CHECK_S
            notice = self._t._end_notice(ch, wait=False)
            if notice is not None and notice.startswith(DROPPED):
                raise self._t._dropped(ch, notice)

    def wait(self) -> Reply:
        if self._closed:
            raise RuntimeError("a stream can be waited once")
        if not self._finished:
            raise RuntimeError("finish() a stream before waiting for its reply")
        self.arrived(self._n - 1)
        try:
            ch = self._ch
            reply = ch.pipe.recv(self._deadline, into=self.reply_flats, posted=self._reply_header)
            _wait_all(self._sends, self._deadline)
        except Exception as exc:
            raise self._fail(exc) from exc
        self._ch.answered = self._started
        self._release()
        return reply[0]

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
