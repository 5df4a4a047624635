"""How workers and parameter-server shards talk: typed messages behind one interface.

* :mod:`~distoptim.agn.transport.messages` -- the requests and replies (dataclasses);
* :mod:`~distoptim.agn.transport.base` -- :class:`Transport`, :class:`Pending`,
  :class:`Handled`, :class:`ParameterServerError`;
* :mod:`~distoptim.agn.transport.p2p` -- ``"p2p"`` (default): TCPStore + a 2-rank gloo group
  per connection; :mod:`~distoptim.agn.transport.framing` -- its message framing;
* :mod:`~distoptim.agn.transport.rpc` -- ``"rpc"``: ``torch.distributed.rpc``.
"""

from distoptim.agn.transport.base import (
    Handled,
    ParameterServerError,
    Pending,
    ShardLostError,
    Transport,
    WorkerDroppedError,
)

TRANSPORTS = ("p2p", "rpc")
"""The transport names a cluster accepts."""

__all__ = [
    "TRANSPORTS",
    "Handled",
    "ParameterServerError",
    "Pending",
    "ShardLostError",
    "Transport",
    "WorkerDroppedError",
]
