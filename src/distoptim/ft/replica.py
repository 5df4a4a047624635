"""A torchft Manager for one replica group, built the way distoptim's tests and CLI build it.

Owns :func:`make_manager`: the few lines every local or multi-node fault-tolerant job repeats
(a store for a one-process replica group, torchft's reconfigurable gloo group with a bounded
timeout, a checkpoint transport that advertises a reachable address, torchft's logging kept
quiet) with distoptim's defaults, and a clear error when the lighthouse is not there. Users may
equally build ``torchft.Manager`` themselves, as torchft documents; everything distoptim does
with a manager goes through its public contract (see :mod:`distoptim.ft`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from distoptim import checks
from distoptim.ft._torchft import advertised_http_transport, quiet, require

__all__ = ["LighthouseUnreachableError", "make_manager"]


class LighthouseUnreachableError(ConnectionError):
    """No torchft lighthouse answered at the given address within the connect timeout."""


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
            starts one here (on ``host``, a free port).
        host: the address peers reach this process at (manager server, checkpoint server).
        timeout: bound of every collective, ``should_commit`` and checkpoint transfer (s);
            also how long a SIGSTOPped peer holds a collective up.
        quorum_timeout: bound of one quorum (s).
        connect_timeout: bound of reaching the lighthouse and peers' managers (s).
        use_async_quorum: torchft's: the quorum runs beside forward/backward; a joiner sits out
            its first step and takes a peer's state at ``should_commit``.
        init_sync: torchft's: at step 0 every replica takes replica 0's weights. With models
            built identically (seeded), pass False: distoptim then checks they are equal.
    """
    lighthouse = checks.check_str("lighthouse", lighthouse)
    replica_id = checks.check_str("replica_id", replica_id)
    min_replica_size = checks.check_int("min_replica_size", min_replica_size, 1)
    rank = checks.check_int("rank", rank, 0)
    world_size = checks.check_int("world_size", world_size, 1)
    host = checks.check_str("host", host)
    use_async_quorum = checks.check_bool("use_async_quorum", use_async_quorum)
    init_sync = checks.check_bool("init_sync", init_sync)
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
    try:
        manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeouts["timeout"]),
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
            **timeouts,
        )
    except RuntimeError as exc:
        if "failed to connect" in str(exc):
            raise LighthouseUnreachableError(
                f"replica {replica_id!r}: no torchft lighthouse answered at {lighthouse} within "
                f"connect_timeout={connect_timeout}s ({exc}). Start one (`distoptim lighthouse "
                "--min-replicas N`, or distoptim.ft.Lighthouse in-process) and pass its address."
            ) from exc
        raise
    manager._distoptim_store = keepalive  # the replica group's store lives as long as it
    return manager
