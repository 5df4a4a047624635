"""The ``"p2p"`` transport: the job's TCPStore for control, one 2-rank gloo group per connection.

Owns: connecting a worker to a shard, serving a shard's connections, and moving typed messages
(:mod:`~distoptim.agn.transport.wire`) over ``send``/``recv``. Nothing here imports
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

A connection starts with :class:`~distoptim.agn.transport.messages.Hello` (the worker's task,
pid and host; the reply is :class:`~distoptim.agn.transport.messages.Welcome`), then carries one
request and its reply at a time. Every receive has a timeout: a worker waits ``timeout`` for a
reply; a shard waits ``idle_timeout`` for the next request (a worker silent for longer is
dropped; if it comes back it reconnects like a late worker). A timeout closes the connection
(gloo closes the pair), so the next request on it reconnects.

Replies are sent from the live center when possible (see :mod:`distoptim.agn.server`): the shard
sends the reply before it reads the next request and releases the table's read lock once the
bytes are out. A shard reuses each connection's receive buffers from one message to the next.

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

from distoptim.agn.transport import wire
from distoptim.agn.transport.base import (
    Handler,
    ParameterServerError,
    Pending,
    ShardLostError,
    Transport,
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
from distoptim.agn.transport.shm import Segment, layout_offsets
from distoptim.launch import import_dynamo_before_groups

__all__ = ["DEFAULT_IDLE_TIMEOUT", "P2PTransport"]

DEFAULT_IDLE_TIMEOUT = 1800.0
"""Seconds a shard waits for a connected worker's next request before dropping it."""

_STOP = b"stop"
_FOREVER = timedelta(days=3650)
_MAX_BACKOFF = 1.0


def _store(addr: str, port: int, namespace: str, timeout: float) -> dist.Store:
    """A fresh store client (blocking waits hold a client's socket: one client per waiter)."""
    base = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(namespace, base)


