"""The one interface every parameter-server transport implements, and its errors.

Owns: :class:`Transport` (worker side: send a request to a shard and wait for the reply;
shard side: serve requests; both: tell which workers are gone), :class:`Pending` (a request in
flight), :class:`Handled` (a shard's answer plus what to do once it is sent) and
:class:`ParameterServerError`. The two implementations:

* :class:`~distoptim.agn.transport.p2p.P2PTransport` (``"p2p"``, the default): the job's
  ``TCPStore`` for rendezvous and control, one 2-rank process group per (worker, shard)
  connection, ``send``/``recv`` of a fixed-size header and the flat buffers.
* :class:`~distoptim.agn.transport.rpc.RpcTransport` (``"rpc"``): ``torch.distributed.rpc``
  (TensorPipe), a static world.

The requests and replies are the typed messages of :mod:`distoptim.agn.transport.messages`;
the shard's :meth:`~distoptim.agn.server.ParameterServer.handle` is the same on both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from distoptim.agn.transport.messages import Reply, Request
from distoptim.launch import PeerFailureError

__all__ = [
    "Handled",
    "Handler",
    "ParameterServerError",
    "Pending",
    "ShardLostError",
    "Transport",
]


class ParameterServerError(PeerFailureError):
    """A parameter-server shard did not answer (it died, hung, or shut down)."""


class ShardLostError(ParameterServerError):
    """The connection to a shard broke (its process ended or restarted); ``shard`` says which."""

    def __init__(self, shard: int, message: str) -> None:
        self.shard = shard
        super().__init__(message)


@dataclass
class Handled:
    """A shard's answer to one request.

    ``reply`` may reference the live center (no copy) when the transport sends replies before it
    handles the next request on any connection that could change it; ``after_send`` (if any)
    must then be called once the reply's bytes are out (it releases the table's read lock).
    """

    reply: Reply
    after_send: Callable[[], None] | None = None

    def sent(self) -> None:
        if self.after_send is not None:
            done, self.after_send = self.after_send, None
            done()


class Handler(Protocol):
    """What a transport needs from the shard it serves (``ParameterServer`` is one)."""

    shard: int
    incarnation: int

    def handle(self, request: Request, live_reply: bool = False) -> Handled: ...

    def connection_lost(self, task: int) -> None: ...

    def idle(self) -> None: ...


class Pending(ABC):
    """A request in flight to one shard."""

    @abstractmethod
    def wait(self) -> Reply:
        """The reply; raises :class:`ParameterServerError` if the shard does not answer in time
        (:class:`ShardLostError` when the connection broke)."""


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
