"""Pre-flight network check of a torchrun job: a misconfigured network fails in seconds.

Owns: deciding, before the first collective, whether this process can take part in a
multi-node job -- that ``MASTER_ADDR`` resolves to a rendezvous store this host reaches, and
that the addresses gloo (and TensorPipe, for ``torch.distributed.rpc``) will bind to are
reachable from the other nodes -- and, when not, one :class:`NetworkConfigError` that says what
was resolved, on which host, and which flag or variable fixes it. Entry points call
:func:`check_torchrun_network` first: ``distoptim.launch.torchrun_main``,
``distoptim.agn.Cluster.from_env`` and ``python -m distoptim.cli.train``.

What a job across nodes needs, and how torch picks it
-----------------------------------------------------
* **The store.** torchrun sets ``MASTER_ADDR`` to the ``--local-addr`` of the node that got
  rendezvous rank 0, or to that node's hostname (``socket.getfqdn()``) when ``--local-addr`` is
  not given; the store listens there (``TORCHELASTIC_USE_AGENT_STORE=True``: before any worker
  starts). A hostname that resolves to loopback, or to a NIC the other nodes cannot reach, is
  what turns a job into a hang.
* **gloo's address.** gloo binds to the first address of the ``GLOO_SOCKET_IFNAME``
  interface(s) (comma-separated); without it, to the first address the hostname resolves to
  that can be bound on this host; when there is none, to ``127.0.0.1`` (torch warns "Unable to
  resolve hostname to a (local) address"). Every peer connects to the address it advertises.
* **TensorPipe's address** (rpc): the same rule with ``TP_SOCKET_IFNAME`` (one interface), and
  a loopback fallback too. ``rpc.init_rpc`` also builds a gloo group, so rpc needs both.

:func:`bind_addresses` replicates those rules.

The checks, in order (each failure raises at once)
--------------------------------------------------
1. ``MASTER_ADDR`` resolves here.
2. On a job across nodes, it does not resolve to loopback only.
3. When the store already listens (``TORCHELASTIC_USE_AGENT_STORE=True``, as under torchrun
   and :func:`distoptim.launch.spawn`), a TCP connection to ``MASTER_ADDR:MASTER_PORT`` opens
   within 3 s; otherwise a route to it exists (no packet sent).
4. ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` name interfaces with an address here; on a job
   across nodes, the addresses gloo/TensorPipe will bind to are not loopback.
5. On a job across nodes (``GROUP_WORLD_SIZE > 1``, agent store): the exchange. The first local
   process of each node (``LOCAL_RANK`` 0) opens a listener on each of those addresses, puts
   them in the store, waits for every node's, and connects to every other node's from its own
   address of the same transport (3 s each, all at once) -- the connections the first collective
   will make. Each node then publishes its verdict; every process waits for all verdicts and
   raises if any node found a problem, so a node whose peer is misconfigured fails too, quoting
   the peer. A node that fails checks 4 publishes its error here before raising. A node that
   cannot reach the store (checks 1-3) cannot publish: the others name it after the wait, which
   is bounded by the caller's timeout (``DISTOPTIM_NETCHECK_TIMEOUT`` seconds overrides it).

Costs: on one node, a name lookup of ``MASTER_ADDR`` and of the hostname, one TCP connection
(opened and closed) and an interface listing -- about a millisecond. Across nodes add the
exchange: per process a store client and ``2 * nodes`` store reads; per node one listener and
``nodes - 1`` connections per address. A later call in the same process checks only the
transports no earlier call checked (the CLI checks gloo, then ``Cluster.from_env`` adds
TensorPipe: a second, smaller exchange round), and returns at once when there are none; so every
process must make the same calls, as SPMD code does. ``DISTOPTIM_NETCHECK=0`` turns every check
off.

Not covered: NCCL's own interface choice (``NCCL_SOCKET_IFNAME``; a NCCL-only job gets checks
1-3), and a network that fails after start-up.

Modules: ``job`` (the environment read, the error), ``interfaces`` (this host's addresses and
what torch binds to), ``exchange`` (check 5); the checks and the entry point are here.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from distoptim.checks import check_choice, check_seconds
from distoptim.netcheck.exchange import _connect_all, _exchange, _reason
from distoptim.netcheck.interfaces import (
    _fix_interface,
    _interfaces,  # noqa: F401  (the tests list this host's interfaces through it)
    _resolve,
    _route_source,
    bind_addresses,
)
from distoptim.netcheck.job import (
    _CONNECT_TIMEOUT,
    _FIX_MASTER,
    _LABEL,
    _STORE_JOIN_TIMEOUT,
    _WHY_BIND,
    _WHY_MASTER,
    TRANSPORTS,
    BindAddress,
    NetworkConfigError,
    _env_seconds,
    _Job,
)

__all__ = [
    "ENVIRONMENT",
    "TRANSPORTS",
    "BindAddress",
    "NetworkConfigError",
    "bind_addresses",
    "check_torchrun_network",
]

ENVIRONMENT = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "DISTOPTIM_NETCHECK",
    "DISTOPTIM_NETCHECK_TIMEOUT",
)
"""Every environment variable the check reads (torchrun's, the interface choices, its own)."""


# ---------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------
def _check_master(job: _Job) -> list[tuple]:
    """Checks 1 and 2; the sockaddrs ``MASTER_ADDR`` resolves to."""
    resolved = _resolve(job.master_addr, job.master_port)
    if not resolved:
        raise job.error(
            f"MASTER_ADDR={job.master_addr!r} does not resolve on this host.",
            _FIX_MASTER,
            _WHY_MASTER,
        )
    ips = [s[0] for s in resolved]
    if job.multi_node and all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips):
        nodes = f"{job.nodes} nodes" if job.nodes else "several nodes"
        raise job.error(
            f"MASTER_ADDR={job.master_addr!r} resolves to {', '.join(ips)} here, a loopback "
            f"address, in a job across {nodes}: the other nodes cannot reach the rendezvous "
            "store through it.",
            _FIX_MASTER,
            _WHY_MASTER,
        )
    return resolved


