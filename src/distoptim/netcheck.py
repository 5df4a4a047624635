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
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import json
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from distoptim.checks import check_choice, check_seconds

__all__ = [
    "ENVIRONMENT",
    "TRANSPORTS",
    "BindAddress",
    "NetworkConfigError",
    "bind_addresses",
    "check_torchrun_network",
]

TRANSPORTS = ("gloo", "tensorpipe")
"""The transports whose bind address :func:`bind_addresses` knows."""

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

_IFNAME_VAR = {"gloo": "GLOO_SOCKET_IFNAME", "tensorpipe": "TP_SOCKET_IFNAME"}
_LABEL = {"gloo": "gloo", "tensorpipe": "TensorPipe (torch.distributed.rpc)"}
_CONNECT_TIMEOUT = 3.0
_STORE_JOIN_TIMEOUT = 10.0
_VERDICT_MARGIN = 5.0
_LOOPBACK = "127.0.0.1"

_WHY_MASTER = (
    "torchrun sets MASTER_ADDR to the --local-addr of the node that got rendezvous rank 0, or to "
    "that node's hostname (socket.getfqdn()) when --local-addr is not given"
)
_WHY_BIND = {
    "gloo": "gloo binds to the first address of each GLOO_SOCKET_IFNAME interface, else to the "
    "first address of this host that the hostname resolves to, else to 127.0.0.1",
    "tensorpipe": "TensorPipe binds to the first address of the TP_SOCKET_IFNAME interface, "
    "else to the first address of this host that the hostname resolves to, else to 127.0.0.1",
}
_FIX_MASTER = (
    "start torchrun on every node with --local-addr <that node's address on the network the "
    "nodes share> (and --rdzv-conf is_host=true on the node whose address is in "
    "--rdzv-endpoint), or make that hostname resolve to that address on every node"
)


class NetworkConfigError(RuntimeError):
    """This host cannot take part in the job as configured.

    ``host``: where it was found; ``problem``: what was resolved and what failed; ``why``: how
    it came to be (may be empty); ``fix``: the flag or variable that fixes it. ``str()`` holds
    them all, one per line, after ``where`` (caller, host, rank, node, seconds the check took).
    """

    def __init__(self, where: str, problem: str, fix: str, why: str = "") -> None:
        self.host = socket.gethostname()
        self.problem = problem
        self.why = why
        self.fix = fix
        lines = [f"{where}:", f"  {problem}"]
        lines += [f"  why: {why}"] if why else []
        lines += [f"  fix: {fix}"]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class BindAddress:
    """An address a transport will bind to here, and why (``source``)."""

    transport: str
    address: str
    interface: str | None
    source: str

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.address.split("%")[0]).is_loopback


# ---------------------------------------------------------------------------------------------
# this host's interfaces and the addresses torch will bind to
# ---------------------------------------------------------------------------------------------
class _Sockaddr(ctypes.Structure):
    _fields_ = (("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14))


class _SockaddrIn6(ctypes.Structure):
    _fields_ = (
        ("family", ctypes.c_ushort),
        ("port", ctypes.c_uint16),
        ("flowinfo", ctypes.c_uint32),
        ("addr", ctypes.c_ubyte * 16),
        ("scope_id", ctypes.c_uint32),
    )


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = (
    ("next", ctypes.POINTER(_Ifaddrs)),
    ("name", ctypes.c_char_p),
    ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_Sockaddr)),
    ("netmask", ctypes.POINTER(_Sockaddr)),
    ("ifu", ctypes.POINTER(_Sockaddr)),
    ("data", ctypes.c_void_p),
)


