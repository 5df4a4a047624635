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
* ``shard/<s>/<inc>/ended/<k>`` -- the shard's notice, written as it ends connection ``k``:
  ``dropped <idle_timeout>`` when its worker sent no request for that long, else ``closed``. A
  worker whose connection broke reads it to tell a drop from a shard that died
  (:class:`~distoptim.agn.transport.base.WorkerDroppedError`). The pair breaks a moment before
  the notice is written, so a worker that was quiet for the shard's ``idle_timeout`` (told in
  ``Welcome``) waits for it: until it is there, the shard's process is known to have ended (same
  machine), or :data:`NOTICE_S` passed (a shard on another machine).

A connection starts with :class:`~distoptim.agn.transport.messages.Hello` (the worker's task,
pid and host; the reply is :class:`~distoptim.agn.transport.messages.Welcome`), then carries one
request and its reply at a time; the worker posts the receive of the reply before it sends the
request (gloo tells a posted receive when the pair breaks, but not a send it queued on a pair the
shard already closed: that one would wait out its timeout). Every receive has a timeout: a
worker waits ``timeout`` for a reply; a shard waits ``idle_timeout`` for the next request (a
worker silent for longer is dropped; if it comes back it reconnects like a late worker). A
timeout closes the connection (gloo closes the pair), so the next request on it reconnects.

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
another machine cannot map it and the buffers stay on the pair. Nor is a segment used between
two ends that cannot watch each other's process (another host name: a container or network
namespace sharing this kernel's ``/dev/shm``): the shard holds the table's read lock until the
worker has read its reply there, and the death of a worker it cannot watch would be seen only
at the request's timeout, with every other worker's commit waiting for the lock.
``shared_memory=False`` (or ``DISTOPTIM_AGN_SHM=0``) keeps everything on the pair.

Tensors must be on the CPU (gloo); process groups are made directly
(``torch.distributed.ProcessGroupGloo``), so they need no default group and are invisible to
``torch.distributed``'s global state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from distoptim.agn.flat import Chunk
from distoptim.agn.transport import framing
from distoptim.agn.transport.base import (
    Handler,
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
    Request,
    Welcome,
)
from distoptim.agn.transport.p2p_worker import (
    CLOSED,
    DROPPED,
    _Channel,
    _P2PPending,
    _P2PStream,
    _process_gone,
    _watchable,
)
from distoptim.agn.transport.pair import _Idle, _Pipe, _PipeInflow, _store, _wait_all
from distoptim.agn.transport.shared_center import MappedCenters, SharedCenters
from distoptim.agn.transport.shm import Segment
from distoptim.launch import import_dynamo_before_groups

__all__ = ["DEFAULT_IDLE_TIMEOUT", "NOTICE_S", "P2PTransport"]

DEFAULT_IDLE_TIMEOUT = 1800.0
"""Seconds a shard waits for a connected worker's next request before dropping it."""

NOTICE_S = 10.0
"""Seconds a worker whose connection broke after a pause of the shard's ``idle_timeout`` waits
for the notice of a shard on another machine (one that died leaves none)."""

