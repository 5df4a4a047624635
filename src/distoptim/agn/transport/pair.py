"""One p2p connection's 2-rank gloo pair: framed messages, their buffers, a streamed commit.

Owns: ``_Pipe`` (sending and receiving one framed message on the pair, or through its shared
segment, within a deadline, reusing the receive buffers), the views of a message's flat
buffers, and ``_PipeInflow``, a streamed commit arriving chunk by chunk on the shard. The
protocol is in :mod:`distoptim.agn.transport.p2p`'s docstring.
"""

from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distoptim.agn.flat import chunk_ranges
from distoptim.agn.transport import framing
from distoptim.agn.transport.base import (
    Inflow,
)
from distoptim.agn.transport.shared_center import MappedCenters, SharedCenters
from distoptim.agn.transport.shm import Segment


def _store(addr: str, port: int, namespace: str, timeout: float) -> dist.Store:
    """A fresh store client (blocking waits hold a client's socket: one client per waiter)."""
    base = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(namespace, base)


def _seconds(deadline: float) -> timedelta:
    return timedelta(seconds=max(0.001, deadline - time.monotonic()))


class _Idle(TimeoutError):
    """No message began to arrive by the deadline (the peer sent nothing: it is idle)."""


class _Pipe:
    """One end of a connection: a 2-rank gloo group, typed messages in both directions, and
    (same machine) the shared segment the flat buffers travel in. ``replies``: this end sends
    replies (the shard's end), so its buffers go to the segment's reply region."""

    def __init__(self, pg: dist.ProcessGroup, peer: int, replies: bool) -> None:
        self.pg = pg
        self.peer = peer
        self.replies = replies
        self.segment: Segment | None = None
        self.announced = 0  # chunks this end announced on its segment progress counter
        # replies read in place (shared_center): the shard's centers, when its peer maps them;
        # the worker's mapped regions; the release count; a reply read in place, unreleased
        self.centers: SharedCenters | None = None
        self.mapped: MappedCenters | None = None
        self.released = 0
        self.unreleased = False

    def place(
        self, flats: dict[str, torch.Tensor], in_place: bool = False
    ) -> list[framing.Place] | None:
        """Where ``flats`` travel: with ``in_place``, in the shard's center regions when they
        all lie there (and the peer maps them); else offsets in the segment, where they already
        are or in this end's region (None: no segment, or they do not fit)."""
        if in_place and self.centers is not None and flats:
            found = [self.centers.locate(t) for t in flats.values()]
            if all(f is not None for f in found):
                return found  # type: ignore[return-value]
        seg = self.segment
        if seg is None or not flats:
            return None
        placed = seg.place([t.numel() * t.element_size() for t in flats.values()], self.replies)
        if placed is None:
            return None
        return [
            where if (where := seg.offset_of(t)) is not None else at
            for t, at in zip(flats.values(), placed)
        ]

    def send(
        self,
        message: Any,
        stream: framing.StreamInfo | None = None,
        copy: bool = True,
        in_place: bool = False,
    ) -> tuple[list[Any], bool]:
        """Start sending ``message``: ``(works, read_in_place)``; the works must be waited, and
        a message read in place must be released by the peer (:meth:`wait_released`).
        ``stream``: only the header goes now (the buffers follow chunk by chunk); ``copy``: put
        buffers that are not in the segment there now (else the caller does, chunk by chunk);
        ``in_place``: the buffers may be read where they are (:meth:`place`)."""
        flats = getattr(message, "flats", None) or {}
        offsets = self.place(flats, in_place)
        shared = offsets is not None and any(isinstance(o, tuple) for o in offsets)
        if offsets is not None and copy and not shared:
            seg = self.segment
            assert seg is not None
            for t, off in zip(flats.values(), offsets):
                assert isinstance(off, int)
                if not seg.holds(t, off):
                    seg.view(off, t.dtype, t.numel()).copy_(t)
        header, extra, buffers = framing.encode(message, offsets, stream)
        works = [self.pg.send([header], self.peer, 0)]
        if extra is not None:
            works.append(self.pg.send([extra], self.peer, 0))
        for i, buf in enumerate(buffers):
            works.append(self.pg.send([buf], self.peer, 1 + i))
        return works, shared

    def post(self) -> tuple[torch.Tensor, Any]:
        """Start receiving the next message's header: ``(header, work)`` for :meth:`recv`
        (``work.is_completed()`` tells whether a message began to arrive)."""
        header = torch.empty(framing.HEADER_BYTES, dtype=torch.uint8)
        return header, self.pg.recv([header], self.peer, 0)

    def release(self) -> None:
        """Worker: done with the last reply read in place (the shard may change it again)."""
        if self.unreleased and self.segment is not None:
            self.unreleased = False
            self.released += 1
            self.segment.release.publish(self.released)

    def wait_released(self, deadline: float, probe: Any) -> None:
        """Shard: wait (bounded, ``probe`` between sleeps) until the worker released the reply
        it reads in place."""
        assert self.segment is not None
        self.released += 1
        self.segment.release.wait(self.released, deadline, probe)

    def recv(
        self,
        deadline: float,
        into: dict[str, torch.Tensor] | None = None,
        pool: dict[framing.BufferSpec, torch.Tensor] | None = None,
        idle: bool = False,
        posted: tuple[torch.Tensor, Any] | None = None,
    ) -> tuple[Any, list[framing.BufferSpec], framing.StreamInfo | None]:
        """Receive one message by ``deadline`` (``time.monotonic()``): ``(message, its buffer
        specs, its stream info)``. Buffers in the shared segment are views of it (valid until
        the next message); the others are received into ``into`` where key, dtype and size
        match, else into ``pool``'s (reused), else new ones. A streamed message's ``flats`` are
        where its chunks will arrive (nothing is received yet: see :class:`_PipeInflow`).
        ``idle``: a message that did not begin by ``deadline`` raises :class:`_Idle`.
        ``posted``: the header's receive, started earlier (:meth:`post`)."""
        header, work = posted if posted is not None else self.post()
        try:
            work.wait(_seconds(deadline))
        except RuntimeError as exc:
            if idle and "Timed out" in str(exc):
                raise _Idle(str(exc)) from exc
            raise
        n, meta = framing.decode_header(header)
        if meta is None:
            extra = torch.empty(n, dtype=torch.uint8)
            self.pg.recv([extra], self.peer, 0).wait(_seconds(deadline))
            meta = bytes(extra.numpy())
        message, specs, stream = framing.finish_decode(meta)
        if not specs:
            return message, specs, stream
        flats: dict[str, torch.Tensor] = {}
        works = []
        for i, spec in enumerate(specs):
            if spec.region is not None:  # the shard's own memory, read in place (released)
                if self.mapped is None:
                    raise framing.FramingError("a buffer in place, but no region can be mapped")
                flats[spec.key] = self.mapped.view(spec.region, spec.offset, spec.dtype, spec.numel)
                self.unreleased = True
                continue
            if spec.offset >= 0:
                if self.segment is None:
                    raise framing.FramingError(
                        "a buffer in shared memory, but no segment is attached"
                    )
                flats[spec.key] = self.segment.view(spec.offset, spec.dtype, spec.numel)
                continue
            buf = self._buffer(spec, into, pool)
            if stream is None:
                works.append(self.pg.recv([buf], self.peer, 1 + i))
            flats[spec.key] = buf
        for w in works:
            w.wait(_seconds(deadline))
        message.flats = flats
        return message, specs, stream

    @staticmethod
    def _buffer(
        spec: framing.BufferSpec,
        into: dict[str, torch.Tensor] | None,
        pool: dict[framing.BufferSpec, torch.Tensor] | None,
    ) -> torch.Tensor:
        t = None if into is None else into.get(spec.key)
        if t is not None and t.dtype == spec.dtype and t.numel() == spec.numel:
            return t
        if pool is not None:
            t = pool.get(spec)
            if t is None:
                t = pool[spec] = torch.empty(spec.numel, dtype=spec.dtype)
            return t
        return torch.empty(spec.numel, dtype=spec.dtype)

    def close(self) -> None:
        self.segment = None
        with contextlib.suppress(Exception):
            self.pg.shutdown()


