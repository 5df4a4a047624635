"""A shard's centers in memory its same-machine workers read in place (p2p).

Owns: where a shard keeps each table's center buffers when workers on its machine may read
them directly (:class:`SharedCenters`, the shard's side), how a worker maps them read-only
(:class:`MappedCenters`), and the reference a reply carries instead of the bytes
(:class:`RegionRef`).

Why: a commit's reply is the center after the commit, and the worker copies it into its
parameters. Without this, the shard first copies the center into the connection's shared
segment (:mod:`~distoptim.agn.transport.shm`) and the worker copies it from there: two passes
over the center where the worker's own copy is the only one needed. With it, the reply names
where the center lies in the shard's memory and the worker copies from there; the shard keeps
the table's read lock (no commit can change the center) until the worker says it is done
(the connection's release counter, :data:`~distoptim.agn.transport.shm.RELEASE`).

How: each table's center is one anonymous file (``memfd_create``) that the shard maps
read-write; a region starts with a random token, then the buffers at :data:`ALIGN`-byte
offsets. A worker on the same machine (its connection's segment is attached, which proves it)
opens ``/proc/<shard pid>/fd/<fd>`` read-only, maps it, and checks the token. Nothing has a
name, so nothing is left behind when either process ends. A worker that cannot map a region
(another machine, no ``/proc``, another user) says so on every request (``maps_regions``
false, :mod:`~distoptim.agn.transport.framing`) and gets replies copied, as before.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "ALIGN",
    "SHM_ENV",
    "SUPPORTED",
    "MappedCenters",
    "RegionRef",
    "SharedCenters",
    "shm_enabled",
]

ALIGN = 64
_TOKEN_BYTES = 16
SUPPORTED = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")
"""Whether this machine can share centers this way (Linux)."""

SHM_ENV = "DISTOPTIM_AGN_SHM"
"""``0``: no shared memory at all on this process's connections (segments nor centers)."""


def shm_enabled() -> bool:
    """Whether shared memory may be used here (:data:`SUPPORTED`; not ``DISTOPTIM_AGN_SHM=0``)."""
    return SUPPORTED and os.environ.get(SHM_ENV, "1") != "0"


@dataclass(frozen=True)
class RegionRef:
    """Where a region is: the shard's ``pid`` and the ``fd`` of its file there, its size, and
    the token at its start (which a mapping must show)."""

    pid: int
    fd: int
    nbytes: int
    token: bytes

    def __reduce__(self) -> tuple:  # compact in a message header: no field names
        return (RegionRef, (self.pid, self.fd, self.nbytes, self.token))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Region:
    """One mapped region (either side): ``data`` is a ``uint8`` tensor over all of it."""

    def __init__(self, ref: RegionRef, mapping: mmap.mmap) -> None:
        self.ref = ref
        self._map = mapping
        with warnings.catch_warnings():  # a read-only mapping: torch warns it is not writable
            warnings.simplefilter("ignore", UserWarning)
            self.data = torch.frombuffer(mapping, dtype=torch.uint8)

    def view(self, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + numel * size].view(dtype)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The offset of ``t`` if it lies wholly in this region (contiguous), else None."""
        start = t.data_ptr() - self.data.data_ptr()
        size = t.numel() * t.element_size()
        if start >= 0 and start + size <= self.ref.nbytes and t.is_contiguous():
            return start
        return None


class SharedCenters:
    """The shard's side: :meth:`allocate` puts a table's center in a new region;
    :meth:`locate` tells where a tensor lies (for a reply's reference)."""

    def __init__(self) -> None:
        self._regions: list[_Region] = []
        self._lock = threading.Lock()
        self._probe: RegionRef | None = None

    def probe(self) -> RegionRef:
        """A small region a worker maps once, when it connects, to learn whether it can."""
        with self._lock:
            probe = self._probe
        if probe is None:
            self.allocate({"probe": torch.zeros(1)})
            with self._lock:
                probe = self._probe = self._regions[-1].ref
        return probe

    def allocate(self, flats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Buffers holding ``flats`` (copied) in a new region."""
        offsets, end = [], _aligned(_TOKEN_BYTES)
        for t in flats.values():
            offsets.append(end)
            end = _aligned(end + t.numel() * t.element_size())
        fd = os.memfd_create("distoptim-center", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, end)
            mapping = mmap.mmap(fd, end)
        except OSError:
            os.close(fd)
            raise
        token = os.urandom(_TOKEN_BYTES)
        region = _Region(RegionRef(os.getpid(), fd, end, token), mapping)
        region.data[:_TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        out = {}
        for (key, t), off in zip(flats.items(), offsets):
            out[key] = region.view(off, t.dtype, t.numel())
            out[key].copy_(t.detach().reshape(-1))
        with self._lock:
            self._regions.append(region)
        return out

    def locate(self, t: torch.Tensor) -> tuple[RegionRef, int] | None:
        """``(region, offset)`` of ``t`` if it lies in one of these regions, else None."""
        with self._lock:
            regions = list(self._regions)
        for r in regions:
            off = r.offset_of(t)
            if off is not None:
                return r.ref, off
        return None


class MappedCenters:
    """The worker's side: regions of its shards, mapped read-only on first use."""

    def __init__(self) -> None:
        self._regions: dict[RegionRef, _Region] = {}

    @staticmethod
    def can_map(ref: RegionRef) -> bool:
        """Whether ``ref`` can be mapped from here (tried once, when a connection starts)."""
        try:
            MappedCenters._map(ref)
        except OSError:
            return False
        return True

    @staticmethod
    def _map(ref: RegionRef) -> _Region:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < ref.nbytes:
                raise OSError("region smaller than announced")
            mapping = mmap.mmap(fd, ref.nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        region = _Region(ref, mapping)
        if bytes(region.data[:_TOKEN_BYTES].numpy()) != ref.token:
            raise OSError("the region does not show its token (another process's file?)")
        return region

    def view(self, ref: RegionRef, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A read-only view of ``numel`` elements at ``offset`` of region ``ref``."""
        region = self._regions.get(ref)
        if region is None:
            region = self._regions[ref] = self._map(ref)
        return region.view(offset, dtype, numel)

    def forget(self, pid: int) -> None:
        """Unmap the regions of the shard process ``pid`` (it restarted or is gone)."""
        for ref in [r for r in self._regions if r.pid == pid]:
            with contextlib.suppress(Exception):
                del self._regions[ref]
