"""A torchft Manager for one replica group, built the way distoptim's tests and CLI build it.

Owns :func:`make_manager`: the few lines every local or multi-node fault-tolerant job repeats
(a store for a one-process replica group, torchft's reconfigurable gloo group with a bounded
timeout, a checkpoint transport that advertises a reachable address, torchft's logging kept
quiet) with distoptim's defaults, and a clear error when the lighthouse is not there. Users may
equally build ``torchft.Manager`` themselves, as torchft documents; everything distoptim does
with a manager goes through its public contract (see :mod:`distoptim.ft`).

Also owns :class:`LighthouseWatch`, what a manager built here carries so that a replica waiting
for a quorum learns why it waits in vain, within the manager's ``connect_timeout``: the
lighthouse stopped answering (:class:`LighthouseGoneError`), or it answers but no other replica
group is left after a job ran (:class:`NoPeersError`). A lighthouse restarted on the same
address before that is rejoined: torchft's manager retries its quorum request
(``quorum_retries``). A quorum that does not come within the manager's ``quorum_timeout`` for
another reason (the other groups stopped or never came back) is :class:`QuorumTimeoutError`,
saying what the lighthouse sees, instead of torchft's bare ``TimeoutError``.

In a replica group of several processes, group rank 0's process hosts the group's torchft
manager server, which the other ranks ask for every quorum and commit: when it dies or stops
(a group that lost a process is dead), they raise :class:`GroupManagerUnreachableError` naming
their group rank -- at once when torchft's client loses the connection, and within
``connect_timeout`` when rank 0 is frozen (its manager no longer heartbeats the lighthouse),
instead of torchft's bare ``http2 error`` once its HTTP/2 keep-alive gives up (80 s).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distoptim import checks
from distoptim.ft._torchft import advertised_http_transport, group_store_keys, quiet, require
from distoptim.ft.lighthouse import LighthouseStatus, lighthouse_status

__all__ = [
    "GroupManagerUnreachableError",
    "GroupPlace",
    "LighthouseGoneError",
    "LighthouseUnreachableError",
    "LighthouseWatch",
    "NoPeersError",
    "QUORUM_BACKENDS",
    "QuorumTimeoutError",
    "make_manager",
]


QUORUM_BACKENDS = {"gloo": "ProcessGroupGloo", "nccl": "ProcessGroupNCCL"}
"""``make_manager``'s ``backend``: the torchft process group each one names."""


class LighthouseUnreachableError(ConnectionError):
    """No torchft lighthouse answered at the given address within the connect timeout."""


class GroupManagerUnreachableError(ConnectionError):
    """A process of a replica group of several could not reach its group's rank 0 manager (at
    construction), or lost it (rank 0 died or stopped)."""


class LighthouseGoneError(LighthouseUnreachableError):
    """The lighthouse stopped answering while this replica waited for a quorum."""


class NoPeersError(RuntimeError):
    """The lighthouse answers, but no other replica group is left to form a quorum with."""


class QuorumTimeoutError(TimeoutError):
    """No quorum formed within the manager's ``quorum_timeout`` (torchft's own error is a bare
    ``TimeoutError: status: Cancelled``)."""


def quorum_timed_out(
    who: str, quorum_timeout: float, waited: float, seen: str | None = None
) -> QuorumTimeoutError:
    """The :class:`QuorumTimeoutError` for ``who`` (``seen``: what the lighthouse says)."""
    return QuorumTimeoutError(
        f"{who}: no quorum formed within the manager's quorum_timeout={quorum_timeout:g}s "
        f"(waited {waited:.0f} s){': ' + seen if seen else ''}. Too few replica groups ask the "
        "lighthouse for a quorum (its --min-replicas): the others stopped, died and were not "
        "restarted, or cannot reach it. Its state is that of its last committed step. Restart "
        "the missing groups within quorum_timeout, or build the Manager with a longer one."
    )