def _interfaces() -> list[tuple[str, str]]:
    """``(interface, address)`` of this host's IPv4/IPv6 addresses, in ``getifaddrs`` order
    (the order gloo and TensorPipe scan them in). Empty where ``getifaddrs`` is unavailable."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        head = ctypes.POINTER(_Ifaddrs)()
        if libc.getifaddrs(ctypes.byref(head)) != 0:
            return []
    except (OSError, AttributeError):
        return []
    out: list[tuple[str, str]] = []
    try:
        node = head
        while node:
            ifa = node.contents
            if ifa.addr and ifa.name:
                family = ifa.addr.contents.family
                name = ifa.name.decode(errors="replace")
                if family == socket.AF_INET:
                    raw = bytes(ifa.addr.contents.data[2:6])
                    out.append((name, socket.inet_ntop(socket.AF_INET, raw)))
                elif family == socket.AF_INET6:
                    six = ctypes.cast(ifa.addr, ctypes.POINTER(_SockaddrIn6)).contents
                    out.append((name, socket.inet_ntop(socket.AF_INET6, bytes(six.addr))))
            node = ifa.next
    finally:
        libc.freeifaddrs(head)
    return out


def _interface_of(address: str, ifaces: Sequence[tuple[str, str]]) -> str | None:
    return next((name for name, a in ifaces if a == address), None)


def _binds(sockaddr: tuple) -> bool:
    family = socket.AF_INET6 if len(sockaddr) == 4 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((sockaddr[0], 0, *sockaddr[2:]))
        except OSError:
            return False
    return True


def _resolve(name: str, port: int | None = None) -> list[tuple]:
    """Distinct sockaddrs ``name`` resolves to, in resolver order (empty when it does not)."""
    try:
        infos = socket.getaddrinfo(name, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out: list[tuple] = []
    for *_, sockaddr in infos:
        if sockaddr not in out:
            out.append(sockaddr)
    return out


def bind_addresses(transport: str) -> list[BindAddress]:
    """The address(es) ``transport`` (``"gloo"`` or ``"tensorpipe"``) will bind to on this host.

    The rule torch follows: the interface(s) named by ``GLOO_SOCKET_IFNAME`` (comma-separated)
    / ``TP_SOCKET_IFNAME``, the first address of each; else the first address the hostname
    resolves to that binds here; else ``127.0.0.1``. Raises :class:`NetworkConfigError` when
    ``GLOO_SOCKET_IFNAME`` names an interface without an address here (gloo would fail to start;
    TensorPipe instead falls back to loopback, which is returned with that reason).
    """
    check_choice("transport", transport, TRANSPORTS, fold_case=False)
    var = _IFNAME_VAR[transport]
    value = os.environ.get(var, "")
    ifaces = _interfaces()
    if value:
        names = value.split(",") if transport == "gloo" else [value]
        out = []
        for name in names:
            address = next((a for n, a in ifaces if n == name), None)
            if address is None:
                have = ", ".join(dict.fromkeys(n for n, _ in ifaces)) or "none found"
                problem = f"{var}={value} names {name!r}, which is not an interface with an "
                problem += f"address on this host (interfaces here: {have})"
                if transport == "gloo":
                    raise NetworkConfigError(
                        f"host {socket.gethostname()!r}", problem + ".", f"set {var} to one of them"
                    )
                return [BindAddress(transport, _LOOPBACK, "lo", problem + "; loopback fallback")]
            out.append(BindAddress(transport, address, name, f"{var}={value}"))
        return out
    hostname = socket.gethostname()
    resolved = _resolve(hostname)
    for sockaddr in resolved:
        if _binds(sockaddr):
            return [
                BindAddress(
                    transport,
                    sockaddr[0],
                    _interface_of(sockaddr[0], ifaces),
                    f"{var} not set; the hostname {hostname!r} resolves to {sockaddr[0]}",
                )
            ]
    found = ", ".join(s[0] for s in resolved) or "nothing"
    reason = f"{var} not set; the hostname {hostname!r} resolves to {found}, "
    reason += "no address of this host, so it falls back to loopback"
    return [BindAddress(transport, _LOOPBACK, "lo", reason)]


def _route_source(address: str, port: int) -> str | None:
    """The source address this host would use towards ``address`` (a route lookup: a UDP
    socket's ``connect`` sends nothing); ``None`` when there is no route."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, port))
        except OSError:
            return None
        return s.getsockname()[0]


# ---------------------------------------------------------------------------------------------
# the job as torchrun describes it
# ---------------------------------------------------------------------------------------------
def _env_seconds(name: str, value: str) -> float:
    """The environment variable ``name``'s ``value`` as seconds > 0, or an error naming it."""
    try:
        return check_seconds(name, float(value))
    except ValueError:
        raise ValueError(
            f"{name}={value!r} must be a finite number of seconds > 0 (or unset)"
        ) from None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else None


@dataclass(frozen=True)
class _Job:
    caller: str
    host: str
    rank: int
    local_rank: int | None
    node: int | None
    nodes: int | None
    multi_node: bool
    master_addr: str
    master_port: int
    agent_store: bool
    key: str
    started: float

    @classmethod
    def from_env(cls, caller: str) -> _Job:
        world, local_world = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
        nodes = _env_int("GROUP_WORLD_SIZE")
        if nodes is None and world is not None and local_world is not None:
            nodes = 1 if world <= local_world else None  # several nodes, count unknown
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(
            caller=caller,
            host=socket.gethostname(),
            rank=_env_int("RANK") or 0,
            local_rank=_env_int("LOCAL_RANK"),
            node=_env_int("GROUP_RANK"),
            nodes=nodes,
            multi_node=nodes != 1,
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            key=f"distoptim.netcheck/{run}/{restart}/",
            started=time.monotonic(),
        )

    def where(self) -> str:
        node = "" if self.node is None else f", node {self.node}"
        node += "" if self.nodes is None or self.node is None else f" of {self.nodes}"
        took = time.monotonic() - self.started
        return (
            f"{self.caller} on host {self.host!r} (rank {self.rank}{node}; checked in {took:.1f} s)"
        )

    def error(self, problem: str, fix: str, why: str = "") -> NetworkConfigError:
        return NetworkConfigError(self.where(), problem, fix, why)

    @property
    def master(self) -> str:
        return f"MASTER_ADDR={self.master_addr}, MASTER_PORT={self.master_port}"


# ---------------------------------------------------------------------------------------------
# connections
# ---------------------------------------------------------------------------------------------
def _connect_all(
    pairs: Sequence[tuple[str | None, tuple]], timeout: float
) -> list[tuple[str | None, float]]:
    """Open a TCP connection for each ``(source address or None, destination sockaddr)``, all at
    once; per pair ``(None, seconds)`` when it opened, else ``(reason, seconds)``."""
    start = time.monotonic()
    results: list[tuple[str | None, float] | None] = [None] * len(pairs)
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    try:
        for i, (source, dest) in enumerate(pairs):
            family = socket.AF_INET6 if len(dest) == 4 else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setblocking(False)
            try:
                if source is not None:
                    s.bind((source, 0))
                code = s.connect_ex(dest)
            except OSError as exc:
                results[i] = (exc.strerror or str(exc), 0.0)
                continue
            if code == 0:
                results[i] = (None, 0.0)
            elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY):
                sel.register(s, selectors.EVENT_WRITE, i)
            else:
                results[i] = (os.strerror(code), 0.0)
        deadline = start + timeout
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                code = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                reason = None if code == 0 else os.strerror(code)
                results[key.data] = (reason, time.monotonic() - start)
                sel.unregister(key.fileobj)
        for key in list(sel.get_map().values()):
            results[key.data] = (f"no answer within {timeout:g} s", timeout)
    finally:
        sel.close()
        for s in socks:
            s.close()
    return [r if r is not None else ("not attempted", 0.0) for r in results]


