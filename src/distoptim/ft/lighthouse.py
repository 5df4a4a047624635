"""The torchft lighthouse: the one process every replica group asks for its quorum.

Owns starting a lighthouse for the user: in this process for local runs and tests
(:class:`Lighthouse`, a context manager), or as a standalone server for multi-node jobs
(``distoptim lighthouse``, :func:`serve`; torchft's own ``torchft_lighthouse`` is the same
server). The lighthouse is torchft's Rust ``LighthouseServer`` shipped inside the torchft wheel;
nothing here re-implements a quorum.

What its three times mean (torchft's semantics, in seconds here):

* ``heartbeat_timeout``: a replica group whose manager has not sent a heartbeat for this long is
  dead: the next quorum forms without it. This is how fast a SIGKILLed or SIGSTOPped replica is
  noticed between steps, and what a warm spare's first quorum waits for: the lighthouse still
  counts the dead incarnation until then (torchft's default is 5 s; distoptim's local default
  1 s, ten of torchft's 0.1 s beats: a live group is dropped only after a silence that long,
  :class:`HeartbeatWatch` measures the longest one).
* ``join_timeout``: how long a quorum waits for replica groups that are heartbeating (alive)
  but have not asked to join yet -- stragglers, or a DiLoCo replica still in its inner steps.
  Longer than the gap between two replicas' sync points, shorter than you want a slow replica
  to hold the others up.
* ``quorum_tick``: how often the lighthouse re-checks a pending quorum.

``min_replicas`` is the lighthouse's floor: no quorum forms with fewer replica groups (each
manager's ``min_replica_size`` is a second, per-step floor: a step with fewer participants is
not committed).

Also owns :func:`lighthouse_status`: what a replica waiting for a quorum can learn about the
lighthouse -- whether it answers at all, its current quorum id, how many replica groups
heartbeat and whether it still hears from a given one -- read from the status page torchft's
lighthouse serves on its own port (``/status``, its dashboard), the one place that reports
them.
"""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from distoptim import checks
from distoptim.ft._torchft import require

__all__ = ["HeartbeatWatch", "Lighthouse", "LighthouseStatus", "lighthouse_status", "main", "serve"]


@dataclass(frozen=True)
class LighthouseStatus:
    """What the lighthouse's status page says (``None``: the page did not say).

    ``quorum_id``: the last quorum it issued (0: none yet, since it started);
    ``heartbeating``: replica groups whose heartbeats are recent (within its heartbeat timeout).
    ``beats``: each replica group the page lists under its heartbeats (its full replica id,
    torchft's ``name:uuid``) and whether its last heartbeat is recent; ``ages``: the same
    groups with the seconds since their last heartbeat, as the lighthouse measured them when
    it served the page. Neither is compared (two statuses are equal when their quorum id and
    count are).
    """

    quorum_id: int | None
    heartbeating: int | None
    beats: tuple[tuple[str, bool], ...] | None = field(default=None, compare=False)
    ages: tuple[tuple[str, float], ...] | None = field(default=None, compare=False)

    def hears_from(self, replica: str) -> bool | None:
        """Whether the lighthouse's last heartbeat from ``replica`` (a full replica id) is
        recent: False when it is older than the lighthouse's heartbeat timeout; None when the
        page does not list it (a lighthouse restarted since) or did not say."""
        for name, recent in self.beats or ():
            if name == replica:
                return recent
        return None


_QUORUM_ID = re.compile(r"Current quorum_id:\s*(\d+)")
_HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")
_PAGE_LIMIT = 1 << 20  # bytes of the status page read
_HEARTBEATS = "<h2>Heartbeats</h2>"  # the page's list: one item per replica group, "old" if late
_BEAT = re.compile(r'class="heartbeat\s*(old)?\s*">\s*(\S+?): seen(?:\s+([0-9.]+)s ago)?')


