"""Link emulation: make one machine's loopback behave like a slower network, for experiments.

Owns: the emulated link model and the single call every transport makes at its boundary,
:func:`transmit`. With no link configured (the default) :func:`transmit` returns at once, so the
library's normal path pays one attribute check per message and nothing else.

Model: a message of ``n`` bytes costs ``latency_ms / 1000 + 8 n / (mbps · 10⁶)`` seconds, paid
by the sender before it hands the message to the real transport, in each direction (a round
trip of a request of ``a`` bytes and a reply of ``b`` bytes pays ``transmit(a)`` and
``transmit(b)``). Collectives call :func:`transmit` with the bytes each rank puts on the wire.

The link is configured per process with :func:`set_link`, or for whole process trees through
the ``DISTOPTIM_LINK`` environment variable (``"LATENCY_MS,MBPS"``, e.g. ``"5,100"``; an empty
MBPS means unlimited bandwidth), read on first use, so processes started by
``distoptim.launch`` inherit it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

__all__ = ["ENV_VAR", "Link", "get_link", "set_link", "transmit"]

ENV_VAR = "DISTOPTIM_LINK"


@dataclass(frozen=True)
class Link:
    """An emulated link: fixed ``latency_ms`` per message plus ``bytes / bandwidth``."""

    latency_ms: float = 0.0
    mbps: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_ms, (int, float)) and math.isfinite(self.latency_ms)):
            raise ValueError(f"latency_ms must be a finite number, got {self.latency_ms!r}")
        if self.latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {self.latency_ms}")
        if self.mbps is not None and not (
            isinstance(self.mbps, (int, float)) and math.isfinite(self.mbps) and self.mbps > 0
        ):
            raise ValueError(f"mbps must be a number > 0 or None (unlimited), got {self.mbps!r}")

    def delay_s(self, nbytes: int) -> float:
        """Seconds a message of ``nbytes`` spends on this link."""
        bandwidth = 0.0 if self.mbps is None else 8.0 * nbytes / (self.mbps * 1e6)
        return self.latency_ms / 1000.0 + bandwidth

    def to_env(self) -> str:
        return f"{self.latency_ms:g},{'' if self.mbps is None else f'{self.mbps:g}'}"

    @classmethod
    def from_env(cls, text: str) -> Link:
        parts = text.split(",")
        if len(parts) != 2:
            raise ValueError(
                f"{ENV_VAR} must be 'LATENCY_MS,MBPS' (MBPS may be empty), got {text!r}"
            )
        latency, mbps = parts
        return cls(float(latency or 0.0), float(mbps) if mbps.strip() else None)


_UNSET = object()
_active: object = _UNSET  # Link | None once resolved


def set_link(link: Link | None) -> None:
    """Emulate ``link`` in this process from now on (None: a real, undelayed transport)."""
    global _active
    if link is not None and not isinstance(link, Link):
        raise TypeError(
            f"link must be a distoptim.comm.link.Link or None, got {type(link).__name__}"
        )
    _active = link


def get_link() -> Link | None:
    """The link in force in this process (resolving ``DISTOPTIM_LINK`` on first use)."""
    global _active
    if _active is _UNSET:
        text = os.environ.get(ENV_VAR, "").strip()
        _active = Link.from_env(text) if text else None
    return _active  # type: ignore[return-value]


def transmit(nbytes: int) -> None:
    """Pay the emulated cost of sending ``nbytes`` (returns at once when no link is set)."""
    link = _active if _active is not _UNSET else get_link()
    if link is not None:
        delay = link.delay_s(nbytes)  # type: ignore[union-attr]
        if delay > 0:
            time.sleep(delay)  # emulates time on the wire; this is not synchronization