def _views(
    flats: dict[str, torch.Tensor], ranges: list[tuple[str, int, int]]
) -> list[torch.Tensor]:
    return [flats[key][a:b] for key, a, b in ranges]


def _seg_views(
    seg: Segment, specs: list[framing.BufferSpec], reply: bool
) -> dict[str, torch.Tensor]:
    """The views of a message with ``specs`` laid out in a region of ``seg``."""
    placed = seg.place([s.numel * s.dtype.itemsize for s in specs], reply)
    if placed is None:
        raise framing.FramingError("a streamed message that does not fit the shared segment")
    return {s.key: seg.view(o, s.dtype, s.numel) for s, o in zip(specs, placed)}


class _PipeInflow(Inflow):
    """The shard's end of a streamed commit on a connection (see the module docstring)."""

    def __init__(
        self,
        pipe: _Pipe,
        specs: list[framing.BufferSpec],
        flats: dict[str, torch.Tensor],
        info: framing.StreamInfo,
        deadline: float,
        probe: Any,
    ) -> None:
        self._pipe = pipe
        self._deadline = deadline
        self._probe = probe
        self._ranges = chunk_ranges([(s.key, s.dtype, s.numel) for s in specs], info.chunk_bytes)
        self._n = len(self._ranges)
        self._payload = _views(flats, self._ranges)
        self._base = info.base
        self._waited = self._published = 0
        self._verdict: str | None = None
        self._sends: list[Any] = []
        self._seg = pipe.segment if specs and specs[0].offset >= 0 else None
        if self._seg is not None:
            self.live = False
            self._reply: dict[str, torch.Tensor] | None = _seg_views(self._seg, specs, True)
            self._reply_views = _views(self._reply, self._ranges)
            self._recvs: list[Any] = []
        else:
            self.live = True
            self._reply = None
            self._recvs = [pipe.pg.recv([v], pipe.peer, 1 + k) for k, v in enumerate(self._payload)]
            self._code = torch.zeros(1, dtype=torch.int64)
            self._recvs.append(pipe.pg.recv([self._code], pipe.peer, 1 + self._n))

    def wait(self, chunk: int) -> None:
        while self._waited <= chunk:
            k = self._waited
            if self._seg is not None:
                self._seg.request_progress.wait(self._base + k + 1, self._deadline, self._probe)
            else:
                self._recvs[k].wait(_seconds(self._deadline))
            self._waited += 1

    def reply_buffers(self) -> dict[str, torch.Tensor] | None:
        return self._reply

    def publish(self, chunk: int, data: torch.Tensor) -> None:
        if chunk != self._published:
            raise RuntimeError(f"reply chunk {chunk} published out of order")
        pipe = self._pipe
        if self._seg is not None:
            pipe.announced += 1
            self._seg.reply_progress.publish(pipe.announced)
        else:
            self._sends.append(pipe.pg.send([data], pipe.peer, 1 + chunk))
        self._published += 1

    def verdict(self) -> str:
        if self._verdict is None:
            self.wait(self._n - 1)
            if self._seg is not None:
                self._seg.request_progress.wait(
                    self._base + self._n + 1, self._deadline, self._probe
                )
                code = self._seg.verdict.value
            else:
                self._recvs[self._n].wait(_seconds(self._deadline))
                code = int(self._code)
            words = {c: w for w, c in framing.VERDICT_CODES.items()}
            if code not in words:
                raise framing.FramingError(f"bad verdict code {code} on a streamed commit")
            self._verdict = words[code]
        return self._verdict

    def finish(self) -> None:
        """Take what the handler did not (an error): every chunk, the verdict, and publish the
        remaining reply chunks, so the connection stays in step."""
        self.wait(self._n - 1)
        self.verdict()
        source = self._reply_views if self._seg is not None else self._payload
        for k in range(self._published, self._n):
            self.publish(k, source[k])

    def wait_sent(self, deadline: float) -> None:
        _wait_all(self._sends, deadline)


def _wait_all(works: list[Any], deadline: float) -> None:
    for w in works:
        w.wait(_seconds(deadline))