@dataclass(frozen=True)
class GroupPlace:
    """A process of a replica group of several, above group rank 0: ``replica`` is the group's
    full replica id (torchft's ``name:uuid``, as rank 0's manager registered it) and
    ``manager`` rank 0's manager address, both read from the group's store."""

    rank: int
    size: int
    replica: str
    manager: str


# torchft's client errors when the connection to a manager server is lost or refused
_LOST = re.compile(r"status: Unavailable|\"(transport error|http2 error)\"")


class LighthouseWatch:
    """Why a quorum does not come (see the module): :meth:`check` is called while waiting.

    ``patience`` (the manager's ``connect_timeout``) is how long the lighthouse must stay
    unreachable, or a joining replica group stay the only one heartbeating after a quorum was
    issued, before :meth:`check` raises. At a job's start (no quorum issued yet) the others may
    still be starting: waiting for them is not an error here.
    """

    def __init__(
        self, address: str, replica_id: str, patience: float, group: GroupPlace | None = None
    ) -> None:
        self.address, self.replica_id, self.patience = address, replica_id, patience
        self.group = group  # None: this process is its group's rank 0 (it hosts the manager)
        self._gone_since: float | None = None
        self._alone_since: float | None = None
        self._unheard_since: float | None = None

    def reset(self) -> None:
        """A quorum came: forget what was seen while waiting."""
        self._gone_since = self._alone_since = self._unheard_since = None

    def group_manager_lost(self, exc: BaseException, waited: float, what: str) -> Exception | None:
        """The :class:`GroupManagerUnreachableError` for torchft's client error ``exc`` when it
        says the connection to this group's rank 0 manager was lost and rank 0 is seen gone
        within ``patience`` seconds (:meth:`_rank0_gone`). Else None: ``exc`` stands (an error
        rank 0's live manager relayed; also in rank 0's own process)."""
        if self.group is None or not _LOST.search(str(exc)) or not self._rank0_gone():
            return None
        return self._lost(f"stopped answering ({str(exc).strip()})", waited, what)

    def _rank0_gone(self) -> bool:
        """Whether, within ``patience`` seconds, rank 0's manager address refuses connections
        (its process exited) or the lighthouse marks its heartbeats late (it died or froze:
        after the lighthouse's heartbeat timeout). A dying process may still hold its port for
        a moment, hence the bounded poll; the error is raised either way."""
        assert self.group is not None
        where = urllib.parse.urlsplit(self.group.manager)
        deadline = time.monotonic() + self.patience
        while True:
            try:
                with socket.create_connection((where.hostname, where.port), timeout=1.0):
                    pass
            except (OSError, ValueError):
                return True
            status = lighthouse_status(self.address, timeout=min(1.0, self.patience))
            if status is not None and status.hears_from(self.group.replica) is False:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)  # polls rank 0's address and the lighthouse's page

    def _lost(self, cause: str, waited: float, what: str) -> GroupManagerUnreachableError:
        group = self.group
        assert group is not None
        return GroupManagerUnreachableError(
            f"replica {self.replica_id!r}, rank {group.rank} of its {group.size} processes: its "
            f"group's rank 0 manager at {group.manager} {cause} while this process waited "
            f"{waited:.0f} s for {what}. Rank 0 of this replica group died or stopped (its "
            "process hosts the group's torchft manager), and a replica group that lost a "
            "process is dead: end its other processes and start the whole group again (under "
            "torchrun, kill its workers by their process ids); the other groups go on, and the "
            "restarted group's processes heal from their counterparts."
        )

    def timed_out(self, quorum_timeout: float, waited: float) -> QuorumTimeoutError:
        """The error for a quorum that did not come within ``quorum_timeout``, with how many
        replica groups the lighthouse hears from now."""
        status = lighthouse_status(self.address, timeout=min(1.0, self.patience))
        if status is None:
            seen = f"the lighthouse at {self.address} does not answer"
        elif status.heartbeating is None:
            seen = f"the lighthouse at {self.address} answers"
        else:
            seen = (
                f"the lighthouse at {self.address} hears from {status.heartbeating} replica "
                "group(s), this one included"
            )
        return quorum_timed_out(f"replica {self.replica_id!r}", quorum_timeout, waited, seen)

    def check(self, waited: float, joining: bool = True) -> None:
        """Raise :class:`LighthouseGoneError` / :class:`NoPeersError` once either has lasted
        ``patience`` seconds; ``waited``: seconds this replica has waited for its quorum.
        ``joining``: it has not been in a quorum yet (only a joiner is told that nobody is
        left: a survivor's peer may be restarting, and it waits for it up to its
        ``quorum_timeout``)."""
        now = time.monotonic()
        status = lighthouse_status(self.address, timeout=min(1.0, self.patience))
        if status is None:
            self._alone_since = self._unheard_since = None
            self._gone_since = self._gone_since or now
            if now - self._gone_since >= self.patience:
                raise LighthouseGoneError(
                    f"replica {self.replica_id!r}: the torchft lighthouse at {self.address} is "
                    f"gone: it has not answered for {now - self._gone_since:.0f} s while this "
                    f"replica group waited {waited:.0f} s for a quorum (connect_timeout="
                    f"{self.patience:g}s). Its state is that of its last committed step. Restart "
                    "the lighthouse on the same address (`distoptim lighthouse --port PORT "
                    "--min-replicas N`) within connect_timeout and the replica groups rejoin it; "
                    "otherwise restart the job from its checkpoints."
                )
            return
        self._gone_since = None
        self._check_rank0(status, now, waited)
        alone = status.quorum_id and status.heartbeating is not None and status.heartbeating <= 1
        if joining and alone:
            self._alone_since = self._alone_since or now
            if now - self._alone_since >= self.patience:
                raise NoPeersError(
                    f"replica {self.replica_id!r}: no other replica group is left: the "
                    f"lighthouse at {self.address} has issued quorums (the last, "
                    f"{status.quorum_id}) but for {now - self._alone_since:.0f} s has heard from "
                    f"no replica group but this one, which waited {waited:.0f} s for a quorum. "
                    "The job has finished (or every other group died): there is nobody to heal "
                    "from or train with. Start it again with its peers."
                )
            return
        self._alone_since = None

    def _check_rank0(self, status: LighthouseStatus, now: float, waited: float) -> None:
        """Above group rank 0: :class:`GroupManagerUnreachableError` once the lighthouse has
        said for ``patience`` seconds that this group's manager (rank 0's) stopped heartbeating
        (a lighthouse that does not list it, restarted since, says nothing)."""
        if self.group is None or status.hears_from(self.group.replica) is not False:
            self._unheard_since = None
            return
        self._unheard_since = self._unheard_since or now
        if now - self._unheard_since >= self.patience:
            raise self._lost(
                f"has been marked late (no heartbeat within its heartbeat timeout) by the "
                f"lighthouse at {self.address} for {now - self._unheard_since:.0f} s "
                f"(connect_timeout={self.patience:g}s)",
                waited,
                "a quorum",
            )


