"""Flat buffers: how the variables of one parameter-server shard travel and are stored.

Owns: :class:`FlatLayout`, the one description both sides of an RPC share of "the variables
this shard holds". A shard's variables are packed **one contiguous 1-D buffer per dtype**, in
parameter order within each dtype, so a commit or a pull is one message per shard whatever
the number of tensors, and TensorPipe moves each buffer as one block of bytes.

Invariants
----------
* ``views(flats)[i]`` is a view (shared storage) of the ``i``-th variable inside
  ``flats[dtype_key(var i)]`` with the variable's shape; writing a view writes the buffer.
* ``flatten(tensors)`` returns fresh buffers (never aliases its inputs).
* Two layouts built from the same ``(shape, dtype)`` list have equal :meth:`signature`; the server
  compares signatures to tell a worker that built a different model from the chief.

Chunks
------
A commit is applied **chunk by chunk** (:meth:`FlatLayout.chunks`): each buffer is cut into
consecutive ranges of at most ``chunk_bytes`` bytes, and the shard updates, checks and backs up
one chunk at a time (while it is in the cache). Streamed commits also travel that way, so a
shard can update chunk ``k`` while chunk ``k + 1`` is still arriving and a worker can take chunk
``k`` of the reply while the shard works on the next one; both ends then build the same plan
from the same layout and ``chunk_bytes`` (the shard's, told to each worker when it connects).
A chunk never spans two buffers; it is made of :class:`Piece` s, its intersections with the
variables, so that per-variable work (copying into a parameter, a server optimizer's state) can
follow it:

* the chunks of a buffer are disjoint and cover it in order; ``chunks[k].index == k``;
* each piece of a chunk lies in one variable, and the pieces of a chunk cover it in order;
* ``chunk.of(flats)`` and ``chunk.piece_views(flats)`` are views (shared storage).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Chunk",
    "FlatLayout",
    "Piece",
    "chunk_ranges",
    "dtype_key",
    "nbytes",
]

DEFAULT_CHUNK_BYTES = 4 << 20
"""The chunk size a shard applies (and, when asked, streams) commits in (4 MiB: a 19 MB payload
is 5 chunks. Measured for streamed commits with benchmarks/agn.py's round trip on the AGN
paper's 19.2 MB MLP, 2 loaded cores, commit/echo paired: 1 MiB chunks 2.7-3.9x over shared
memory and 1.24-1.34x over the gloo pair; 4 MiB 2.1-2.8x and 1.27x -- below 4 MiB the per-chunk
overhead, a server optimizer ``step()`` call and a progress signal, outweighs the overlap).
``DISTOPTIM_AGN_CHUNK_BYTES`` overrides it (read when a shard starts)."""


def dtype_key(dtype: torch.dtype) -> str:
    """The dictionary key of a dtype's buffer, e.g. ``"float32"``."""
    return str(dtype).removeprefix("torch.")


def nbytes(flats: Mapping[str, torch.Tensor]) -> int:
    """Payload bytes of a set of buffers (what goes on the wire, headers excluded)."""
    return sum(t.numel() * t.element_size() for t in flats.values())