def _check_store(job: _Job, resolved: list[tuple]) -> bool:
    """Check 3; whether the store already listens (and answered a connection)."""
    ips = ", ".join(s[0] for s in resolved)
    if not job.agent_store:  # rank 0 will host it: only a route can be checked now
        if not any(_route_source(s[0], job.master_port) for s in resolved):
            raise job.error(
                f"no route from this host to MASTER_ADDR={job.master_addr!r} (resolves to {ips}).",
                _FIX_MASTER,
                _WHY_MASTER,
            )
        return False
    outcomes = _connect_all([(None, s) for s in resolved], _CONNECT_TIMEOUT)
    if all(reason is not None for reason, _ in outcomes):
        tried = "; ".join(
            f"{s[0]}: {_reason(reason, t)}" for s, (reason, t) in zip(resolved, outcomes)
        )
        raise job.error(
            f"cannot reach the rendezvous store at {job.master} from this host "
            f"({job.master_addr!r} resolves here to {ips}; {tried}).",
            _FIX_MASTER,
            _WHY_MASTER,
        )
    return True


def _store_client(job: _Job, timeout: float) -> Any:
    """A client of the store at ``MASTER_ADDR:MASTER_PORT`` (for the exchange)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            job.master_addr,
            job.master_port,
            is_master=False,
            timeout=timedelta(seconds=_STORE_JOIN_TIMEOUT),
        )
    except (RuntimeError, ValueError) as exc:  # connected, but no store answers there
        raise job.error(
            f"{job.master_addr!r} accepts connections on port {job.master_port}, but no "
            f"rendezvous store answers there ({exc}).",
            _FIX_MASTER,
        ) from exc
    store.set_timeout(timedelta(seconds=max(timeout, _STORE_JOIN_TIMEOUT)))
    return store


def _check_binds(job: _Job, transports: Sequence[str]) -> list[BindAddress]:
    """Check 4; the addresses the transports will bind to."""
    binds: list[BindAddress] = []
    for t in transports:
        try:
            binds += bind_addresses(t)
        except NetworkConfigError as exc:
            raise job.error(exc.problem, exc.fix, exc.why) from None
    if not job.multi_node:
        return binds
    for b in binds:
        if b.is_loopback:
            raise job.error(
                f"{_LABEL[b.transport]} would bind to {b.address}, a loopback address "
                f"({b.source}); the other nodes cannot connect to it and the first collective "
                "would hang.",
                _fix_interface(job, b.transport),
                _WHY_BIND[b.transport],
            )
    return binds


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------
@dataclass
class _Checked:
    """What this process checked for one rendezvous: the transports, and the exchange rounds."""

    transports: set[str]
    rounds: int = 0


_CHECKED: dict[tuple[str, int, str], _Checked] = {}


def check_torchrun_network(
    caller: str, transports: Sequence[str] = ("gloo",), timeout: float = 300.0
) -> None:
    """Check, before the first collective, that this process can join the job torchrun's
    environment describes; raise :class:`NetworkConfigError` (what, where, the fix) if not.

    ``caller``: named in the error. ``transports``: the ones the job will use (``"gloo"``,
    ``"tensorpipe"``; empty for NCCL only). ``timeout``: the longest wait for the other nodes
    (the caller's own start-up timeout, so the check waits no longer than the start-up would;
    ``DISTOPTIM_NETCHECK_TIMEOUT`` overrides it). The checks and their costs are in the module
    docstring. Per process and rendezvous, a later call checks only the transports no earlier
    call checked, and returns at once when there are none; across nodes each call that checks
    a transport is one exchange round, so every process must make the same calls (as SPMD
    code does). ``DISTOPTIM_NETCHECK=0`` turns every check off.
    """
    for t in transports:
        check_choice("transport", t, TRANSPORTS, fold_case=False)
    timeout = check_seconds("timeout", timeout)
    if os.environ.get("DISTOPTIM_NETCHECK", "1").strip() == "0":
        return
    override = os.environ.get("DISTOPTIM_NETCHECK_TIMEOUT")
    if override:
        timeout = _env_seconds("DISTOPTIM_NETCHECK_TIMEOUT", override)
    job = _Job.from_env(caller)
    rendezvous = (job.master_addr, job.master_port, job.key)
    state = _CHECKED.get(rendezvous)
    todo = [t for t in dict.fromkeys(transports) if state is None or t not in state.transports]
    if state is not None and not todo:
        return
    listening = _check_store(job, _check_master(job))
    exchange = listening and job.multi_node and bool(todo)
    exchange = exchange and None not in (job.node, job.nodes, job.local_rank)
    failure: NetworkConfigError | None = None
    binds: list[BindAddress] = []
    try:
        binds = _check_binds(job, todo)
    except NetworkConfigError as exc:
        if not exchange:
            raise
        failure = exc
    rounds = 0 if state is None else state.rounds
    if exchange:
        store = _store_client(job, timeout)
        _exchange(job, store, binds, failure, timeout, f"{job.key}{rounds}/")
    if failure is not None:
        raise failure
    state = _CHECKED.setdefault(rendezvous, _Checked(set()))
    state.transports.update(todo)
    state.rounds = rounds + exchange


# Named (in tracebacks, reprs and pickles) as what users import from here.
for _cls in (BindAddress, NetworkConfigError):
    _cls.__module__ = __name__
del _cls
