"""A shared-memory segment one p2p connection's two processes both map, when on one machine.

Owns: creating, attaching and laying out the segment that carries a connection's flat buffers
instead of the gloo pair (the header still goes over the pair, so ordering and timeouts stay
the pair's). This is what TensorPipe's shared-memory channels do for ``torch.distributed.rpc``
on one host; a message's bytes then cross the process boundary with one copy (or none, when
they were written in place) instead of a TCP loopback round.

Life of a segment
-----------------
1. The worker creates ``/dev/shm/distoptim-<pid>-<random>`` (mode 0600), reserves its pages
   with ``posix_fallocate`` (a full ``/dev/shm`` fails here, cleanly, instead of a ``SIGBUS``
   later), maps it and writes a random token at its start.
2. It sends the path, size and token (an ``Attach`` request); the shard opens and maps the same
   file and checks the token -- which proves that both see the same memory (same machine, same
   ``/dev/shm``); it answers ``Attached(ok)``.
3. The worker unlinks the path at once, attached or not: the mappings stay valid, and nothing is
   left behind when either process dies.

A connection carries one message at a time, so both directions use the segment from offset 0:
a request's buffers are read by the shard before it writes its reply there, and a reply's
buffers are valid for the worker until its next request on that connection (it copies what it
keeps). Buffers start at multiples of :data:`ALIGN` bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Iterable

import torch

__all__ = ["ALIGN", "Segment", "layout_offsets"]

ALIGN = 64
_TOKEN_BYTES = 16


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_offsets(nbytes: Iterable[int]) -> tuple[list[int], int]:
    """Where buffers of ``nbytes`` bytes each go in a segment (in order), and the bytes needed."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end = _aligned(end + n)
    return offsets, end


class Segment:
    """One mapped segment: ``data`` is a ``uint8`` tensor over all of it."""

    def __init__(self, path: str, nbytes: int, fd: int, token: bytes) -> None:
        self.path = path
        self.nbytes = nbytes
        self.token = token
        self._map = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, directory: str = "/dev/shm") -> Segment | None:
        """A new segment of at least ``nbytes`` (None when shared memory is not available)."""
        nbytes = max(_aligned(nbytes), ALIGN)
        path = os.path.join(directory, f"distoptim-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, nbytes)
            token = secrets.token_bytes(_TOKEN_BYTES)
            seg = cls(path, nbytes, fd, token)
        except OSError:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        seg.data[:_TOKEN_BYTES] = torch.frombuffer(bytearray(token), dtype=torch.uint8)
        return seg

    @classmethod
    def attach(cls, path: str, nbytes: int, token: bytes) -> Segment | None:
        """Map the peer's segment; None unless it exists here and shows the peer's token."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size < nbytes:
                raise OSError("segment smaller than announced")
            seg = cls(path, nbytes, fd, token)
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                os.close(fd)
            return None
        if bytes(seg.data[:_TOKEN_BYTES].numpy()) != token:
            return None
        return seg

    def unlink(self) -> None:
        """Remove the name (mappings stay valid)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def view(self, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D ``dtype`` tensor of ``numel`` elements at ``offset`` (shares the memory)."""
        size = torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + numel * size].view(dtype)

    def holds(self, t: torch.Tensor, offset: int) -> bool:
        """Whether ``t`` already is the view at ``offset`` (nothing to copy)."""
        return t.data_ptr() == self.data.data_ptr() + offset
