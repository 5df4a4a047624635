"""Gradient buckets: which gradients travel together, and where each one sits in a flat buffer.

Owns the bucket *layout* (no communication): parameters are taken in the order their gradients
become ready during backward -- reverse registration order, DDP's default assumption -- and
grouped per ``(dtype, device)`` into buckets whose payload stays under a byte cap (a parameter
larger than the cap gets a bucket of its own). Buckets are numbered in the order they are
opened; collectives are launched strictly in that order on every rank, so ranks with the same
layout always pair their collectives correctly.

Flat layout of one bucket of ``k`` parameters with ``n`` gradient elements in total::

    [ grad_0 | grad_1 | ... | grad_{k-1} | pad | flag_0 ... flag_{k-1} | trailer ]

``flag_i`` is 1 where this rank had a gradient for member ``i`` and 0 where it did not (its
slot is zero-filled, Horovod's rule). After a SUM all-reduce a flag is > 0 exactly when *some*
rank had that gradient, so every rank agrees, without an extra collective, on which parameters
received a gradient at all (the others keep ``grad = None`` and the inner optimizer skips them
as it would locally). A plan built with ``flags=False`` has no flag region: its rounds carry
the flags elsewhere (weight-update sharding sends them in a small control all-reduce, because
a reduce-scatter delivers each element to one rank only).

``pad`` (zeros, only with ``pad_to > 1``) makes ``n + pad`` a multiple of ``pad_to``, so the
gradient region splits into ``pad_to`` equal shards (one per rank of a reduce-scatter).

The *trailer* (``t`` elements, only in the plan's last bucket, and only when the plan is built
with ``trailer=t``) carries the round's sequence words (:mod:`distoptim.comm.guard`) in the
same all-reduce: it is not divided when averaging and not touched by :meth:`Bucket.pack`. The
last bucket is the one launched last, so its words can say what became known last (an edit of
``.grad`` after backward). A plan with no parameters but a trailer has one bucket that holds
only the trailer.

Gradients as bucket views: :meth:`Bucket.grad_aliases` gives one tensor per member that
*aliases* its slot in the bucket's persistent buffer, with a version counter of its own (not a
view: views share their base's counter, so an edit of one gradient could not be told from an
edit of another). Put in ``.grad``, backward accumulates straight into the bucket, and
:meth:`Bucket.pack` skips the copy of any gradient that already sits in its slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from distoptim.local_shards import local_view

__all__ = ["Bucket", "BucketPlan"]


@dataclass
class Bucket:
    """One flat buffer's worth of gradients of a single ``(dtype, device)``.

    ``members`` are indices into :attr:`BucketPlan.params`, in ready order; ``offsets[i]`` and
    ``shapes[i]`` place member ``i`` in the flat buffer; ``numel`` is the number of gradient
    elements; ``pad`` the zeros after them; ``flagged`` whether the buffer has a flag region;
    ``trailer`` the number of sequence-word elements after the flags (the buffer holds
    ``numel + pad + len(members) * flagged + trailer`` elements, see the module docstring).
    """

    index: int
    dtype: torch.dtype
    device: torch.device
    members: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    shapes: list[torch.Size] = field(default_factory=list)
    numel: int = 0
    trailer: int = 0
    pad: int = 0
    flagged: bool = True
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _views: list[torch.Tensor] | None = field(default=None, repr=False)
    _aliases: list[torch.Tensor] | None = field(default=None, repr=False)
    _spare: torch.Tensor | None = field(default=None, repr=False)

    @property
    def padded(self) -> int:
        """Elements of the gradient region including the padding (what a reduce-scatter splits)."""
        return self.numel + self.pad

    @property
    def num_flags(self) -> int:
        """Presence flags in the buffer: one per member, or none (``flagged=False``)."""
        return len(self.members) if self.flagged else 0

    @property
    def size(self) -> int:
        """Elements in the flat buffer: gradients, padding, presence flags, the trailer."""
        return self.padded + self.num_flags + self.trailer

    @property
    def head(self) -> int:
        """Elements before the trailer: gradients, padding, flags (what averaging divides)."""
        return self.padded + self.num_flags

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
        """The bucket's own buffer, allocated once (zero-filled) and reused every step."""
        if self._buffer is None:
            self._buffer = torch.zeros(self.size, dtype=self.dtype, device=self.device)
            self._views = self._make_views(self._buffer)
        return self._buffer

    def spare_buffer(self) -> torch.Tensor:
        """A second persistent buffer (allocated once): for rounds that must not write the
        first one because ``.grad`` lives there (:meth:`grad_aliases`)."""
        if self._spare is None:
            self._spare = torch.zeros(self.size, dtype=self.dtype, device=self.device)
        return self._spare

    def grad_aliases(self) -> list[torch.Tensor]:
        """Per member, a tensor aliasing its slot in :meth:`persistent_buffer` (made once).

        Each alias has the member's shape and a version counter of its own: in-place writes
        through it (backward's accumulation, clipping) bump only its own ``_version``; writes
        through the buffer (the reduction) bump none of them.
        """
        if self._aliases is None:
            storage = self.persistent_buffer().untyped_storage()
            self._aliases = [
                torch.empty(0, dtype=self.dtype, device=self.device).set_(
                    storage, off, shape, _contiguous_strides(shape)
                )
                for off, shape in zip(self.offsets, self.shapes)
            ]
        return self._aliases

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
    def pack(
        self,
        buffer: torch.Tensor,
        grads: Sequence[torch.Tensor | None],
        flags: torch.Tensor | None = None,
        source: torch.Tensor | None = None,
    ) -> None:
        """Write ``grads`` (one per member, None allowed) and their presence flags.

        Gradients are copied (cast to the bucket dtype if needed), except one that already
        sits in its slot of ``buffer`` (a :meth:`grad_aliases` alias: nothing to copy);
        ``None`` becomes zeros. ``source``: another buffer of this bucket's layout whose slots
        the gradients may sit in (the aliases' buffer, when ``buffer`` is a spare one): the
        other gradients are copied into *its* slots first (so each member's slot there holds
        its gradient afterwards, as it does when ``buffer`` is the aliases' buffer), then its
        gradient region is copied whole, in one pass. The flags go into the buffer's flag
        region, or into ``flags`` (``len(members)`` elements, any dtype and device) --
        required when the bucket has no flag region. The padding is zeroed; the gradients
        are only read.
        """
        views = self.views(buffer)
        home = buffer if source is None else source
        slots = self.views(home)
        # gradients are usually this bucket's own aliases: an identity check is enough
        aliases = self._aliases if home is self._buffer else None
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        absent: list[torch.Tensor] = []
        present: list[float] = []
        for k, (view, grad) in enumerate(zip(views, grads)):
            if grad is None:
                absent.append(view)
                present.append(0.0)
            else:
                present.append(1.0)
                if (aliases is None or grad is not aliases[k]) and not _in_slot(grad, slots[k]):
                    if grad.shape != view.shape:
                        raise self.wrong_shape(k, grad)
                    dst.append(slots[k])
                    src.append(grad.to_dense() if grad.layout != torch.strided else grad)
        if dst:
            torch._foreach_copy_(dst, src)
        if home is not buffer:
            buffer[: self.numel].copy_(home[: self.numel])
        if absent:
            torch._foreach_zero_(absent)
        if self.pad:
            buffer[self.numel : self.padded].zero_()
        if flags is None:
            if not self.flagged:
                raise ValueError("this bucket has no flag region: pass flags=")
            flags = buffer[self.padded : self.head]
        if present:
            flags.copy_(torch.tensor(present, dtype=flags.dtype))

    def wrong_shape(self, k: int, grad: torch.Tensor) -> ValueError:
        """The error of member ``k``'s gradient whose shape is not its parameter's."""
        return ValueError(
            f"the gradient of trainable parameter {self.members[k]} (counted in the optimizer's "
            f"parameter order, trainable ones only) has shape {tuple(grad.shape)}, but the "
            f"parameter has shape {tuple(self.shapes[k])}: a gradient must have its parameter's "
            "shape (was .grad.data, or .grad through a custom hook, replaced by another tensor?)"
        )

    def present(self, buffer: torch.Tensor) -> list[bool]:
        """Per member: did any rank contribute a gradient (flag != 0 after the reduction)?"""
        return (buffer[self.padded : self.head] != 0).tolist()

    def trailer_of(self, buffer: torch.Tensor) -> torch.Tensor:
        """The trailer part of ``buffer`` (a view; empty when this bucket has none)."""
        return buffer[self.head : self.head + self.trailer]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _in_slot(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Does ``grad`` already hold exactly ``view``'s memory (nothing to copy)?

    A sparse (or other non-strided) gradient has no data pointer: it never sits in a slot.
    """
    return (
        grad.layout == torch.strided
        and grad.data_ptr() == view.data_ptr()
        and grad.dtype == view.dtype
        and grad.device == view.device
        and grad.is_contiguous()
    )


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
    ``trailer_dtype`` on ``trailer_device``. ``pad_to=n`` pads every bucket's gradient region
    to a multiple of ``n`` elements (``n`` equal shards); ``flags=False`` leaves out the flag
    regions (the caller carries presence flags in another buffer).

    A ``DTensor`` parameter (FSDP2, tensor parallelism) is laid out by its local tensor: its
    slot has the shape, dtype and device of what this process holds of it.
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
        pad_to: int = 1,
        flags: bool = True,
    ) -> None:
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
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
            p = local_view(self.params[i])  # a DTensor's piece: what this process reduces
            key = (p.dtype, p.device)
            nbytes = p.numel() * p.element_size()
            bucket = open_.get(key)
            if bucket is not None:
                cap = first_cap if bucket.index == first_of[key] else cap_bytes
                if bucket.members and bucket.payload_bytes + nbytes > cap:
                    bucket = None
            if bucket is None:
                bucket = Bucket(
                    index=len(self.buckets), dtype=p.dtype, device=p.device, flagged=flags
                )
                self.buckets.append(bucket)
                open_[key] = bucket
                first_of.setdefault(key, bucket.index)
            self.bucket_of[i] = bucket.index
            self.slot_of[i] = len(bucket.members)
            bucket._add(i, p.shape, p.numel())
        for bucket in self.buckets:
            bucket.pad = -bucket.numel % pad_to
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
