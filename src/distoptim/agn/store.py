"""The job's store as an AGN cluster uses it: reached within a bound, one namespace per job.

Owns: how a process of a cluster reaches the job's ``TCPStore`` (:func:`connect`), what
``DISTOPTIM_AGN_JOIN`` may hold (:func:`parse_address`), where a job's keys live in the store
(:func:`store_namespace`) and the claim that keeps two jobs from sharing them (:func:`claim`).

Reaching the store
------------------
``torch.distributed.TCPStore`` retries a refused or unresolvable address until its timeout and,
once a connection is open, waits for the store's answer to its handshake without any bound (a
port where something else listens, accepts and never answers holds it forever).
:func:`connect` therefore checks the address first: a host that cannot be resolved, or a port
where nothing listens (the connection is refused), is reported at once; a connection that does
not open within the timeout is reported then; and the store's handshake runs on a helper thread
the caller waits for no longer than the rest of the timeout. A handshake that never answers
leaves that thread blocked until the peer closes the connection (it holds one socket, nothing
else); the caller has its error by then.

Namespaces
----------
A job's keys live under ``distoptim.agn/<job>/<restart>``: ``<job>`` is ``DISTOPTIM_AGN_JOB``
when set, else torchrun's run id (``TORCHELASTIC_RUN_ID``), else ``default``; ``<restart>`` is
``TORCHELASTIC_RESTART_COUNT`` (a torchrun restart of the whole job starts afresh). Local
clusters (:mod:`distoptim.agn.local_cluster`) give each cluster its own job id. So two jobs
pointed at one store keep apart when their job ids differ; when they do not, the second job's
processes find their ranks claimed (:func:`claim`) and stop at once with an error saying so,
before they write anything there. ``distoptim.agn/current`` names the namespace of the job that
started last and ``distoptim.agn/<job>/current`` that of job ``<job>`` (for late joiners).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distoptim.checks import check_str

__all__ = [
    "CURRENT_KEY",
    "JOB_ENV",
    "StoreUnreachableError",
    "claim",
    "connect",
    "current_key",
    "job_id",
    "parse_address",
    "store_namespace",
]

JOB_ENV = "DISTOPTIM_AGN_JOB"
"""This job's id: its keys in the store live under ``distoptim.agn/<job id>/...``."""

CURRENT_KEY = "distoptim.agn/current"
"""Names the namespace of the job that started last (a late joiner without a job id joins it)."""


class StoreUnreachableError(RuntimeError):
    """The job's store could not be reached at its address, or did not answer there."""


# ---------------------------------------------------------------------------------------------
# addresses
# ---------------------------------------------------------------------------------------------
def parse_address(name: str, value: str) -> tuple[str, int]:
    """``(host, port)`` from ``value``, the ``HOST:PORT`` held by the setting ``name`` (an
    environment variable): ``10.0.0.1:29500``, ``node7:29500``, ``[::1]:29500``. ``ValueError``
    naming ``name`` and the expected form otherwise."""
    form = f"HOST:PORT, the running cluster's store (e.g. {name}=10.0.0.1:29500)"
    host, sep, port_s = value.strip().rpartition(":")
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host:
        raise ValueError(f"{name}={value!r} must be {form}; it has no host and port")
    if not port_s.isdigit():
        raise ValueError(f"{name}={value!r} must be {form}; the port {port_s!r} is not a number")
    port = int(port_s)
    if not 1 <= port <= 65535:
        raise ValueError(f"{name}={value!r} must be {form}; port {port} is not in [1, 65535]")
    return host, port


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int in [1, 65535], got {type(port).__name__}")
    if not 1 <= port <= 65535:
        raise ValueError(f"port must be in [1, 65535], got {port}")
    return port