def _seconds(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


class _Pipe:
    """One end of a connection: a 2-rank gloo group, typed messages in both directions, and
    (same machine) the shared segment the flat buffers travel in."""

    def __init__(self, pg: dist.ProcessGroup, peer: int) -> None:
        self.pg = pg
        self.peer = peer
        self.segment: Segment | None = None

    def send(self, message: Any) -> list[Any]:
        """Start sending ``message``; the returned works must be waited."""
        flats = getattr(message, "flats", None) or {}
        offsets = None
        seg = self.segment
        if seg is not None and flats:
            sizes = [t.numel() * t.element_size() for t in flats.values()]
            placed, need = layout_offsets(sizes)
            if need <= seg.nbytes:
                for t, off in zip(flats.values(), placed):
                    if not seg.holds(t, off):
                        seg.view(off, t.dtype, t.numel()).copy_(t)
                offsets = placed
        header, extra, buffers = wire.encode(message, offsets)
        works = [self.pg.send([header], self.peer, 0)]
        if extra is not None:
            works.append(self.pg.send([extra], self.peer, 0))
        for i, buf in enumerate(buffers):
            works.append(self.pg.send([buf], self.peer, 1 + i))
        return works

    def recv(
        self,
        deadline: float,
        into: dict[str, torch.Tensor] | None = None,
        pool: dict[wire.BufferSpec, torch.Tensor] | None = None,
    ) -> Any:
        """Receive one message by ``deadline`` (``time.monotonic()``). Buffers in the shared
        segment are views of it (valid until the next message); the others are received into
        ``into`` where key, dtype and size match, else into ``pool``'s (reused), else new ones."""
        header = torch.empty(wire.HEADER_BYTES, dtype=torch.uint8)
        self.pg.recv([header], self.peer, 0).wait(_seconds(deadline))
        n, meta = wire.decode_header(header)
        if meta is None:
            extra = torch.empty(n, dtype=torch.uint8)
            self.pg.recv([extra], self.peer, 0).wait(_seconds(deadline))
            meta = bytes(extra.numpy())
        message, specs = wire.finish_decode(meta)
        if not specs:
            return message
        flats: dict[str, torch.Tensor] = {}
        works = []
        for i, spec in enumerate(specs):
            if spec.offset >= 0:
                if self.segment is None:
                    raise wire.WireError("a buffer in shared memory, but no segment is attached")
                flats[spec.key] = self.segment.view(spec.offset, spec.dtype, spec.numel)
                continue
            buf = self._buffer(spec, into, pool)
            works.append(self.pg.recv([buf], self.peer, 1 + i))
            flats[spec.key] = buf
        for w in works:
            w.wait(_seconds(deadline))
        message.flats = flats
        return message

    @staticmethod
    def _buffer(
        spec: wire.BufferSpec,
        into: dict[str, torch.Tensor] | None,
        pool: dict[wire.BufferSpec, torch.Tensor] | None,
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
    pid: int = 0  # the shard's process (from Welcome)
    host: str = ""
    broken: bool = False
    shm_refused: bool = False  # the shard could not map a segment (another machine)


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
            return ch.pipe.recv(deadline, into=self._into)
        except Exception as exc:
            ch.broken = True
            raise self._t._lost(ch, self._what, exc, time.monotonic() - self._started) from exc
        finally:
            ch.lock.release()


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
        incarnation is awaited.
        """
        assert self._task is not None
        backoff, attempt = 0.01, 1.0
        last_error: BaseException | None = None
        while True:
            inc = self.current_incarnation(shard)
            wait_s = min(self.timeout, deadline - time.monotonic())
            if lost is not None and inc == lost.incarnation:
                wait_s = 0.0 if _process_gone(lost.pid, lost.host) else min(wait_s, attempt)
                attempt *= 2
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
        pipe = _Pipe(pg, 0)
        try:
            hello = Hello(self._task, os.getpid(), socket.gethostname())
            end = time.monotonic() + max(wait_s, self.timeout)
            _wait_all(pipe.send(hello), end)
            reply = pipe.recv(end)
            if not isinstance(reply, Welcome):
                raise ParameterServerError(f"parameter server {shard} answered hello with {reply}")
        except BaseException:
            pipe.close()
            raise
        return _Channel(shard, reply.incarnation, pipe, threading.Lock(), reply.pid, reply.host)

    def send(
        self,
        shard: int,
        request: Request,
        timeout: float,
        into: dict[str, torch.Tensor] | None = None,
    ) -> Pending:
        ch = self._channels.get(shard)
        if ch is None:
            raise RuntimeError(f"not connected to parameter server {shard} (connect() first)")
        ch.lock.acquire()
        what = type(request).__name__
        try:
            if ch.broken:
                raise ShardLostError(shard, "the connection broke earlier")
            works = ch.pipe.send(request)
        except Exception as exc:
            ch.broken = True
            ch.lock.release()
            raise self._lost(ch, what, exc, 0.0) from exc
        return _P2PPending(self, ch, works, into, timeout, what)

    def reserve(self, shard: int, nbytes: int) -> bool:
        """Make the connection to ``shard`` carry messages of up to ``nbytes`` of flat buffers
        in shared memory (when the shard is on this machine); returns whether it does."""
        self._reserved[shard] = max(nbytes, self._reserved.get(shard, 0))
        ch = self._channels.get(shard)
        if ch is None or not self.shared_memory or ch.shm_refused:
            return False
        current = ch.pipe.segment
        if current is not None and current.nbytes >= nbytes:
            return True
        seg = Segment.create(nbytes)
        if seg is None:
            return False
        try:
            reply = self.send(shard, Attach(seg.path, seg.nbytes, seg.token), self.timeout).wait()
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
        offsets, need = layout_offsets(nbytes)
        if need > seg.nbytes:
            return None
        return [seg.data[o : o + n] for o, n in zip(offsets, nbytes)]

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
        return ShardLostError(ch.shard, text)

    def reconnect(self, shard: int, timeout: float) -> int:
        """Drop the broken connection to ``shard`` and connect to its next incarnation."""
        old = self._channels.pop(shard, None)
        if old is not None:
            with old.lock:
                old.pipe.close()
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
        pipe = _Pipe(pg, 1)
        pool: dict[wire.BufferSpec, torch.Tensor] = {}
        try:
            first = pipe.recv(time.monotonic() + self.timeout)
            if not isinstance(first, Hello) or first.task != task:
                return
            handled = handler.handle(first)
            _wait_all(pipe.send(handled.reply), time.monotonic() + self.timeout)
            while not self._stopping.is_set():
                try:
                    request = pipe.recv(time.monotonic() + self.idle_timeout, pool=pool)
                except Exception:
                    handler.connection_lost(task)
                    return
                if isinstance(request, Attach):  # the transport's own business
                    pipe.segment = Segment.attach(request.path, request.nbytes, request.token)
                    _wait_all(
                        pipe.send(Attached(pipe.segment is not None)),
                        time.monotonic() + self.timeout,
                    )
                    continue
                handled = handler.handle(request, live_reply=True)
                try:
                    _wait_all(pipe.send(handled.reply), time.monotonic() + self.timeout)
                except Exception:
                    handler.connection_lost(task)
                    return
                finally:
                    handled.sent()
                if isinstance(request, Finish) and not isinstance(handled.reply, ErrorReply):
                    return
                handler.idle()
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