def lighthouse_status(address: str, timeout: float = 1.0) -> LighthouseStatus | None:
    """The status of the lighthouse at ``address`` (``http://host:port``), or ``None`` when
    nothing answers there within ``timeout`` seconds (it is gone, or never was).

    Reads torchft's dashboard (``GET /status``); a page in another format gives a status of
    ``None`` fields (answering, nothing known), never an error.
    """
    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout) as r:
            raw = r.read(_PAGE_LIMIT + 1)
    except urllib.error.HTTPError:
        return LighthouseStatus(None, None)  # something answers: not gone
    except (OSError, ValueError):
        return None
    page = raw[:_PAGE_LIMIT].decode("utf-8", "replace")
    qid, count = _QUORUM_ID.search(page), _HEARTBEATING.search(page)
    whole = len(raw) <= _PAGE_LIMIT  # a cut list would leave some replica groups out
    listed = page.partition(_HEARTBEATS)[2] if whole and _HEARTBEATS in page else None
    found = [] if listed is None else _BEAT.findall(listed)
    return LighthouseStatus(
        int(qid.group(1)) if qid else None,
        int(count.group(1)) if count else None,
        None if listed is None else tuple((n, not old) for old, n, _ in found),
        None if listed is None else tuple((n, float(age)) for _, n, age in found if age),
    )


class HeartbeatWatch(threading.Thread):
    """Measures, from the lighthouse's side, the longest silence of replica groups that were
    alive: the margin a ``heartbeat_timeout`` has against dropping a live but slow group.

    Reads :func:`lighthouse_status` every ``every`` seconds until :meth:`stop`. A group's
    heartbeat age that falls between two reads means a beat arrived: the age read before it
    is a silence the group survived (``longest_s``, the largest of them: a lower bound of its
    longest gap between beats), and that age plus the time between the two reads bounds the
    gap from above (``bound_s``). A group that never beats again (killed) does not count.
    A lighthouse's ``heartbeat_timeout`` drops a live group only if one of its gaps reaches
    it; a SIGSTOPped group's freeze counts as a gap too.
    """

    def __init__(self, address: str, every: float = 0.1) -> None:
        super().__init__(name="heartbeat-watch", daemon=True)
        self.address = checks.check_str("address", address)
        self.every = checks.check_seconds("every", every)
        self.longest_s = 0.0
        self.bound_s = 0.0
        self.reads = 0
        self.read_gap_s = 0.0  # the longest time between two reads (this process's delays)
        self._done = threading.Event()
        self._last: dict[str, tuple[float, float]] = {}  # group -> (its age, when read)
        self._read_at: float | None = None

    def run(self) -> None:
        while not self._done.wait(self.every):
            status = lighthouse_status(self.address, timeout=1.0)
            now = time.monotonic()
            if status is None or status.ages is None:
                continue  # gone (a scenario restarting it) or not said: next read
            self.reads += 1
            if self._read_at is not None:
                self.read_gap_s = max(self.read_gap_s, now - self._read_at)
            self._read_at = now
            seen = dict(status.ages)
            for name, age in seen.items():
                before = self._last.get(name)
                if before is not None and age < before[0]:  # a beat came since the last read
                    self.longest_s = max(self.longest_s, before[0])
                    self.bound_s = max(self.bound_s, before[0] + now - before[1])
                self._last[name] = (age, now)
            for name in set(self._last) - set(seen):  # a restarted lighthouse forgot it
                del self._last[name]

    def stop(self) -> dict[str, float | int]:
        """Stop reading; what was measured (seconds; ``reads``: status pages read)."""
        self._done.set()
        if self.is_alive():
            self.join(timeout=5)
        return {
            "longest_s": round(self.longest_s, 3),
            "bound_s": round(self.bound_s, 3),
            "read_gap_s": round(self.read_gap_s, 3),
            "reads": self.reads,
        }


def _ms(name: str, seconds: Any) -> int:
    return max(1, round(checks.check_seconds(name, seconds) * 1000))