_STOP = b"stop"
_FOREVER = timedelta(days=3650)
_MAX_BACKOFF = 1.0
_FIRST_WINDOW_S = 5.0
"""A first connection waits this long for the incarnation it asked (doubling on each retry)
before it reads the incarnation again: a shard that dies before serving it and is restarted
serves the new incarnation's queue, never the old one's."""


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
        started = time.monotonic()
        try:
            hello = Hello(self._task, os.getpid(), socket.gethostname())
            end = started + max(wait_s, self.timeout)
            welcome = pipe.post()  # before the request (see _P2PPending.wait)
            works = pipe.send(hello)[0]
            reply = pipe.recv(end, posted=welcome)[0]
            _wait_all(works, end)
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
            idle_timeout=reply.idle_timeout,
            answered=started,
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
        started = time.monotonic()
        try:
            reply = ch.pipe.post()  # before the request (see _P2PPending.wait)
            works = ch.pipe.send(request)[0]
        except Exception as exc:
            raise self._broke(ch, what, exc) from exc
        return _P2PPending(self, ch, works, reply, into, timeout, what, started)

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
        if not _watchable(ch.pid, ch.host):  # its death would hold this worker's waits
            ch.shm_refused = True
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
        notice = self._end_notice(ch, wait=ch.may_be_dropped())
        if notice is not None and notice.startswith(DROPPED):
            return self._dropped(ch, notice)
        if "Timed out" in str(exc):
            return ParameterServerError(text)
        return ShardLostError(ch.shard, text)

    def _dropped(self, ch: _Channel, notice: str) -> WorkerDroppedError:
        """The error of a worker whose connection ``ch`` the shard dropped (``notice``)."""
        idle = notice[len(DROPPED) :].strip()
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

    def _end_notice(self, ch: _Channel, wait: bool) -> str | None:
        """The notice the shard left as it ended connection ``ch`` (None: none). With ``wait``
        (the connection broke after a pause that may have got it dropped), wait for it until it
        is there, the shard's process is known to have ended, or the bound (``timeout`` for a
        shard on this machine, whose process is watched; :data:`NOTICE_S` for another)."""
        key = f"shard/{ch.shard}/{ch.incarnation}/ended/{ch.number}"
        local = ch.host == socket.gethostname() and ch.pid > 0
        end = time.monotonic() + ((self.timeout if local else NOTICE_S) if wait else 0.0)
        pause = 0.001
        while True:
            try:
                if self._store.check([key]):
                    return self._store.get(key).decode()
            except Exception:  # the store is gone too: the job is ending, say what was seen
                return None
            if time.monotonic() >= end or _process_gone(ch.pid, ch.host):
                return None
            time.sleep(pause)  # the shard writes it right after the pair closed
            pause = min(0.05, pause * 2)

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
        notice: list[str] = []  # left in the store once, before the pair closes when it can be
        try:
            first = pipe.recv(time.monotonic() + self.timeout)[0]
            if not isinstance(first, Hello) or first.task != task:
                return
            handled = handler.handle(first)
            welcome = handled.reply
            if isinstance(welcome, Welcome):  # the worker learns how long it may be quiet
                welcome = dataclasses.replace(welcome, idle_timeout=self.idle_timeout)
            _wait_all(pipe.send(welcome)[0], time.monotonic() + self.timeout)

            def probe() -> None:
                if _process_gone(first.pid, first.host):
                    raise ShardLostError(handler.shard, f"worker {task}'s process ended")

            posted = None  # the next request's header, received while the shard works ahead
            while not self._stopping.is_set():
                try:
                    request, specs, info = pipe.recv(
                        time.monotonic() + self.idle_timeout,
                        pool=pool,
                        idle=True,
                        posted=posted,
                    )
                    posted = None
                except _Idle:  # the worker is told why, should it come back (WorkerDroppedError)
                    self._leave_notice(store, k, f"{DROPPED} {self.idle_timeout:g}", notice)
                    handler.connection_lost(task)
                    return
                except Exception:
                    handler.connection_lost(task)
                    return
                if isinstance(request, Attach):  # the transport's own business
                    attached = _attach(pipe, request, first, handler.centers)
                    _wait_all(pipe.send(attached)[0], time.monotonic() + self.timeout)
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
            self._leave_notice(store, k, CLOSED, notice)
            pipe.close()

    def _leave_notice(self, store: dist.Store, k: int, text: str, left: list[str]) -> None:
        """Tell connection ``k``'s worker why the shard ended it (once: ``left`` remembers)."""
        if not left:
            left.append(text)
            with contextlib.suppress(Exception):  # the store is gone: the job is ending
                store.set(f"{self._prefix()}/ended/{k}", text)

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


def _attach(pipe: _Pipe, request: Attach, hello: Hello, centers: SharedCenters | None) -> Attached:
    """The shard maps the segment a worker offers if it can watch that worker's process (see
    ``_watchable``; else the buffers stay on the pair), and with it the centers the worker may
    read replies from in place."""
    if _watchable(hello.pid, hello.host):
        pipe.segment = Segment.attach(request.path, request.nbytes, request.token)
    if pipe.segment is not None and request.maps_centers:
        pipe.centers = centers  # replies to commits read in place
    return Attached(pipe.segment is not None)