def _reason(reason: str, seconds: float) -> str:
    """A failed connection's reason for a message (with its time unless it timed out)."""
    return reason if reason.startswith("no answer") else f"{reason} after {seconds:.1f} s"


class _Listener:
    """A TCP listener on ``address`` that accepts and drops connections until closed."""

    def __init__(self, address: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((address, 0))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="netcheck-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.sock.close()


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


def _fix_interface(job: _Job, transport: str) -> str:
    var = _IFNAME_VAR[transport]
    fix = f"set {var}=<the interface of the network the nodes share> on every node"
    for sockaddr in _resolve(job.master_addr, job.master_port):
        source = _route_source(sockaddr[0], job.master_port)
        name = _interface_of(source, _interfaces()) if source else None
        if name and not ipaddress.ip_address(source.split("%")[0]).is_loopback:
            return f"{fix} -- here {var}={name} ({source}), the interface towards MASTER_ADDR"
    if transport == "tensorpipe":
        fix += " (rpc needs GLOO_SOCKET_IFNAME too)"
    return fix


# ---------------------------------------------------------------------------------------------
# the exchange between nodes (check 5)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Advertised:
    """One address a node's transport binds to, with the port of the node's listener on it."""

    transport: str
    address: str
    port: int
    source: str


@dataclass(frozen=True)
class _Problem:
    """What one node found: the problem text and its fix."""

    problem: str
    fix: str


@dataclass(frozen=True)
class _NodeRecord:
    """What a node publishes first: its host and addresses, or the error of its own checks."""

    host: str
    advertised: tuple[_Advertised, ...] = ()
    failed: _Problem | None = None

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: bytes | str) -> _NodeRecord:
        d = json.loads(text)
        failed = None if d["failed"] is None else _Problem(**d["failed"])
        return cls(d["host"], tuple(_Advertised(**a) for a in d["advertised"]), failed)