@dataclass(frozen=True)
class _Slot:
    key: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """The part of variable ``var`` in one chunk: its elements ``[start, stop)`` (in the
    variable's flattened order), found at element ``offset`` of the chunk's buffer."""

    var: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Chunk:
    """Elements ``[start, stop)`` of buffer ``key``: the ``index``-th chunk of a layout's plan."""

    index: int
    key: str
    start: int
    stop: int
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def of(self, flats: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This chunk of ``flats`` (a 1-D view)."""
        return flats[self.key][self.start : self.stop]

    def piece_views(self, flats: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The 1-D views of ``flats`` this chunk's pieces occupy, in order."""
        buf = flats[self.key]
        return [buf[p.offset : p.offset + p.numel] for p in self.pieces]


def chunk_ranges(
    buffers: Sequence[tuple[str, torch.dtype, int]], chunk_bytes: int
) -> list[tuple[str, int, int]]:
    """``(key, start, stop)`` element ranges of at most ``chunk_bytes`` bytes (at least one
    element) covering buffers ``(key, dtype, numel)`` in order: the plan of
    :meth:`FlatLayout.chunks`, from the buffers alone (what a transport knows of a message)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    out = []
    for key, dtype, numel in buffers:
        step = max(1, chunk_bytes // torch.empty((), dtype=dtype).element_size())
        out.extend((key, a, min(a + step, numel)) for a in range(0, numel, step))
    return out


class FlatLayout:
    """Where each of a shard's variables sits inside its dtype's flat buffer.

    ``specs`` is the list of ``(shape, dtype)`` of the shard's variables, in parameter order.
    Buffer keys appear in first-use order of the dtypes.
    """

    def __init__(self, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> None:
        self._dtypes: dict[str, torch.dtype] = {}
        sizes: dict[str, int] = {}
        slots: list[_Slot] = []
        for shape, dtype in specs:
            key = dtype_key(dtype)
            self._dtypes.setdefault(key, dtype)
            shape_t = tuple(int(s) for s in shape)
            numel = 1
            for s in shape_t:
                numel *= s
            slots.append(_Slot(key, sizes.get(key, 0), numel, shape_t))
            sizes[key] = sizes.get(key, 0) + numel
        self._slots = slots
        self.sizes: dict[str, int] = sizes

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def keys(self) -> list[str]:
        return list(self.sizes)

    def signature(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """``((dtype_key, shape), ...)``: equal for equal models."""
        return tuple((s.key, s.shape) for s in self._slots)

    def numel(self) -> int:
        return sum(self.sizes.values())

    def buffers(self) -> list[tuple[str, torch.dtype, int]]:
        """``(key, dtype, numel)`` of each flat buffer, in order."""
        return [(k, self._dtypes[k], n) for k, n in self.sizes.items()]

    def zeros(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        return {
            k: torch.zeros(n, dtype=self._dtypes[k], device=device) for k, n in self.sizes.items()
        }

    def views(self, flats: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Per-variable views into ``flats``, in variable order."""
        return [flats[s.key].narrow(0, s.offset, s.numel).view(s.shape) for s in self._slots]

    def flatten(self, tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Fresh buffers holding ``tensors`` (one per variable, in order), detached."""
        if len(tensors) != len(self._slots):
            raise ValueError(f"expected {len(self._slots)} tensors, got {len(tensors)}")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in self.sizes}
        for s, t in zip(self._slots, tensors):
            parts[s.key].append(t.detach().reshape(-1))
        return {k: torch.cat(v) if len(v) > 1 else v[0].clone() for k, v in parts.items()}

    def chunks(self, chunk_bytes: int) -> list[Chunk]:
        """The chunk plan: every buffer cut into ranges of at most ``chunk_bytes`` bytes (at
        least one element each), in buffer order (see the module docstring)."""
        by_key: dict[str, list[tuple[int, _Slot]]] = {k: [] for k in self.sizes}
        for var, slot in enumerate(self._slots):
            by_key[slot.key].append((var, slot))
        out: list[Chunk] = []
        for key, start, stop in chunk_ranges(self.buffers(), chunk_bytes):
            pieces = []
            for var, slot in by_key[key]:
                lo, hi = max(start, slot.offset), min(stop, slot.offset + slot.numel)
                if hi > lo:
                    pieces.append(Piece(var, lo - slot.offset, hi - slot.offset, lo))
            out.append(Chunk(len(out), key, start, stop, tuple(pieces)))
        return out

    def check(self, flats: object, what: str) -> None:
        """Raise ``ValueError`` unless ``flats`` has exactly this layout's buffers."""
        if not isinstance(flats, Mapping):
            raise TypeError(f"{what} must be a dict of flat buffers, got {type(flats).__name__}")
        if set(flats) != set(self.sizes):
            raise ValueError(
                f"{what} has buffers {sorted(flats)}, this shard holds {sorted(self.sizes)}"
            )
        for k, n in self.sizes.items():
            t = flats[k]
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{what}[{k!r}] must be a 1-D tensor of {n} elements, got {got}")
            if dtype_key(t.dtype) != k:
                raise ValueError(f"{what}[{k!r}] has dtype {t.dtype}, expected {k}")
