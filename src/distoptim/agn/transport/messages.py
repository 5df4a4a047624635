"""The typed messages between a worker and a parameter-server shard, on every transport.

Owns: one dataclass per request and per reply, with explicit fields. A shard handles each
request type in its own method (:meth:`distoptim.agn.server.ParameterServer.handle` matches on
the type), so an IDE follows a commit from :class:`Commit` to ``ParameterServer.commit`` and
back as a :class:`CommitReply`. Tensors travel only in a message's ``flats`` field: one flat
buffer per dtype (:class:`~distoptim.agn.flat.FlatLayout`); every other field is small and is
pickled by the transport.

=====================  =============================================  ========================
request                what it asks                                   reply
=====================  =============================================  ========================
:class:`Hello`         p2p only: who is on this connection            :class:`Welcome`
:class:`Attach`        p2p only: map this shared-memory segment       :class:`Attached`
                       (same machine) for the flat buffers
:class:`Seed`          the chief creates a table (center, rule,       :class:`PullReply`
                       server optimizer) unless it exists (resumed)
:class:`Pull`          the current center of a table                  :class:`PullReply`
:class:`Commit`        apply a worker's update, reply with the        :class:`CommitReply`
                       center
:class:`Ping`          is this shard alive                            :class:`Pong`
:class:`Echo`          send these bytes back as they came (a probe    :class:`EchoReply`
                       of the transport itself)
:class:`Finish`        this worker is done (``failed``: it raised)    :class:`Ack`
=====================  =============================================  ========================

Any request may instead get an :class:`ErrorReply` (a ``ValueError``/``TypeError``/
``RuntimeError``/``TimeoutError`` raised by the shard), which the worker re-raises by type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.agn.flat import FlatLayout
from distoptim.agn.rules import ServerRule
from distoptim.agn.transport.shared_center import RegionRef

__all__ = [
    "Ack",
    "Attach",
    "Attached",
    "Commit",
    "CommitReply",
    "Echo",
    "EchoReply",
    "ErrorReply",
    "Finish",
    "Hello",
    "Ping",
    "Pong",
    "Pull",
    "PullReply",
    "Reply",
    "Request",
    "Seed",
    "TableSpec",
    "Welcome",
]

Flats = dict[str, torch.Tensor]


@dataclass
class TableSpec:
    """What the chief tells a shard when it seeds a table.

    ``param_indices``/``shapes``/``dtypes``: the shard's variables, in parameter order.
    ``groups``: for the server optimizer, ``(worker_param_group_index, hyperparameters,
    positions of the shard's variables in that group)``. ``optimizer_cls``/``defaults``: the
    wrapped optimizer's class and defaults (``None`` when the rule uses no optimizer), or a
    picklable factory ``f(param_groups) -> Optimizer`` with empty defaults (AsyncDiLoCo's outer
    optimizer, built on the shard).
    """

    algorithm: str
    rule: ServerRule
    param_indices: list[int]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    use_locking: bool = True
    optimizer_cls: Callable[..., torch.optim.Optimizer] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    groups: list[tuple[int, dict[str, Any], list[int]]] = field(default_factory=list)

    def layout(self) -> FlatLayout:
        return FlatLayout(list(zip(self.shapes, self.dtypes)))


class Request:
    """Base of every worker -> shard message."""


class Reply:
    """Base of every shard -> worker message."""


# ---- requests ----------------------------------------------------------------------------------
@dataclass
class Hello(Request):
    """First message of a p2p connection: worker ``task`` (process ``pid`` on ``host``)."""

    task: int
    pid: int
    host: str


@dataclass
class Attach(Request):
    """Map the shared-memory segment at ``path`` (``nbytes``; it starts with ``token``) and
    carry this connection's flat buffers in it (:mod:`~distoptim.agn.transport.shm`)."""

    path: str
    nbytes: int
    token: bytes
    maps_centers: bool = False
    """The worker can map the shard's center regions (it mapped ``Welcome.centers``): replies
    to commits may then be read in place (:mod:`~distoptim.agn.transport.shared_center`)."""


@dataclass
class Seed(Request):
    """Create table ``table`` from the chief's values; a resumed table is kept as it is."""

    table: str
    spec: TableSpec
    flats: Flats


@dataclass
class Pull(Request):
    """The center of ``table``, waiting up to ``wait_s`` for the chief's seed.

    ``algorithm``/``signature`` let the shard tell a worker that built a different model.
    """

    table: str
    task: int
    algorithm: str
    signature: tuple[tuple[str, tuple[int, ...]], ...]
    wait_s: float


@dataclass
class Commit(Request):
    """Worker ``task``'s update of ``table`` (see the server rule).

    ``pulled_version``: the version of the center the worker last received (for staleness).
    ``hparams``: the worker's numeric hyperparameters per param group when they changed (LR
    schedules), for the server optimizer. ``refused_by_worker``: the worker found NaN/Inf in its
    payload (``flats`` is then empty); the shard only counts the refusal.
    """

    table: str
    task: int
    pulled_version: int
    flats: Flats
    hparams: dict[int, dict[str, Any]] | None = None
    refused_by_worker: bool = False


@dataclass
class Ping(Request):
    """Is the shard alive (its process id comes back)."""


@dataclass
class Echo(Request):
    """Send ``flats`` back unchanged: the transport's own round trip, for diagnostics."""

    flats: Flats


@dataclass
class Finish(Request):
    """Worker ``task`` is done; ``failed``: it stopped because it raised."""

    task: int
    failed: bool


# ---- replies -----------------------------------------------------------------------------------
@dataclass
class Welcome(Reply):
    """The shard accepted the connection: shard ``shard``, ``incarnation`` (1 + restarts),
    its process ``pid`` on ``host``, the ``chunk_bytes`` of its tables' chunk plans when commits
    on this connection are streamed in that plan (0: they travel whole, :mod:`distoptim.agn.flat`)
    and, when its centers may be read in place, a small region to try mapping (``centers``,
    :mod:`~distoptim.agn.transport.shared_center`). ``idle_timeout``: seconds the shard waits
    for this connection's next request before dropping it (0: unknown), so that a worker whose
    connection breaks after a pause that long knows to look for the shard's drop notice."""

    shard: int
    incarnation: int
    pid: int
    host: str = ""
    chunk_bytes: int = 0
    centers: RegionRef | None = None
    idle_timeout: float = 0.0


@dataclass
class Attached(Reply):
    """Whether the shard mapped the segment (False: not the same machine or memory)."""

    ok: bool


@dataclass
class PullReply(Reply):
    """The center of a table at ``version``; ``resumed``: loaded from a checkpoint."""

    version: int
    flats: Flats
    resumed: bool = False


@dataclass
class CommitReply(Reply):
    """The outcome of a :class:`Commit`.

    ``refused``: the center is unchanged (``reason`` says why); ``version``: the center's
    version after it; ``staleness``: commits by others since the worker's last pull; ``flats``:
    the center after the commit (before it, for rules with ``reply_before_update``) -- or, when
    ``streamed``, nothing: the reply chunks the worker received while the commit was applied
    are that center (a refused commit's reply is never streamed: it carries the center whole).
    """

    refused: bool
    version: int
    staleness: int
    flats: Flats
    reason: str = ""
    streamed: bool = False


@dataclass
class Pong(Reply):
    pid: int


@dataclass
class EchoReply(Reply):
    flats: Flats


@dataclass
class Ack(Reply):
    """The request was done."""


@dataclass
class ErrorReply(Reply):
    """A shard-side error, sent back as a value so the worker re-raises the right type."""

    kind: str
    message: str

    def to_exception(self) -> Exception:
        cls = {
            "ValueError": ValueError,
            "TypeError": TypeError,
            "TimeoutError": TimeoutError,
        }.get(self.kind, RuntimeError)
        return cls(self.message)