def _group_place(dist: Any, addr: str, port: int | None, rank: int, size: int) -> GroupPlace:
    """This process's :class:`GroupPlace`, from the keys rank 0's manager wrote in the store."""
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False)
    manager_addr, replica = (store.get(key).decode("utf-8") for key in group_store_keys())
    return GroupPlace(rank, size, replica, manager_addr)


RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""torchrun's count of this worker group's restarts (0, or unset, for its first start)."""


def _forget_dead_incarnation(dist: Any, addr: str, port: int | None, rank: int) -> None:
    """Make the group's store safe to build torchft managers on again after a restart.

    torchft's ``Manager`` publishes group rank 0's manager address in the group's store under
    fixed keys, and the other ranks read it. torchrun restarts a worker group
    (``--max-restarts``) on the same store (its agent's), which still holds the dead
    incarnation's address: a rank above 0 would connect to it. Here group rank 0 deletes those
    keys, then marks this incarnation (``TORCHELASTIC_RESTART_COUNT``); the other ranks wait
    for the mark (the store's timeout bounds it) before torchft reads the address, which rank
    0's new manager then writes."""
    if port is None:
        raise ValueError("store_port is needed with store_addr (the replica group's store)")
    store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False)
    mark = f"distoptim/torchft_keys_cleared/{os.environ.get(RESTART_ENV, '0')}"
    if rank == 0:
        for key in group_store_keys():
            store.delete_key(key)
        store.set(mark, "1")
    else:
        store.wait([mark])


def _seconds(name: str, value: Any) -> datetime.timedelta:
    return datetime.timedelta(seconds=checks.check_seconds(name, value))


def make_manager(
    lighthouse: str,
    *,
    replica_id: str,
    state_dict: Callable[[], Any],
    load_state_dict: Callable[[Any], None],
    min_replica_size: int = 1,
    rank: int = 0,
    world_size: int = 1,
    store_addr: str | None = None,
    store_port: int | None = None,
    host: str = "127.0.0.1",
    timeout: float = 10.0,
    quorum_timeout: float = 60.0,
    connect_timeout: float = 10.0,
    use_async_quorum: bool = True,
    init_sync: bool = True,
    quorum_retries: int = 100,
    backend: str = "gloo",
) -> Any:
    """A ``torchft.Manager`` for this process of one replica group.

    Args:
        lighthouse: the lighthouse's address (``http://host:port``).
        replica_id: the replica group's name; a restarted group reuses its name (torchft adds
            a unique suffix per incarnation). Its trailing digits are its data slot in the CLI.
        state_dict, load_state_dict: the user's model and inner-optimizer state, as torchft
            documents (a healing replica receives what a peer's ``state_dict()`` returns).
            Return copies (``{k: v.clone() ...}``) if the state may change while a joiner
            fetches it (DiLoCo with ``fragment_sync_delay > 0``).
        min_replica_size: replica groups a step needs to be committed.
        rank, world_size: this process in its replica group (1 process per group by default).
        store_addr, store_port: the replica group's TCPStore; ``None`` with ``world_size=1``
            starts one here (on ``host``, a free port). With ``world_size > 1``, group rank 0
            first deletes the keys a dead incarnation's torchft manager left there (torchrun's
            ``--max-restarts`` restarts a group on the same store) and the other ranks wait for
            that, so none of them reaches a dead manager's address.
        host: the address peers reach this process at (manager server, checkpoint server).
        timeout: bound of every collective, ``should_commit`` and checkpoint transfer (s);
            also how long a SIGSTOPped peer holds a collective up.
        quorum_timeout: bound of one quorum (s).
        connect_timeout: bound of reaching the lighthouse and peers' managers (s).
        use_async_quorum: torchft's: the quorum runs beside forward/backward; a joiner sits out
            its first step and takes a peer's state at ``should_commit``.
        init_sync: torchft's: at step 0 every replica takes replica 0's weights. With models
            built identically (seeded), pass False: distoptim then checks they are equal.
        quorum_retries: torchft's: how often the manager asks the lighthouse again after a
            failed request (a few seconds apart), within one quorum's ``quorum_timeout``: what
            lets a restarted lighthouse be rejoined.
        backend: the quorum's process group across replica groups: ``"gloo"`` (CPU tensors,
            or CUDA ones staged through the host) or ``"nccl"`` (CUDA tensors, one device per
            process: torchft's ``ProcessGroupNCCL``, which it aborts on a timeout).

    A wait for a quorum that cannot come is reported within ``connect_timeout``
    (:class:`LighthouseWatch`): :class:`LighthouseGoneError` if the lighthouse stopped
    answering, :class:`NoPeersError` if no other replica group is left.
    """
    lighthouse = checks.check_str("lighthouse", lighthouse)
    replica_id = checks.check_str("replica_id", replica_id)
    min_replica_size = checks.check_int("min_replica_size", min_replica_size, 1)
    rank = checks.check_int("rank", rank, 0)
    world_size = checks.check_int("world_size", world_size, 1)
    host = checks.check_str("host", host)
    use_async_quorum = checks.check_bool("use_async_quorum", use_async_quorum)
    init_sync = checks.check_bool("init_sync", init_sync)
    quorum_retries = checks.check_int("quorum_retries", quorum_retries, 0)
    backend = checks.check_choice("backend", backend, QUORUM_BACKENDS)
    timeouts = {
        "timeout": _seconds("timeout", timeout),
        "quorum_timeout": _seconds("quorum_timeout", quorum_timeout),
        "connect_timeout": _seconds("connect_timeout", connect_timeout),
    }
    if not callable(state_dict) or not callable(load_state_dict):
        raise TypeError("state_dict and load_state_dict must be callables (torchft's contract)")
    if rank >= world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    torchft = require()
    dist = require("torch.distributed")
    quiet()
    keepalive = None
    if store_addr is None:
        if world_size != 1:
            raise ValueError(
                "store_addr/store_port are needed for a replica group of several processes "
                "(its ranks share one store, e.g. torchrun's MASTER_ADDR/MASTER_PORT)"
            )
        keepalive = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        store_addr, store_port = host, keepalive.port
    elif world_size > 1:
        _forget_dead_incarnation(dist, store_addr, store_port, rank)
    try:
        manager = torchft.Manager(
            pg=getattr(torchft, QUORUM_BACKENDS[backend])(timeout=timeouts["timeout"]),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_replica_size,
            use_async_quorum=use_async_quorum,
            rank=rank,
            world_size=world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse,
            replica_id=replica_id,
            hostname=host,
            checkpoint_transport=advertised_http_transport(host, timeouts["timeout"]),
            init_sync=init_sync,
            quorum_retries=quorum_retries,
            **timeouts,
        )
    except RuntimeError as exc:
        named = _unreachable(
            exc, replica_id, rank, world_size, lighthouse, store_addr, store_port, connect_timeout
        )
        if named is None:
            raise
        raise named from exc
    manager._distoptim_store = keepalive  # the replica group's store lives as long as it
    group = None
    if rank > 0:
        assert store_addr is not None  # world_size > 1 needs the group's store (checked above)
        group = _group_place(dist, store_addr, store_port, rank, world_size)
    manager._distoptim_watch = LighthouseWatch(
        lighthouse, replica_id, float(connect_timeout), group
    )
    return manager


def _unreachable(
    exc: RuntimeError,
    replica_id: str,
    rank: int,
    world_size: int,
    lighthouse: str,
    store_addr: str | None,
    store_port: int | None,
    connect_timeout: float,
) -> Exception | None:
    """What torchft's ``failed to connect`` at construction means: a rank above 0 did not
    reach its group's rank 0 manager, rank 0 did not reach the lighthouse; else None."""
    if "failed to connect" in str(exc) and rank > 0:  # only rank 0 talks to the lighthouse
        return GroupManagerUnreachableError(
            f"replica {replica_id!r}, rank {rank} of its {world_size} processes: its group's "
            f"rank 0 manager did not answer within connect_timeout={connect_timeout}s "
            f"({exc}). Rank 0 of this replica group publishes its address in the group's "
            f"store ({store_addr}:{store_port}); it is not running, not reachable at that "
            "address, or the address is a dead incarnation's."
        )
    if "failed to connect" in str(exc):
        return LighthouseUnreachableError(
            f"replica {replica_id!r}: no torchft lighthouse answered at {lighthouse} within "
            f"connect_timeout={connect_timeout}s ({exc}). Start one (`distoptim lighthouse "
            "--min-replicas N`, or distoptim.ft.Lighthouse in-process) and pass its address."
        )
    return None
