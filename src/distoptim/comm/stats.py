"""Communication counters of one optimizer: what it launched and what it put on the wire.

Owns the one place where a collective's bytes are accounted: :meth:`CommStats.send` pays the
emulated link (:func:`distoptim.comm.link.transmit`) and counts the collective and its bytes,
so what ``comm_stats`` reports is exactly what an emulated slow link charged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from distoptim.comm import link

__all__ = ["CommStats", "ring_allreduce_bytes", "ring_half_bytes"]


def ring_allreduce_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: ``2 (n - 1) / n * nbytes``.

    A reduce-scatter then an all-gather, each moving ``(n - 1)`` chunks of ``nbytes / n``.
    This is the bandwidth-optimal cost every backend approaches for large messages; it is the
    figure reported in :class:`CommStats` and paid on an emulated link.
    """
    if group_size <= 1:
        return 0
    return (2 * (group_size - 1) * nbytes) // group_size


def ring_half_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring reduce-scatter (or all-gather) of ``nbytes``.

    ``(n - 1) / n * nbytes``: half of :func:`ring_allreduce_bytes` -- weight-update sharding's
    reduce-scatter of the gradients plus all-gather of the parameters move what one all-reduce
    of the gradients moves.
    """
    if group_size <= 1:
        return 0
    return ((group_size - 1) * nbytes) // group_size


@dataclass
class CommStats:
    """Running totals since construction (this rank only).

    * ``collectives``: collectives launched (bucket all-reduces, plus the one-time fingerprint
      and, with overlap, ready-order agreement per parameter list).
    * ``bytes_sent``: bytes this rank put on the wire (ring model, wire dtype).
    * ``overlapped``: bucket all-reduces launched while backward still had gradients to
      produce, i.e. really overlapped with computation (0 without ``overlap=True``).
    * ``repeated_rounds``: rounds reduced a second time, on every rank at once, because some
      rank edited ``.grad`` after backward had launched its buckets, or the parameter list
      changed (their collectives are in ``collectives`` too).
    """

    collectives: int = 0
    bytes_sent: int = 0
    overlapped: int = 0
    repeated_rounds: int = 0

    def send(self, nbytes: int, collectives: int = 1) -> None:
        """Account ``collectives`` launched collectives putting ``nbytes`` on the wire (this rank).

        Pays the emulated link first (a no-op unless one is configured), then counts.
        """
        link.transmit(nbytes)
        self.collectives += collectives
        self.bytes_sent += nbytes

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