# ---------------------------------------------------------------------------------------------
# reaching the store
# ---------------------------------------------------------------------------------------------
def _open_probe(host: str, port: int, timeout: float, what: str) -> None:
    """Resolve ``host`` and open (then close) a TCP connection to ``host:port``: an unknown host
    or a refused connection raises at once, a connection that does not open within ``timeout``
    raises then."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise StoreUnreachableError(
            f"{what}: the host {host!r} cannot be resolved ({exc.strerror or exc}); check the "
            "host name"
        ) from None
    deadline = time.monotonic() + timeout
    refused: list[str] = []
    failed: list[str] = []
    for family, kind, proto, _, sockaddr in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        with socket.socket(family, kind, proto) as s:
            s.settimeout(left)
            try:
                s.connect(sockaddr)
                return
            except ConnectionRefusedError:
                refused.append(str(sockaddr[0]))
            except OSError as exc:  # a timeout, no route, ...
                failed.append(f"{sockaddr[0]}: {exc.strerror or exc or 'timed out'}")
    if refused and not failed:
        raise StoreUnreachableError(
            f"{what}: nothing listens at {host}:{port} (connection refused by "
            f"{', '.join(refused)}); is the job whose store that is running, and is the port "
            "right?"
        )
    raise StoreUnreachableError(
        f"{what}: no connection to {host}:{port} within {timeout:g}s ("
        f"{'; '.join(failed + [f'{a}: refused' for a in refused]) or 'timed out'}); is the "
        "address reachable from this host (firewall, network interface)?"
    )


def connect(host: str, port: int, timeout: float, what: str) -> dist.TCPStore:
    """A client of the ``TCPStore`` at ``host:port``, or :class:`StoreUnreachableError` within
    ``timeout`` seconds (see the module docstring; an unknown host or a refused connection at
    once). ``what`` names the address in errors (``"DISTOPTIM_AGN_JOIN=h:p"``). The client's
    blocking operations are bounded by ``timeout`` too."""
    host = check_str("host", host)
    port = _check_port(port)
    started = time.monotonic()
    _open_probe(host, port, timeout, what)
    box: dict[str, object] = {}

    def handshake() -> None:
        try:
            box["store"] = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=timeout)
            )
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    helper = threading.Thread(target=handshake, name="agn-store-handshake", daemon=True)
    helper.start()
    helper.join(max(0.0, timeout - (time.monotonic() - started)))
    if "store" in box:
        return box["store"]  # type: ignore[return-value]
    error = box.get("error")
    if error is not None:
        raise StoreUnreachableError(f"{what}: the store at {host}:{port} failed: {error}") from (
            error if isinstance(error, BaseException) else None
        )
    raise StoreUnreachableError(
        f"{what}: {host}:{port} accepts connections but did not answer as a torch.distributed "
        f"store within {timeout:g}s; is another service listening on that port?"
    )


# ---------------------------------------------------------------------------------------------
# namespaces and claims
# ---------------------------------------------------------------------------------------------
def job_id(job: str | None = None) -> str:
    """This job's id: ``job``, else ``DISTOPTIM_AGN_JOB``, else ``TORCHELASTIC_RUN_ID``, else
    ``"default"``; non-empty, without ``/`` or whitespace."""
    source = "job"
    if job is None:
        source = JOB_ENV
        job = os.environ.get(JOB_ENV) or None
    if job is None:
        source = "TORCHELASTIC_RUN_ID"
        job = os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    if not isinstance(job, str) or not job or "/" in job or any(c.isspace() for c in job):
        raise ValueError(
            f"{source}={job!r} must be a non-empty job id without '/' or whitespace (it names "
            "the job's keys in the store)"
        )
    return job


def store_namespace(job: str | None = None) -> str:
    """The namespace of this run's keys in the job's store (module docstring)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"distoptim.agn/{job_id(job)}/{restart}"


def current_key(job: str) -> str:
    """The key naming job ``job``'s latest namespace (for late joiners)."""
    return f"distoptim.agn/{job}/current"


_TOKEN: tuple[int, str] | None = None


def _process_token() -> str:
    """Who this process is, for the claims: pid, host and a random word (unique per process,
    also after a fork)."""
    global _TOKEN
    pid = os.getpid()
    if _TOKEN is None or _TOKEN[0] != pid:
        _TOKEN = (pid, f"pid {pid} on host {socket.gethostname()} ({os.urandom(4).hex()})")
    return _TOKEN[1]


def claim(store: dist.Store, rank: int, namespace: str, where: str) -> None:
    """Claim rank ``rank`` of the job whose namespace of ``store`` this is, for this process, or
    raise ``RuntimeError`` when another process holds it: two jobs with one job id at one store
    (``where``: its address). A process may claim its own rank again; a shard a local cluster
    restarts (``DISTOPTIM_RESTART_COUNT``) claims it afresh."""
    token = _process_token()
    restart = os.environ.get("DISTOPTIM_RESTART_COUNT", "0")
    holder = store.compare_set(f"member/{rank}/{restart}", "", token).decode()
    if holder != token:
        raise RuntimeError(
            f"rank {rank} of the job in the store namespace {namespace!r} at {where} is already "
            f"taken by another process ({holder}): two parameter-server jobs share that store "
            f"under one job id. Give each job its own {JOB_ENV} (or its own store: another "
            "MASTER_PORT)"
        )
