"""The one interface every parameter-server transport implements, and its errors.

Owns: :class:`Transport` (worker side: send a request to a shard and wait for the reply;
shard side: serve requests; both: tell which workers are gone), :class:`Pending` (a request in
flight), :class:`Handled` (a shard's answer plus what to do once it is sent),
:class:`ParameterServerError`, and the two ends of a *streamed* commit: :class:`Stream` (the
worker's) and :class:`Inflow` (the shard's, with :class:`Arrived` for a request that came
whole). The two implementations:

* :class:`~distoptim.agn.transport.p2p.P2PTransport` (``"p2p"``, the default): the job's
  ``TCPStore`` for rendezvous and control, one 2-rank process group per (worker, shard)
  connection, ``send``/``recv`` of a fixed-size header and the flat buffers.
* :class:`~distoptim.agn.transport.rpc.RpcTransport` (``"rpc"``): ``torch.distributed.rpc``
  (TensorPipe), a static world.

The requests and replies are the typed messages of :mod:`distoptim.agn.transport.messages`;
the shard's :meth:`~distoptim.agn.server.ParameterServer.handle` is the same on both.

Streamed commits
----------------
A transport that can (p2p) moves a commit's flat buffers **chunk by chunk**
(:class:`~distoptim.agn.flat.Chunk`, the plan both ends build from the layout and the shard's
``chunk_bytes``), in both directions at once::

    worker                                   shard
    stream(commit header) ------------------> handle(commit, inflow)
    write payload chunk k; ready(k) -------->   inflow.wait(k); update chunk k; check it;
                                                 write reply chunk k; inflow.publish(k)
    arrived(k) <-----------------------------
    absorb reply chunk k (into θ)
    ...            (after the last chunk) --> inflow.verdict(): "ok", or "refuse" (the worker
                                               found NaN/Inf in its payload for another shard)
                                               or "abort" (it stopped mid-way)
    wait() <--------------------------------- the final reply: accepted (the chunks were the
                                               center), or refused (the center follows whole)

So the shard updates chunk ``k`` while chunk ``k + 1`` is still arriving and the worker takes
reply chunk ``k`` while the shard works on the next. The shard publishes every reply chunk and
waits for every payload chunk whatever happens (a refusal, an error), so the connection stays in
step; the worker treats reply chunks as provisional until the final reply says the commit was
accepted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from distoptim.agn.flat import Chunk
from distoptim.agn.transport.messages import Reply, Request
from distoptim.agn.transport.shared_center import SharedCenters
from distoptim.launch import PeerFailureError

__all__ = [
    "VERDICTS",
    "Arrived",
    "Handled",
    "Handler",
    "Inflow",
    "ParameterServerError",
    "Pending",
    "ShardLostError",
    "Stream",
    "Transport",
    "WorkerDroppedError",
]

VERDICTS = ("ok", "refuse", "abort")
"""What a worker says about a streamed commit once it sent every chunk: apply it; refuse it (its
payload holds NaN/Inf somewhere, possibly for another shard); it stopped mid-way."""


class ParameterServerError(PeerFailureError):
    """A parameter-server shard did not answer (it died, hung, or shut down)."""


class ShardLostError(ParameterServerError):
    """The connection to a shard broke (its process ended or restarted); ``shard`` says which."""

    def __init__(self, shard: int, message: str) -> None:
        self.shard = shard
        super().__init__(message)


class WorkerDroppedError(ShardLostError):
    """The shard is alive but dropped this worker's connection: the worker sent no request for
    the shard's ``idle_timeout`` (a long pause between steps). The message says how to raise it."""


@dataclass
class Handled:
    """A shard's answer to one request.

    ``reply`` may reference the live center (no copy) when the transport sends replies before it
    handles the next request on any connection that could change it; ``after_send`` (if any)
    must then be called once the reply's bytes are out (it releases the table's read lock).
    ``in_place``: the reply's buffers may be read by the worker where they are, in the shard's
    memory (p2p, same machine: :mod:`~distoptim.agn.transport.shared_center`); the transport
    then calls ``after_send`` once the worker said it is done reading them.
    """

    reply: Reply
    after_send: Callable[[], None] | None = None
    in_place: bool = False

    def sent(self) -> None:
        if self.after_send is not None:
            done, self.after_send = self.after_send, None
            done()


class Inflow(ABC):
    """The shard's end of a streamed request: its payload arriving, its reply leaving, chunk by
    chunk (see the module docstring). The request's ``flats`` are where the payload arrives."""

    streamed: ClassVar[bool] = True
    live: bool = False
    """:meth:`publish` may be given live memory (the center): it is read until the reply is
    sent, so the caller keeps it unchanged until then (:class:`Handled` ``after_send``)."""

    @abstractmethod
    def wait(self, chunk: int) -> None:
        """Return once payload chunk ``chunk`` has arrived (bounded; raises when the worker is
        gone)."""

    @abstractmethod
    def reply_buffers(self) -> dict[str, torch.Tensor] | None:
        """Where the reply's chunks must be written before :meth:`publish` (None: publish may be
        given any memory, see ``live``)."""

    @abstractmethod
    def publish(self, chunk: int, data: torch.Tensor) -> None:
        """Reply chunk ``chunk`` is final in ``data`` (a 1-D view of the chunk); call in order."""

    def publish_chunk(
        self,
        chunk: Chunk,
        source: Mapping[str, torch.Tensor],
        target: Mapping[str, torch.Tensor] | None,
    ) -> None:
        """:meth:`publish` reply chunk ``chunk`` of ``source`` -- copied into ``target`` first
        (while in cache) when given (:meth:`reply_buffers`), else ``source``'s own memory."""
        data = chunk.of(source)
        if target is not None:
            out = chunk.of(target)
            out.copy_(data)
            data = out
        self.publish(chunk.index, data)

    @abstractmethod
    def verdict(self) -> str:
        """The worker's word once every chunk arrived (one of :data:`VERDICTS`)."""


