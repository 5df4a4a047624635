"""The channel of one torchft round: its quorum's members, and who of them contributes.

Owns :class:`QuorumChannel`, the :class:`~distoptim.comm.channel.Channel` the outer family's
averaging schemes and sync header run over when a torchft manager carries them: the members are
every replica of the current quorum (healing ones included: they take part in every collective,
with zeros), ``contributors`` is set from the sync header (the replicas whose pseudo-gradient
counts), and each collective goes through :class:`~distoptim.ft.replicas.ManagedReplicas`, so a
failure (a peer died) is recorded for the round's commit instead of raised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from distoptim.comm.channel import Channel, Handle
from distoptim.ft.replicas import ManagedReplicas, Quorum

__all__ = ["QuorumChannel"]


class QuorumChannel(Channel):
    """The members of ``quorum`` (see the module); ``contributors`` defaults to its
    participants until the header says otherwise."""

    def __init__(self, replicas: ManagedReplicas, quorum: Quorum) -> None:
        self.replicas = replicas
        self.quorum = quorum
        self._contributors = max(1, quorum.participants)

    @property
    def size(self) -> int:
        return self.quorum.group_size

    @property
    def rank(self) -> int:
        return self.quorum.group_rank

    @property
    def contributors(self) -> int:
        return self._contributors

    @contributors.setter
    def contributors(self, value: int) -> None:
        if not 1 <= value <= self.size:
            raise ValueError(f"contributors must be in [1, {self.size}], got {value}")
        self._contributors = value

    @property
    def ranks(self) -> Sequence[int]:
        return range(self.size)

    @property
    def failed(self) -> str:
        err = self.replicas.errored()
        return "" if err is None else f"{type(err).__name__}: {err}"

    def all_reduce_sum(self, tensor: torch.Tensor) -> Handle:
        # through the quorum's group, not manager.allreduce: a participating replica that just
        # healed (synchronous quorum) must send the zeros it wrote, not be second-guessed
        return self.replicas.all_reduce_group(tensor)

    def all_gather_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        chunks = list(out.chunk(self.size))
        handle = self.replicas.all_gather(chunks, tensor)
        return _Joined(handle, out, chunks)

    def all_to_all_single(self, out: torch.Tensor, tensor: torch.Tensor) -> Handle:
        return self.replicas.all_to_all(out, tensor)


class _Joined:
    """An all-gather into chunks of ``out``: the chunks are views, so nothing to copy back
    unless the backend wrote into copies (then they are copied in on ``wait``)."""

    def __init__(self, handle: Handle, out: torch.Tensor, chunks: list[torch.Tensor]) -> None:
        self.handle, self.out, self.chunks = handle, out, chunks

    def wait(self) -> bool:
        self.handle.wait()
        for i, chunk in enumerate(self.out.chunk(len(self.chunks))):
            if chunk.data_ptr() != self.chunks[i].data_ptr():
                chunk.copy_(self.chunks[i])
        return True
