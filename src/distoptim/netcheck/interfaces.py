"""This host's interfaces and the addresses torch's transports will bind to.

Owns: listing the interfaces and their addresses (``getifaddrs``), name resolution, whether an
address can be bound here, the route to an address, and :func:`bind_addresses`, which
replicates gloo's and TensorPipe's choice of address (``distoptim.netcheck``'s docstring).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import sys
from collections.abc import Sequence

from distoptim.checks import check_choice
from distoptim.netcheck.job import (
    _IFNAME_VAR,
    _LOOPBACK,
    TRANSPORTS,
    BindAddress,
    NetworkConfigError,
    _Job,
)


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
