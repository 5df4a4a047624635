"""Gradient buckets: which gradients travel together, and where each one sits in a flat buffer.

Owns the bucket *layout* (no communication): parameters are taken in the order their gradients
become ready during backward -- reverse registration order, DDP's default assumption -- and
grouped per ``(dtype, device)`` into buckets whose payload stays under a byte cap (a parameter
larger than the cap gets a bucket of its own). Buckets are numbered in the order they are
opened; collectives are launched strictly in that order on every rank, so ranks with the same
layout always pair their collectives correctly.

Flat layout of one bucket of ``k`` parameters with ``n`` gradient elements in total::

    [ grad_0 | grad_1 | ... | grad_{k-1} | flag_0 ... flag_{k-1} | trailer ]   (n + k + t)

``flag_i`` is 1 where this rank had a gradient for member ``i`` and 0 where it did not (its
slot is zero-filled, Horovod's rule). After a SUM all-reduce a flag is > 0 exactly when *some*
rank had that gradient, so every rank agrees, without an extra collective, on which parameters
received a gradient at all (the others keep ``grad = None`` and the inner optimizer skips them
as it would locally).

The *trailer* (``t`` elements, only in the plan's last bucket, and only when the plan is built
with ``trailer=t``) carries the round's sequence words (:mod:`distoptim.comm.guard`) in the
same all-reduce: it is not divided when averaging and not touched by :meth:`Bucket.pack`. The
last bucket is the one launched last, so its words can say what became known last (an edit of
``.grad`` after backward). A plan with no parameters but a trailer has one bucket that holds
only the trailer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Bucket", "BucketPlan"]


@dataclass
class Bucket:
    """One flat buffer's worth of gradients of a single ``(dtype, device)``.

    ``members`` are indices into :attr:`BucketPlan.params`, in ready order; ``offsets[i]`` and
    ``shapes[i]`` place member ``i`` in the flat buffer; ``numel`` is the number of gradient
    elements; ``trailer`` the number of sequence-word elements after the flags (the buffer
    holds ``numel + len(members) + trailer`` elements, see the module docstring).
    """

    index: int
    dtype: torch.dtype
    device: torch.device
    members: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    numel: int = 0
    trailer: int = 0
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _views: list[torch.Tensor] | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        """Elements in the flat buffer: gradients, one presence flag per member, the trailer."""
        return self.numel + len(self.members) + self.trailer

    @property
    def head(self) -> int:
        """Elements before the trailer: the gradients and the flags (what averaging divides)."""
        return self.numel + len(self.members)

    @property
    def payload_bytes(self) -> int:
        """Bytes of the gradients alone, in the bucket's dtype (what the cap limits)."""
        return self.numel * _itemsize(self.dtype)

    def _add(self, index: int, shape: torch.Size, numel: int) -> None:
        self.members.append(index)
        self.offsets.append(self.numel)
        self.shapes.append(shape)
        self.numel += numel

    # ---- buffers ---------------------------------------------------------------------------
    def new_buffer(self) -> torch.Tensor:
        """A fresh, uninitialized flat buffer (used where results must not alias anything)."""
        return torch.empty(self.size, dtype=self.dtype, device=self.device)

    def persistent_buffer(self) -> torch.Tensor:
        """The bucket's own buffer, allocated once and reused every step."""
        if self._buffer is None:
            self._buffer = self.new_buffer()
            self._views = self._make_views(self._buffer)
        return self._buffer

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each member's gradient slot in ``buffer``, shaped like the parameter (no copy)."""
        if buffer is self._buffer and self._views is not None:
            return self._views
        return self._make_views(buffer)

    def _make_views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        return [
            buffer[off : off + shape.numel()].view(shape)
            for off, shape in zip(self.offsets, self.shapes)
        ]

    # ---- pack / unpack -----------------------------------------------------------------------
    def pack(self, buffer: torch.Tensor, grads: Sequence[torch.Tensor | None]) -> None:
        """Write ``grads`` (one per member, None allowed) and their presence flags into ``buffer``.

        Gradients are copied (cast to the bucket dtype if needed); ``None`` becomes zeros.
        The input tensors are only read.
        """
        views = self.views(buffer)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        absent: list[torch.Tensor] = []
        flags: list[float] = []
        for view, grad in zip(views, grads):
            if grad is None:
                absent.append(view)
                flags.append(0.0)
            else:
                dst.append(view)
                src.append(grad.to_dense() if grad.is_sparse else grad)
                flags.append(1.0)
        if dst:
            torch._foreach_copy_(dst, src)
        if absent:
            torch._foreach_zero_(absent)
        if flags:
            buffer[self.numel : self.head].copy_(torch.tensor(flags, dtype=self.dtype))

    def present(self, buffer: torch.Tensor) -> list[bool]:
        """Per member: did any rank contribute a gradient (flag != 0 after the reduction)?"""
        return (buffer[self.numel : self.head] != 0).tolist()

    def trailer_of(self, buffer: torch.Tensor) -> torch.Tensor:
        """The trailer part of ``buffer`` (a view; empty when this bucket has none)."""
        return buffer[self.head : self.head + self.trailer]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class BucketPlan:
    """The bucket layout for an ordered list of parameters (their registration order).

    ``params`` keeps registration order (index ``i`` = the ``i``-th parameter). Buckets are
    filled in ready ``order`` -- by default *reverse* registration order (the order backward
    usually produces gradients); pass the order observed in a real backward to follow the
    model instead, as DDP's bucket rebuild does -- with one open bucket per
    ``(dtype, device)``. A bucket is closed when the next parameter would push its payload past
    ``cap_bytes`` (``first_cap_bytes`` for the first bucket of each ``(dtype, device)``: a
    small first bucket lets the first collective start early in backward, as DDP's 1 MiB first
    bucket does).

    ``trailer=t`` gives the last bucket ``t`` extra elements for the round's sequence words
    (see the module docstring); a plan without parameters then has one trailer-only bucket of
    ``trailer_dtype`` on ``trailer_device``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        cap_bytes: int,
        first_cap_bytes: int | None = None,
        order: Sequence[int] | None = None,
        *,
        trailer: int = 0,
        trailer_dtype: torch.dtype = torch.float32,
        trailer_device: torch.device | str = "cpu",
    ) -> None:
        if cap_bytes <= 0:
            raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
        if trailer < 0:
            raise ValueError(f"trailer must be >= 0, got {trailer}")
        n = len(params)
        ready = list(reversed(range(n))) if order is None else [int(i) for i in order]
        if sorted(ready) != list(range(n)):
            raise ValueError(f"order must be a permutation of range({n}), got {ready}")
        self.order: list[int] = ready
        first_cap = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
        self.params: list[torch.Tensor] = list(params)
        self.buckets: list[Bucket] = []
        self.bucket_of: list[int] = [-1] * len(self.params)
        self.slot_of: list[int] = [-1] * len(self.params)
        open_: dict[tuple[torch.dtype, torch.device], Bucket] = {}
        first_of: dict[tuple[torch.dtype, torch.device], int] = {}
        for i in ready:
            p = self.params[i]
            key = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            bucket = open_.get(key)
            if bucket is not None:
                cap = first_cap if bucket.index == first_of[key] else cap_bytes
                if bucket.members and bucket.payload_bytes + nbytes > cap:
                    bucket = None
            if bucket is None:
                bucket = Bucket(index=len(self.buckets), dtype=p.dtype, device=p.device)
                self.buckets.append(bucket)
                open_[key] = bucket
                first_of.setdefault(key, bucket.index)
            self.bucket_of[i] = bucket.index
            self.slot_of[i] = len(bucket.members)
            bucket._add(i, p.shape, p.numel())
        if trailer:
            if not self.buckets:
                device = torch.device(trailer_device)
                self.buckets.append(Bucket(index=0, dtype=trailer_dtype, device=device))
            self.buckets[-1].trailer = trailer

    def __len__(self) -> int:
        return len(self.buckets)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.dtype}x{b.numel}" for b in self.buckets)
        return f"BucketPlan({len(self.params)} params in {len(self.buckets)} buckets: {sizes})"
