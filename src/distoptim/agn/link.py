"""The worker-side link to one shard: the extension point for new asynchronous algorithms.

Owns: :class:`ShardLink`, everything one worker keeps about the part of one optimizer's
parameters that one parameter-server shard holds -- which parameters, their flat layout, the
center version last seen, the accumulator and last-pulled center some algorithms need, and the
reply buffers a transport may receive into.

Writing a new algorithm
-----------------------
An asynchronous algorithm is a subclass of
:class:`~distoptim.agn.worker.AsyncWorkerOptimizer` that says, per link:

* ``_payload(link) -> dict[str, Tensor]``: what it commits (flat buffers in ``link.layout``),
  e.g. ``a / λ`` from ``link.acc``, or ``θ - θ_pulled`` (:meth:`ShardLink.delta`). When
  ``link.out`` is not None it holds buffers the transport sends for free (a shared segment):
  write the payload there if you can. The returned buffers belong to the transport until the
  reply arrives.
* ``_absorb(link, sent, reply)``: what the local parameters become after an accepted commit
  (default: the center in ``reply``, via :meth:`ShardLink.assign`).
* ``_server_rule() -> ServerRule``: how the shard applies a commit
  (:mod:`distoptim.agn.rules`; add a rule there if none fits).

and sets ``_keeps_accumulator`` (the worker maintains ``link.acc``, the sum of raw gradients
since the last commit) and/or ``_keeps_pulled`` (``link.pulled`` holds the center as last
received). :mod:`distoptim.agn.agn`, :mod:`~distoptim.agn.downpour` and
:mod:`~distoptim.agn.easgd` are each about fifty lines on top of this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from distoptim.agn.flat import FlatLayout
from distoptim.agn.transport.shm import layout_offsets

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
    * ``out``: where the next payload can be written for free (the shared segment's buffers on
      a same-machine p2p connection; set by the worker before ``_payload``), or None. It
      overlaps the last reply: read that first.
    * ``inbox``: persistent buffers a transport may receive commit replies into
      (:meth:`reply_buffers`; a reply's ``flats`` may or may not be these: always read the
      reply).
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
    _kept: dict[str, torch.Tensor] | None = None

    def local(self) -> dict[str, torch.Tensor]:
        """Fresh flat copies of the local parameters."""
        return self.layout.flatten(self.params)

    def assign(self, flats: dict[str, torch.Tensor]) -> None:
        """Local parameters := ``flats`` (one pass)."""
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.layout.views(flats))

    def delta(self, divisor: int = 1) -> dict[str, torch.Tensor]:
        """``(θ - θ_pulled) / divisor`` as flat buffers (in ``out`` when set): two passes."""
        if self.pulled is None:
            raise RuntimeError("delta() needs the last pulled center (_keeps_pulled)")
        dst = self.out if self.out is not None else self.layout.zeros()
        with torch.no_grad():
            for p, c, d in zip(self.params, self.layout.views(self.pulled), self.layout.views(dst)):
                torch.sub(p, c, out=d)
        if divisor != 1:
            for t in dst.values():
                t.div_(divisor)
        return dst

    def keep(self, flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``flats`` owned by this link: the reply buffers themselves, else a copy.

        A reply's buffers are only valid until the next request to the shard (they may live in
        a shared segment); what an algorithm keeps beyond that (``pulled``) goes through here.
        """
        if self.inbox is not None and all(
            flats[k].data_ptr() == v.data_ptr() for k, v in self.inbox.items() if k in flats
        ):
            return flats
        if self._kept is None:
            self._kept = self.layout.zeros()
        for k, v in flats.items():
            self._kept[k].copy_(v)
        return self._kept

    def segment_bytes(self) -> int:
        """Bytes a message with this link's buffers needs in a shared segment."""
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
