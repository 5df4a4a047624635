"""Channels: the members one round's collectives run over, and the divisor of every mean.

Owns the seam between the averaging schemes (:mod:`~distoptim.comm.averaging`,
:mod:`~distoptim.comm.quantize`, :mod:`~distoptim.comm.gather`) or the outer family's sync
header (:mod:`distoptim.outer.agreement`) and whatever carries their bytes. A scheme never calls
``torch.distributed`` itself: it asks its :class:`Channel` for one of three asynchronous
collectives, each returning a handle whose ``wait()`` blocks until the result is in place:

* :meth:`Channel.all_reduce_sum` -- ``tensor ← Σ_m tensor_m`` over the members, in place;
* :meth:`Channel.all_gather_single` -- ``out = cat_m tensor_m`` in member order (``out`` holds
  ``size`` times ``tensor``);
* :meth:`Channel.all_to_all_single` -- ``tensor`` in ``size`` equal row blocks, block ``j`` to
  member ``j``; ``out``'s block ``m`` is what member ``m`` sent this member.

and reads three numbers:

* :attr:`Channel.size` -- the members taking part in *every* collective (the shape of every
  gathered buffer, the number of shards of a two-phase mean);
* :attr:`Channel.rank` -- this member's index in ``range(size)``;
* :attr:`Channel.contributors` -- how many members' payloads count: the divisor of every mean.
  On a plain group it equals ``size``. A channel whose members include some that take part in
  the collectives without contributing (e.g. a replica that is joining and sends zeros) has
  fewer contributors than members; the schemes then divide by ``contributors``, so the mean is
  over the members that count, provided the others send zeros.

:class:`GroupChannel` is the channel of a ``torch.distributed`` process group (``None``: the
default group): every member contributes, and the collectives are the group's own.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["Channel", "GroupChannel", "Handle"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""torch >= 2.13's name; ``all_gather_into_tensor`` before (deprecated after)."""


class Handle(Protocol):
    """A launched collective: ``wait()`` blocks until its result is in place (or raises)."""

    def wait(self) -> Any: ...


class Channel(abc.ABC):
    """The members one round's collectives run over (see the module).

    Invariants every implementation keeps: ``0 <= rank < size``; ``1 <= contributors <= size``;
    every member issues the same collectives in the same order with tensors of the same sizes
    (a scheme's responsibility); results are identical on every member.
    """

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Members taking part in every collective."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This member's index in ``range(size)``."""

    @property
    def contributors(self) -> int:
        """Members whose payloads count: the divisor of every mean (``size`` unless told)."""
        return self.size

    @property
    def ranks(self) -> Sequence[int]:
        """The number each member is named by in error messages ("rank 3"), in member order
        (``range(size)`` unless told)."""
        return range(self.size)

    @property
    def failed(self) -> str:
        """Why this round's collectives can no longer be trusted ("" while they can).

        A channel that records failures instead of raising them (a torchft quorum whose peer
        died) says so here: what its collectives left in their outputs is then garbage, and
        whoever reads them must not judge by it. A plain group raises instead: always "".
        """
        return ""

    @abc.abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor) -> Handle:
        """Start ``tensor ← Σ_m tensor_m`` (in place)."""

    @abc.abstractmethod
    def all_gather_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        """Start ``out ← cat_m tensor_m`` (member order along dim 0)."""

    @abc.abstractmethod
    def all_to_all_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        """Start the exchange of ``tensor``'s ``size`` row blocks: block ``j`` to member ``j``."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, rank={self.rank}, "
            f"contributors={self.contributors})"
        )


class GroupChannel(Channel):
    """The channel of a ``torch.distributed`` process group of ``size`` ranks.

    ``group=None`` is the default group. Members are named by their global ranks
    (:attr:`ranks`). ``rank`` and ``ranks`` are read from the group when first asked for;
    outside an initialized process group the channel is a single member, rank 0 (the schemes
    issue no collective on a channel of one).
    """

    def __init__(self, group: dist.ProcessGroup | None, size: int) -> None:
        self.group = group
        self._size = size
        self._rank: int | None = None
        self._ranks: list[int] | None = None

    @property
    def size(self) -> int:
        return self._size

    @property
    def rank(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank(self.group) if _distributed() else 0
        return self._rank

    @property
    def ranks(self) -> Sequence[int]:
        """The members' global ranks."""
        if self._ranks is None:
            if not _distributed():
                self._ranks = list(range(self._size))
            elif self.group is None:
                self._ranks = list(range(dist.get_world_size()))
            else:
                self._ranks = dist.get_process_group_ranks(self.group)
        return self._ranks

    def all_reduce_sum(self, tensor: torch.Tensor) -> Handle:
        return dist.all_reduce(tensor, group=self.group, async_op=True)

    def all_gather_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        return _all_gather_single(out, tensor, group=self.group, async_op=True)

    def all_to_all_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        return dist.all_to_all_single(out, tensor, group=self.group, async_op=True)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
