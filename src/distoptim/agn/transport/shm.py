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

Layout: a control page, then a **request region** (the worker writes requests' buffers there)
and a **reply region** (the shard writes replies' buffers there), each large enough for one
message. A connection carries one request and its reply at a time, so a region holds one
message; a reply's buffers are valid for the worker until its next request on that connection
(it copies what it keeps), and the worker may write its next payload while it still reads the
last reply. Buffers start at multiples of :data:`ALIGN` bytes; a buffer that is already
anywhere in the segment travels as its offset (no copy).

Progress counters (streamed messages)
-------------------------------------
The control page holds two 32-bit counters, :data:`REQUEST_PROGRESS` (written by the worker)
and :data:`REPLY_PROGRESS` (written by the shard). They count the chunks of streamed messages
(:mod:`distoptim.agn.flat`) made final so far, cumulatively over the connection's life (modulo
2**32): a writer writes a chunk's bytes, then stores the new count (:meth:`Progress.publish`);
a reader waits until the count reaches the chunk's number, then reads its bytes
(:meth:`Progress.wait`). Ordering rests on x86-64's store ordering (a store is never seen before
an earlier one; loads are not reordered with loads), so counters are only used there
(:data:`PROGRESS_SUPPORTED`; elsewhere messages are not streamed in shared memory). A wait
spins briefly, then sleeps in ``futex(FUTEX_WAIT)`` on the counter (woken by the writer's
``FUTEX_WAKE``, the only private system interface here, behind :func:`_futex`), in slices of
:data:`PROBE_S` between which it asks the caller whether the peer is still there; it is bounded
by a deadline.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable, Iterable

import torch

__all__ = [
    "ALIGN",
    "CONTROL_BYTES",
    "PROBE_S",
    "PROGRESS_SUPPORTED",
    "REPLY_PROGRESS",
    "RELEASE",
    "REQUEST_PROGRESS",
    "VERDICT",
    "Progress",
    "Segment",
    "layout_offsets",
]

ALIGN = 64
_TOKEN_BYTES = 16
REQUEST_PROGRESS = 64
"""Byte offset of the worker's chunk counter in the control page."""
REPLY_PROGRESS = 128
"""Byte offset of the shard's chunk counter in the control page."""
VERDICT = 192
"""Byte offset of the worker's verdict on its streamed commit (written before the counter step
that announces it, :data:`~distoptim.agn.transport.framing.VERDICT_CODES`)."""
RELEASE = 256
"""Byte offset of the worker's release counter: how many replies read in place from the shard's
memory it is done with (:mod:`~distoptim.agn.transport.shared_center`)."""
CONTROL_BYTES = 4096
"""The control page, before the request region."""
PROBE_S = 0.05
"""Longest sleep of a counter wait between two checks that the peer is still there."""
_SPINS = 64

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): two processes map the page
PROGRESS_SUPPORTED = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
"""Whether progress counters work on this machine (see the module docstring)."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_libc = ctypes.CDLL(None, use_errno=True) if PROGRESS_SUPPORTED else None


def _futex(addr: int, op: int, value: int, timeout_s: float | None = None) -> int:
    """``futex(2)`` on the 32-bit word at ``addr`` (the GIL is released meanwhile): with
    ``_FUTEX_WAIT``, sleep while the word equals ``value`` (at most ``timeout_s``); with
    ``_FUTEX_WAKE``, wake up to ``value`` sleepers. Returns the system call's result."""
    assert _libc is not None
    ts = None
    if timeout_s is not None:
        sec = int(timeout_s)
        ts = ctypes.byref(_Timespec(sec, int((timeout_s - sec) * 1e9)))
    return _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(addr), op, value, ts, None, 0)


class Progress:
    """One chunk counter in a segment's control page (see the module docstring)."""

    def __init__(self, word: ctypes.c_int32) -> None:
        self._word = word
        self._addr = ctypes.addressof(word)

    @property
    def value(self) -> int:
        """The count now (modulo 2**32, as a signed 32-bit value)."""
        return self._word.value

    @staticmethod
    def _reached(value: int, target: int) -> bool:
        return ((value - target + (1 << 31)) & 0xFFFFFFFF) >= (1 << 31)

    def publish(self, count: int) -> None:
        """Store ``count`` (after the chunk's bytes) and wake the reader."""
        self._word.value = ((count + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)
        _futex(self._addr, _FUTEX_WAKE, 1 << 30)

    def wait(self, count: int, deadline: float, probe: Callable[[], None]) -> None:
        """Return once the counter reached ``count`` (modulo 2**32); ``probe()`` is called
        between sleeps (it raises when the peer is gone); ``TimeoutError`` at ``deadline``
        (``time.monotonic()``)."""
        for _ in range(_SPINS):
            if self._reached(self._word.value, count):
                return
        while True:
            seen = self._word.value
            if self._reached(seen, count):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"the peer did not announce chunk {count & 0xFFFFFFFF} in time (at "
                    f"{seen & 0xFFFFFFFF})"
                )
            _futex(self._addr, _FUTEX_WAIT, seen, min(left, PROBE_S))
            if not self._reached(self._word.value, count):
                probe()


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_offsets(nbytes: Iterable[int]) -> tuple[list[int], int]:
    """Where buffers of ``nbytes`` bytes each go in a segment (in order), and the bytes needed."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end = _aligned(end + n)
    return offsets, end


def segment_bytes(message_bytes: int) -> int:
    """The size of a segment whose regions each hold ``message_bytes``."""
    return CONTROL_BYTES + 2 * max(_aligned(message_bytes), ALIGN)


class Segment:
    """One mapped segment: ``data`` is a ``uint8`` tensor over all of it; requests' buffers go
    at ``request_base``, replies' at ``reply_base``, each region ``message_bytes`` long."""

    def __init__(self, path: str, nbytes: int, fd: int, token: bytes) -> None:
        self.path = path
        self.nbytes = nbytes
        self.token = token
        self._map = mmap.mmap(fd, nbytes)
        os.close(fd)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)
        self.message_bytes = (nbytes - CONTROL_BYTES) // 2 // ALIGN * ALIGN
        self.request_base = CONTROL_BYTES
        self.reply_base = CONTROL_BYTES + self.message_bytes
        self.request_progress = Progress(ctypes.c_int32.from_buffer(self._map, REQUEST_PROGRESS))
        self.reply_progress = Progress(ctypes.c_int32.from_buffer(self._map, REPLY_PROGRESS))
        self.verdict = ctypes.c_int32.from_buffer(self._map, VERDICT)
        self.release = Progress(ctypes.c_int32.from_buffer(self._map, RELEASE))

    @classmethod
    def create(cls, message_bytes: int, directory: str = "/dev/shm") -> Segment | None:
        """A new segment whose regions hold ``message_bytes`` each (None when shared memory is
        not available)."""
        nbytes = segment_bytes(message_bytes)
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

    def region(self, reply: bool) -> int:
        """Where a message's buffers start: the reply region or the request region."""
        return self.reply_base if reply else self.request_base

    def place(self, nbytes: Iterable[int], reply: bool) -> list[int] | None:
        """Offsets for buffers of ``nbytes`` bytes in a region (None: they do not fit)."""
        offsets, need = layout_offsets(nbytes)
        if need > self.message_bytes:
            return None
        base = self.region(reply)
        return [base + o for o in offsets]

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

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The offset of ``t`` if it lies wholly in this segment (contiguous), else None."""
        start = t.data_ptr() - self.data.data_ptr()
        size = t.numel() * t.element_size()
        if start >= 0 and start + size <= self.nbytes and t.is_contiguous():
            return start
        return None
