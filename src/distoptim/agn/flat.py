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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FlatLayout", "dtype_key", "nbytes"]


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