@dataclass(frozen=True)
class _Verdict:
    """What a node publishes last: the problems it found (none: it reaches every node)."""

    host: str
    problems: tuple[_Problem, ...]

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: bytes | str) -> _Verdict:
        d = json.loads(text)
        return cls(d["host"], tuple(_Problem(**p) for p in d["problems"]))


def _probe_peers(
    job: _Job, binds: Sequence[BindAddress], records: dict[int, _NodeRecord]
) -> list[_Problem]:
    """Connect from each of this node's bind addresses to every other node's address of the
    same transport (all at once); the problems found. Nodes that failed their own checks are
    skipped: their own verdict says why."""
    mine = {a for _, a in _interfaces()}
    problems: list[_Problem] = []
    pairs: list[tuple[str | None, tuple]] = []
    targets: list[tuple[BindAddress, int, _Advertised]] = []
    for j, rec in sorted(records.items()):
        if j == job.node or rec.failed is not None:
            continue
        for b in binds:
            for theirs in (a for a in rec.advertised if a.transport == b.transport):
                if theirs.address in mine:
                    problems.append(
                        _Problem(
                            f"node {j} (host {rec.host!r}) advertises {_LABEL[b.transport]} "
                            f"address {theirs.address} ({theirs.source}), an address of this "
                            "host too: the nodes would connect to themselves.",
                            _fix_interface(job, b.transport),
                        )
                    )
                    continue
                dest: tuple = (theirs.address, theirs.port)
                pairs.append((b.address, (*dest, 0, 0) if ":" in theirs.address else dest))
                targets.append((b, j, theirs))
    for (reason, t), (b, j, theirs) in zip(_connect_all(pairs, _CONNECT_TIMEOUT), targets):
        if reason is not None:
            problems.append(
                _Problem(
                    f"{_LABEL[b.transport]} binds to {b.address} here ({b.source}) and cannot "
                    f"connect to node {j} (host {records[j].host!r}) at {theirs.address} "
                    f"({theirs.source}): {_reason(reason, t)}.",
                    _fix_interface(job, b.transport),
                )
            )
    return problems


def _wait(store: Any, keys: list[str], timeout: float) -> list[str]:
    """Wait for ``keys``; the ones still missing after ``timeout``."""
    import torch.distributed as dist

    try:
        store.wait(keys, timedelta(seconds=timeout))
        return []
    except dist.DistStoreError:
        return [k for k in keys if not store.check([k])]


