"""The worker-side link to one shard: the extension point for new asynchronous algorithms.

Owns: :class:`ShardLink`, everything one worker keeps about the part of one optimizer's
parameters that one parameter-server shard holds -- which parameters, their flat layout, the
center version last seen, the accumulator and last-pulled center some algorithms need, and the
reply buffers a transport may receive into.

Writing a new algorithm
-----------------------
An asynchronous algorithm is a subclass of
:class:`~distoptim.agn.worker.AsyncWorkerOptimizer` that says, per link and per chunk of the
link's chunk plan (``link.chunks``, :class:`~distoptim.agn.flat.Chunk`: a commit travels, is
applied and comes back chunk by chunk, each step overlapping the others):

* ``_payload_part(link, chunk, dst)``: write that chunk of what it commits into ``dst`` (flat
  buffers in ``link.layout``; ``chunk.of(dst)``, or per piece ``link.part_views(chunk, dst)``
  against the parameters' pieces ``link.part_params(chunk)``), e.g. ``a / λ`` from ``link.acc``
  or ``θ - θ_pulled`` (:meth:`ShardLink.delta_part`). ``dst`` is ``_payload_target(link)``:
  ``link.out`` (the shared segment, sent for free) when set, else ``link.send_buffers()``.
* ``_absorb_part(link, chunk, reply)``: what that chunk of the local parameters becomes once
  the reply's chunk arrived (default: the center, :meth:`ShardLink.assign_part`, and kept as
  ``pulled`` with ``_keeps_pulled``). It is provisional: a refused commit resets the local copy
  to the center afterwards. ``_absorbed(link, reply)`` runs once after an accepted commit.
* ``_server_rule() -> ServerRule``: how the shard applies a commit
  (:mod:`distoptim.agn.rules`; add a rule there if none fits; declare it ``elementwise`` so the
  shard applies it chunk by chunk).

and sets ``_keeps_accumulator`` (the worker maintains ``link.acc``, the sum of raw gradients
since the last commit) and/or ``_keeps_pulled`` (``link.pulled`` holds the center as last
received). An algorithm may instead override the whole-buffer forms ``_payload(link)`` and
``_absorb(link, sent, reply)``; its commits are then computed, or absorbed, whole.
:mod:`distoptim.agn.agn`, :mod:`~distoptim.agn.downpour` and :mod:`~distoptim.agn.easgd` are each
about fifty lines on top of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.agn.flat import Chunk, FlatLayout
from distoptim.agn.transport.shm import layout_offsets

_WHOLE = 1 << 62  # a chunk size no buffer reaches: one chunk per buffer

__all__ = ["ShardLink"]


@dataclass
class ShardLink:
    """One worker's view of one shard for one optimizer.

    * ``shard``: the shard's index; ``positions``: indices of these parameters in the
      optimizer's parameter list; ``params``: the parameters themselves (the local copies);
      ``layout``: their flat layout (one buffer per dtype, in parameter order).
    * ``version``: the shard's center version at this worker's last pull or commit;
      ``incarnation``: the shard's incarnation then (it changes when the shard restarts).
    * ``acc`` / ``acc_views``: the accumulator ``a`` (flat, and per-parameter views), kept when
      the algorithm has ``_keeps_accumulator``; ``acc_is_zero``: ``a`` is logically zero, so the
      next accumulation overwrites instead of adding (saves a pass).
    * ``pulled``: the center as last received (``_keeps_pulled``).
    * ``out``: where the next payload can be written for free (the request region of the shared
      segment on a same-machine p2p connection; set by the worker before the payload is
      written), or None.
    * ``inbox``: persistent buffers a transport may receive commit replies into
      (:meth:`reply_buffers`; a reply's ``flats`` may or may not be these: always read the
      reply).
    * ``chunks``: the chunk plan of commits to this shard (:meth:`plan`); ``streamable``:
      whether they can be streamed (every parameter cut by a chunk is contiguous).
    """

    shard: int
    positions: list[int]
    params: list[torch.Tensor]
    layout: FlatLayout
    version: int = 0
    incarnation: int = 0
    acc: dict[str, torch.Tensor] | None = None
    acc_views: list[torch.Tensor] = field(default_factory=list)
    acc_is_zero: bool = True
    pulled: dict[str, torch.Tensor] | None = None
    out: dict[str, torch.Tensor] | None = None
    inbox: dict[str, torch.Tensor] | None = None
    sent_hparams: dict[int, dict[str, Any]] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    streamable: bool = False
    _plan_bytes: int = -1
    _parts: list[list[torch.Tensor]] = field(default_factory=list)
    _kept: dict[str, torch.Tensor] | None = None
    _sendbuf: dict[str, torch.Tensor] | None = None

    # ---- the chunk plan ------------------------------------------------------------------------
    def plan(self, chunk_bytes: int) -> None:
        """Use the chunk plan of ``chunk_bytes`` (the shard's; 0: one chunk per buffer, not
        streamed). A parameter cut by a chunk must be contiguous to be written piece by piece;
        otherwise the link uses one chunk per buffer and is not ``streamable``."""
        if chunk_bytes == self._plan_bytes and self.chunks:
            return
        self._plan_bytes = chunk_bytes
        chunks = self.layout.chunks(chunk_bytes or _WHOLE)
        numel = [p.numel() for p in self.params]
        cut = {pc.var for c in chunks for pc in c.pieces if pc.numel != numel[pc.var]}
        self.streamable = chunk_bytes > 0 and all(self.params[i].is_contiguous() for i in cut)
        if chunk_bytes and not self.streamable:
            chunks = self.layout.chunks(_WHOLE)
        self.chunks = chunks
        self._parts = [
            [
                self.params[pc.var]
                if pc.numel == numel[pc.var]
                else self.params[pc.var].detach().view(-1)[pc.start : pc.stop]
                for pc in c.pieces
            ]
            for c in chunks
        ]

    def part_params(self, chunk: Chunk) -> list[torch.Tensor]:
        """The local parameters' pieces in ``chunk`` (whole parameters where a piece covers one,
        1-D views of the others), matching :meth:`part_views`."""
        return self._parts[chunk.index]

    def part_views(self, chunk: Chunk, flats: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """``flats``' pieces in ``chunk``, shaped like :meth:`part_params`."""
        return [v.view(p.shape) for v, p in zip(chunk.piece_views(flats), self._parts[chunk.index])]

    # ---- what algorithms use -------------------------------------------------------------------
    def local(self) -> dict[str, torch.Tensor]:
        """Fresh flat copies of the local parameters."""
        return self.layout.flatten(self.params)

    def send_buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers for payloads when the transport offers none (allocated once)."""
        if self._sendbuf is None:
            self._sendbuf = self.layout.zeros()
        return self._sendbuf

    def assign(self, flats: dict[str, torch.Tensor]) -> None:
        """Local parameters := ``flats`` (one pass)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.layout.views(flats))

    def assign_part(self, chunk: Chunk, flats: dict[str, torch.Tensor]) -> None:
        """The local parameters' pieces in ``chunk`` := ``flats``'."""
        with torch.no_grad():
            torch._foreach_copy_(self.part_params(chunk), self.part_views(chunk, flats))

    def delta_part(
        self, chunk: Chunk, dst: dict[str, torch.Tensor], divisor: int = 1
    ) -> torch.Tensor:
        """Chunk ``chunk`` of ``(θ - θ_pulled) / divisor`` written into ``dst``; returns it."""
        if self.pulled is None:
            raise RuntimeError("delta() needs the last pulled center (_keeps_pulled)")
        with torch.no_grad():
            for p, c, d in zip(
                self.part_params(chunk),
                self.part_views(chunk, self.pulled),
                self.part_views(chunk, dst),
            ):
                torch.sub(p, c, out=d)
        out = chunk.of(dst)
        if divisor != 1:
            out.div_(divisor)
        return out

    def delta(self, divisor: int = 1) -> dict[str, torch.Tensor]:
        """``(θ - θ_pulled) / divisor`` as flat buffers (in ``out`` when set): two passes."""
        dst = self.out if self.out is not None else self.send_buffers()
        if not self.chunks:
            self.plan(0)
        for chunk in self.chunks:
            self.delta_part(chunk, dst, divisor)
        return dst

    def _is_inbox(self, flats: dict[str, torch.Tensor]) -> bool:
        return self.inbox is not None and all(
            flats[k].data_ptr() == v.data_ptr() for k, v in self.inbox.items() if k in flats
        )

    def keep(self, flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``flats`` owned by this link: the reply buffers themselves, else a copy.

        A reply's buffers are only valid until the next request to the shard (they may live in
        a shared segment); what an algorithm keeps beyond that (``pulled``) goes through here.
        """
        if self._is_inbox(flats):
            return flats
        if self._kept is None:
            self._kept = self.layout.zeros()
        for k, v in flats.items():
            self._kept[k].copy_(v)
        return self._kept

    def keep_part(self, chunk: Chunk, flats: dict[str, torch.Tensor]) -> None:
        """Chunk ``chunk`` of :meth:`keep` (``kept(flats)`` then holds all the chunks kept)."""
        if self._is_inbox(flats):
            return
        if self._kept is None:
            self._kept = self.layout.zeros()
        chunk.of(self._kept).copy_(chunk.of(flats))

    def kept(self, flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Where :meth:`keep_part` kept ``flats``' chunks."""
        if self._is_inbox(flats):
            return flats
        assert self._kept is not None
        return self._kept

    def segment_bytes(self) -> int:
        """Bytes a message with this link's buffers needs in a shared segment (per region)."""
        sizes = [n * torch.empty((), dtype=d).element_size() for _, d, n in self.layout.buffers()]
        return layout_offsets(sizes)[1]

    def reply_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers commit replies may be received into (allocated once).

        They may be the buffers ``pulled`` refers to: a commit's payload is computed before its
        reply arrives, and the reply then becomes the new ``pulled``.
        """
        if self.inbox is None:
            self.inbox = self.layout.zeros()
        return self.inbox