class Lighthouse:
    """A torchft lighthouse running in this process until :meth:`close` (or ``with`` exits).

    Args:
        min_replicas: fewest replica groups a quorum may have (``>= 1``).
        host: the address replicas reach it at, and the one it binds (``"0.0.0.0"`` or
            ``"::"`` to listen on every interface; :attr:`address` then names ``advertise``).
        port: TCP port (0: a free one).
        heartbeat_timeout, join_timeout, quorum_tick: seconds, see the module docstring.
        advertise: the host name or address put in :attr:`address` (default ``host``, or this
            machine's host name when ``host`` listens everywhere).
    """

    def __init__(
        self,
        min_replicas: int = 1,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        heartbeat_timeout: float = 1.0,
        join_timeout: float = 10.0,
        quorum_tick: float = 0.05,
        advertise: str | None = None,
    ) -> None:
        min_replicas = checks.check_int("min_replicas", min_replicas, 1)
        host = checks.check_str("host", host)
        port = checks.check_int("port", port, 0)
        heartbeat_ms = _ms("heartbeat_timeout", heartbeat_timeout)
        join_ms = _ms("join_timeout", join_timeout)
        tick_ms = _ms("quorum_tick", quorum_tick)
        if advertise is not None:
            checks.check_str("advertise", advertise)
        coordination = require("torchft.coordination")
        bind_host = f"[{host}]" if ":" in host else host
        self._server = coordination.LighthouseServer(
            bind=f"{bind_host}:{port}",
            min_replicas=min_replicas,
            join_timeout_ms=join_ms,
            quorum_tick_ms=tick_ms,
            heartbeat_timeout_ms=heartbeat_ms,
        )
        self.min_replicas = min_replicas
        self.port = int(self._server.address().rsplit(":", 1)[1])
        if advertise is None:
            advertise = host if host not in ("0.0.0.0", "::") else _hostname()
        shown = f"[{advertise}]" if ":" in advertise else advertise
        self.address = f"http://{shown}:{self.port}"
        """What replicas pass as ``lighthouse_addr`` (or ``TORCHFT_LIGHTHOUSE``)."""

    def close(self) -> None:
        """Stop the server (replicas still asking for a quorum then fail their next one)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lighthouse({self.address!r}, min_replicas={self.min_replicas})"


def _hostname() -> str:
    import socket

    return socket.gethostname()


def serve(
    min_replicas: int,
    *,
    host: str = "0.0.0.0",
    port: int = 29510,
    heartbeat_timeout: float = 5.0,
    join_timeout: float = 60.0,
    quorum_tick: float = 0.1,
    advertise: str | None = None,
    stop: threading.Event | None = None,
    announce: Any = print,
) -> None:
    """Run a lighthouse until SIGINT/SIGTERM (or ``stop`` is set): ``distoptim lighthouse``.

    Defaults are torchft's own (port 29510, 5 s heartbeats, 60 s join timeout), suited to
    multi-node jobs; ``announce`` receives one line with the address replicas must use.
    """
    done = stop if stop is not None else threading.Event()
    previous: dict[int, Any] = {}
    if stop is None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: done.set())
    try:
        with Lighthouse(
            min_replicas,
            host=host,
            port=port,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            quorum_tick=quorum_tick,
            advertise=advertise,
        ) as lighthouse:
            announce(
                f"distoptim lighthouse: {lighthouse.address} (min_replicas={min_replicas}); "
                f"replicas use lighthouse_addr={lighthouse.address!r} or "
                f"TORCHFT_LIGHTHOUSE={lighthouse.address}. Ctrl-C stops it."
            )
            # in slices: a signal that lands on one of the server's threads only flags the
            # main thread's handler, which runs when the main thread next wakes up
            while not done.wait(0.25):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m distoptim.ft.lighthouse``: the same as ``distoptim lighthouse``."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="distoptim lighthouse",
        description="Run torchft's lighthouse (the quorum server of fault-tolerant replica "
        "groups) until Ctrl-C or SIGTERM. See docs/fault_tolerance.md.",
    )
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="fewest replica groups a quorum may have"
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default: all)")
    parser.add_argument("--port", type=int, default=29510, help="TCP port (default 29510)")
    parser.add_argument("--advertise", default=None, help="host name printed in the address")
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=5.0,
        help="seconds before a silent replica group is dead (default 5)",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=60.0,
        help="seconds a quorum waits for live replica groups that have not asked yet (default 60)",
    )
    args = parser.parse_args(argv)
    try:
        serve(
            args.min_replicas,
            host=args.host,
            port=args.port,
            heartbeat_timeout=args.heartbeat_timeout,
            join_timeout=args.join_timeout,
            advertise=args.advertise,
        )
    except (TypeError, ValueError, ImportError, RuntimeError) as exc:
        print(f"distoptim lighthouse: error: {exc}")
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised through a subprocess in the tests
    raise SystemExit(main())