def _exchange(
    job: _Job,
    store: Any,
    binds: list[BindAddress],
    failure: NetworkConfigError | None,
    timeout: float,
    prefix: str,
) -> None:
    """Check 5 (see the module docstring), keys under ``prefix``: raises if any node found a
    problem or did not report within ``timeout``."""
    assert job.node is not None and job.nodes is not None
    node_keys = [f"{prefix}node/{j}" for j in range(job.nodes)]
    verdict_keys = [f"{prefix}verdict/{j}" for j in range(job.nodes)]
    listeners: dict[str, _Listener] = {}
    try:
        if job.local_rank == 0:  # the node's voice: publish, probe, judge
            if failure is not None:
                own = _Problem(failure.problem, failure.fix)
                store.set(node_keys[job.node], _NodeRecord(job.host, failed=own).dumps())
                store.set(verdict_keys[job.node], _Verdict(job.host, (own,)).dumps())
                return
            for b in binds:
                if b.address not in listeners:
                    listeners[b.address] = _Listener(b.address)
            advertised = tuple(
                _Advertised(b.transport, b.address, listeners[b.address].port, b.source)
                for b in binds
            )
            store.set(node_keys[job.node], _NodeRecord(job.host, advertised).dumps())
            missing = _wait(store, node_keys, timeout)
            records = {
                j: _NodeRecord.loads(store.get(k))
                for j, k in enumerate(node_keys)
                if k not in missing
            }
            problems = _probe_peers(job, binds, records)
            if missing:
                problems.append(_missing_problem(job, missing, timeout))
            store.set(verdict_keys[job.node], _Verdict(job.host, tuple(problems)).dumps())
        if failure is not None:
            return
        # this node's leader publishes its verdict at most a probe (and a margin) after its wait
        own_key = verdict_keys[job.node]
        if _wait(store, [own_key], timeout + _CONNECT_TIMEOUT + _VERDICT_MARGIN):
            raise job.error(
                f"the first process of this node gave no verdict within {timeout:g} s.",
                f"see the first error in this node's log; {_FIX_MASTER}",
            )
        own = _Verdict.loads(store.get(own_key))
        if own.problems:  # enough to fail: wait briefly for the nodes that are there
            there = [
                k
                for j, k in enumerate(verdict_keys)
                if j != job.node and store.check([node_keys[j]])
            ]
            missing = _wait(store, there, _CONNECT_TIMEOUT)
        else:  # every node published its addresses: every verdict is on its way
            missing = _wait(store, verdict_keys, timeout + _CONNECT_TIMEOUT + _VERDICT_MARGIN)
        found: list[tuple[str, _Problem]] = []
        for j, k in enumerate(verdict_keys):
            if store.check([k]):
                verdict = _Verdict.loads(store.get(k))
                found += [(f"node {j} (host {verdict.host!r})", p) for p in verdict.problems]
        if missing and not own.problems:
            found.append((f"seen from node {job.node}", _missing_problem(job, missing, timeout)))
        if found:
            ours = [p for who, p in found if who.startswith(f"node {job.node} ")]
            raise job.error(
                "the nodes cannot all reach each other (checked before the first collective):"
                + "".join(f"\n  - {who}: {p.problem}" for who, p in found),
                (ours or [found[0][1]])[0].fix,
            )
    finally:
        for listener in listeners.values():
            listener.close()


def _missing_problem(job: _Job, keys: list[str], timeout: float) -> _Problem:
    nodes = ", ".join(k.rsplit("/", 1)[1] for k in keys)
    return _Problem(
        f"node(s) {nodes} did not report to the network check within {timeout:g} s: they cannot "
        f"reach the rendezvous store at {job.master}, or started late (every node's first "
        "process publishes its addresses there and waits for the others'; "
        "DISTOPTIM_NETCHECK_TIMEOUT bounds the wait, default: the caller's timeout).",
        f"see the first error in the logs of node(s) {nodes}; {_FIX_MASTER}",
    )


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
