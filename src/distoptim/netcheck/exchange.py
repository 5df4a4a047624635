"""The exchange between nodes (check 5): listeners, connections and verdicts through the store.

Owns: connecting to many addresses at once within a bound, the listener a node opens on each
address it will bind to, the records and verdicts nodes publish in the store, and
``_exchange``, which raises on every node when any node found a problem
(``distoptim.netcheck``'s docstring, check 5).
"""

from __future__ import annotations

import errno
import json
import os
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from distoptim.netcheck.interfaces import _fix_interface, _interfaces
from distoptim.netcheck.job import (
    _CONNECT_TIMEOUT,
    _FIX_MASTER,
    _LABEL,
    _VERDICT_MARGIN,
    BindAddress,
    NetworkConfigError,
    _Job,
)


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
