"""The p2p framing: how one typed message travels over a 2-rank process group (header, metadata,
flat buffers).

Owns: the byte layout of a message on a p2p connection, both directions. A message is sent as

1. a **fixed-size header**: a ``uint8`` tensor of :data:`HEADER_BYTES` bytes. Its first eight
   little-endian ``int64`` words are ``[MAGIC, meta_nbytes, n_buffers, 0, 0, 0, 0, 0]``; the
   rest holds the metadata when it fits (:data:`INLINE_META` bytes, the common case);
2. the **metadata**, only when it did not fit: a ``uint8`` tensor of ``meta_nbytes`` bytes. The
   metadata is the pickled :class:`_Envelope`: the message with its ``flats`` left out, and one
   :class:`BufferSpec` (key, dtype, element count, offset) per buffer;
3. the **flat buffers**, one ``send`` each (tag ``1 + i`` for the ``i``-th), in the order of the
   specs -- unless they travel in the connection's shared-memory segment
   (:mod:`~distoptim.agn.transport.shm`): then every spec has the buffer's ``offset`` there and
   nothing follows on the pair.

The header and metadata use tag 0; gloo keeps their order on a pair. The receiver allocates
(or reuses, or views in the segment) each buffer from its spec, so a message is self-describing
and the receiver checks it against what it expects (the shard against the table's layout).

A **streamed** message (a commit, :mod:`distoptim.agn.transport.base`) says so in its metadata
(:class:`StreamInfo`: the chunk size of the plan, :func:`~distoptim.agn.flat.chunk_ranges` of
its specs, and where the sender's progress counter starts). Its buffers then follow chunk by
chunk: on the pair, chunk ``k`` is one ``send`` with tag ``1 + k`` (and the reply's chunk ``k``
comes back with tag ``1 + k``), then the worker's verdict (one ``int64``, tag ``1 + n`` for
``n`` chunks: :data:`VERDICT_CODES`); in the shared segment, each chunk is announced by the
progress counter and the verdict is a word of the control page.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Any

import torch

from distoptim.agn.transport.shared_center import RegionRef

__all__ = [
    "HEADER_BYTES",
    "INLINE_META",
    "MAGIC",
    "Place",
    "VERDICT_CODES",
    "BufferSpec",
    "StreamInfo",
    "FramingError",
    "decode_header",
    "encode",
    "finish_decode",
]

HEADER_BYTES = 512
_WORDS = 8
INLINE_META = HEADER_BYTES - 8 * _WORDS
MAGIC = 0x314E4741  # "AGN1"
VERDICT_CODES = {"ok": 1, "refuse": 2, "abort": 3}
"""How a verdict travels (0 never does: a word not written yet)."""


class FramingError(RuntimeError):
    """A message that does not follow this layout (a peer speaking something else)."""


@dataclass(frozen=True)
class BufferSpec:
    """One flat buffer of a message: its key in ``flats``, dtype, element count, and its offset
    in the shared segment (``-1``: it follows on the pair) -- or, with ``region``, in that
    region of the shard's memory (a reply read in place,
    :mod:`~distoptim.agn.transport.shared_center`)."""

    key: str
    dtype: torch.dtype
    numel: int
    offset: int = -1
    region: RegionRef | None = None


Place = int | tuple[RegionRef, int]
"""Where a buffer travels: an offset in the connection's segment (-1: on the pair), or
``(region, offset)`` in the shard's memory."""


@dataclass(frozen=True)
class StreamInfo:
    """A streamed message: its chunk plan's ``chunk_bytes``, and the sender's progress counter
    before its first chunk (shared segment only; 0 on the pair)."""

    chunk_bytes: int
    base: int = 0


@dataclass
class _Envelope:
    message: Any  # the message, flats left out
    buffers: list[BufferSpec]
    stream: StreamInfo | None = None


def encode(
    message: Any, offsets: list[Place] | None = None, stream: StreamInfo | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """``(header, metadata or None, buffers to send on the pair)`` for ``message``.

    ``offsets``: where the caller placed each of ``message.flats`` in the shared segment (then
    no buffer goes on the pair), or None. ``stream``: the buffers follow chunk by chunk (none is
    returned to send whole).
    """
    flats = getattr(message, "flats", None) or {}
    where: list[Place] = offsets if offsets is not None else [-1] * len(flats)
    specs = [
        BufferSpec(k, t.dtype, t.numel(), o[1], o[0])
        if isinstance(o, tuple)
        else BufferSpec(k, t.dtype, t.numel(), o)
        for (k, t), o in zip(flats.items(), where)
    ]
    bare = replace(message, flats={}) if flats else message
    meta = pickle.dumps(_Envelope(bare, specs, stream), protocol=pickle.HIGHEST_PROTOCOL)
    header = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    words = header[: 8 * _WORDS].view(torch.int64)
    words[0], words[1], words[2] = MAGIC, len(meta), len(specs)
    extra = None
    if len(meta) <= INLINE_META:
        header[8 * _WORDS : 8 * _WORDS + len(meta)] = torch.frombuffer(
            bytearray(meta), dtype=torch.uint8
        )
    else:
        extra = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    buffers = []
    for t in flats.values():
        if not t.is_contiguous() or t.dim() != 1:
            raise FramingError("flat buffers must be contiguous 1-D tensors")
        if offsets is None and stream is None:
            buffers.append(t)
    return header, extra, buffers


def decode_header(header: torch.Tensor) -> tuple[int, bytes | None]:
    """``(meta_nbytes, inline metadata or None)``; raises :class:`FramingError` on a bad header."""
    words = header[: 8 * _WORDS].view(torch.int64)
    if int(words[0]) != MAGIC:
        raise FramingError(f"bad message header (magic {int(words[0]):#x}, expected {MAGIC:#x})")
    n = int(words[1])
    if n <= INLINE_META:
        return n, bytes(header[8 * _WORDS : 8 * _WORDS + n].numpy())
    return n, None


def finish_decode(meta: bytes) -> tuple[Any, list[BufferSpec], StreamInfo | None]:
    """The message (``flats`` still empty), the specs of the buffers that follow, and how they
    are streamed (None: whole)."""
    envelope = pickle.loads(meta)
    if not isinstance(envelope, _Envelope):
        raise FramingError(f"bad message metadata ({type(envelope).__name__})")
    return envelope.message, envelope.buffers, envelope.stream