class Arrived(Inflow):
    """A request that came whole (not streamed): nothing to wait for; the reply is written into
    the request's own buffers (``reply``), which travel back with the reply message."""

    streamed = False

    def __init__(self, reply: dict[str, torch.Tensor] | None) -> None:
        self._reply = reply

    def wait(self, chunk: int) -> None:
        return None

    def reply_buffers(self) -> dict[str, torch.Tensor] | None:
        return self._reply

    def publish(self, chunk: int, data: torch.Tensor) -> None:
        return None

    def verdict(self) -> str:
        return "ok"


class Handler(Protocol):
    """What a transport needs from the shard it serves (``ParameterServer`` is one)."""

    shard: int
    incarnation: int
    chunk_bytes: int
    centers: SharedCenters | None
    """Where the shard's tables keep their centers, when same-machine workers may read them."""

    def handle(
        self, request: Request, live_reply: bool = False, inflow: Inflow | None = None
    ) -> Handled: ...

    def connection_lost(self, task: int) -> None: ...

    def idle(self, interrupted: Callable[[], bool] = ...) -> None: ...


class Pending(ABC):
    """A request in flight to one shard."""

    @abstractmethod
    def wait(self) -> Reply:
        """The reply; raises :class:`ParameterServerError` if the shard does not answer in time
        (:class:`ShardLostError` when the connection broke)."""

    def release(self) -> None:
        """The caller is done with the reply's buffers (they may be the shard's own memory,
        read in place, which the shard keeps unchanged until then). Idempotent; the next
        request to the shard releases them too. Nothing to do by default."""
        return None


class Stream(Pending):
    """The worker's end of a streamed commit (see the module docstring).

    ``reply_flats``: the buffers the reply's chunks arrive in (valid until the next request to
    that shard). The payload buffers (the request's ``flats``) belong to the stream until
    :meth:`wait` returns.
    """

    reply_flats: dict[str, torch.Tensor]

    @abstractmethod
    def ready(self, chunk: int) -> None:
        """Payload chunk ``chunk`` is written (call in order)."""

    @abstractmethod
    def arrived(self, chunk: int) -> None:
        """Return once reply chunk ``chunk`` is in ``reply_flats`` (bounded)."""

    @abstractmethod
    def finish(self, verdict: str) -> None:
        """Every payload chunk was made ready; tell the shard ``verdict`` (:data:`VERDICTS`)."""

    @abstractmethod
    def abandon(self) -> None:
        """Stop early (the worker raised): the shard is told to drop the commit, the stream is
        wound down so the connection stays usable (or is closed); never raises."""


class Transport(ABC):
    """How a worker's requests reach the shards and how a shard serves them."""

    name: ClassVar[str]
    supports_restart: ClassVar[bool] = False
    """Shards may restart and workers reconnect (elastic clusters)."""

    # ---- worker side ----------------------------------------------------------------------
    @abstractmethod
    def send(
        self,
        shard: int,
        request: Request,
        timeout: float,
        into: dict[str, torch.Tensor] | None = None,
    ) -> Pending:
        """Start ``request`` to ``shard``. ``into``: buffers the reply's ``flats`` may be
        received into (a hint; the reply says where they are). A reply's ``flats`` are valid
        until the next request to that shard (they may live in a shared segment): copy what you
        keep. Requests to different shards proceed in parallel; to one shard, one at a time."""

    def reserve(self, shard: int, nbytes: int) -> bool:
        """Prepare the way to ``shard`` for messages carrying up to ``nbytes`` of flat buffers
        (p2p: a shared-memory segment when the shard is on this machine); returns whether a
        faster path is in place. Requests work without it."""
        return False

    def chunk_bytes(self, shard: int) -> int:
        """The chunk size ``shard`` streams commits with (0: commits to it are not streamed)."""
        return 0

    def stream(
        self,
        shard: int,
        request: Request,
        chunks: Sequence[Chunk],
        timeout: float,
        into: dict[str, torch.Tensor] | None = None,
    ) -> Stream | None:
        """Start ``request`` (a commit whose ``flats`` will be written chunk by chunk, in the
        plan ``chunks``) as a stream to ``shard``, or None when this transport cannot stream to
        it (then use :meth:`send` once the payload is written). ``into`` as for :meth:`send`."""
        return None

    def outbox(self, shard: int, nbytes: list[int]) -> list[torch.Tensor] | None:
        """Byte buffers (``uint8``) where the flat buffers of the next request to ``shard``
        (of ``nbytes`` bytes each, in order) can be written so that sending them copies nothing;
        None when there are none. They overlap the last reply from that shard."""
        return None

    def incarnation(self, shard: int) -> int:
        """The incarnation of ``shard`` this worker is connected to (1 + its restarts)."""
        return 1

    def reconnect(self, shard: int, timeout: float) -> int:
        """Wait (bounded) for ``shard`` to come back after a restart and connect to it; returns
        its new incarnation. Transports without restarts raise ``ParameterServerError``."""
        raise ParameterServerError(
            f"the {self.name} transport cannot reconnect to a restarted shard (use p2p)"
        )

    # ---- shard side -----------------------------------------------------------------------
    @abstractmethod
    def serve(self, handler: Handler) -> None:
        """Start serving requests to ``handler`` (returns at once; serving runs in threads)."""

    @abstractmethod
    def gone(self, tasks: Sequence[int]) -> list[int]:
        """Those of ``tasks`` whose worker is known to be gone (died or left without a word)."""

    # ---- both -----------------------------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Stop serving / disconnect, quietly (idempotent)."""
