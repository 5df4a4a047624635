"""A worker's commit round: one request per shard, written, sent and absorbed.

Owns :class:`CommitRound`, the part of
:class:`~distoptim.agn.worker.AsyncWorkerOptimizer` that runs one commit (``_commit``): per
:class:`~distoptim.agn.shard_link.ShardLink` it starts a stream when the shard asks for one,
writes the payload chunk by chunk (checking it is finite when several shards must agree), tells
each shard its verdict or sends the whole commit, then takes each reply -- chunk by chunk as it
arrives, or whole, read in place and released once absorbed -- and handles refusals and shards
lost meanwhile (see :mod:`distoptim.agn.worker` for the protocol).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from distoptim.agn.center_guard import finite, finite_tensor
from distoptim.agn.cluster import Cluster
from distoptim.agn.flat import nbytes
from distoptim.agn.shard_link import ShardLink
from distoptim.agn.transport.base import Pending, ShardLostError, Stream
from distoptim.agn.transport.messages import Commit, CommitReply, ErrorReply, Reply
from distoptim.comm.link import transmit

__all__ = ["CommitRound"]


@dataclass
class _Flow:
    """One link's part of a commit in progress."""

    link: ShardLink
    payload: dict[str, torch.Tensor] | None = None
    hparams: dict[int, dict[str, Any]] | None = None
    stream: Stream | None = None
    pending: Pending | None = None
    lost: ShardLostError | None = None
    finite: bool = True


class CommitRound:
    """Mixin of :class:`~distoptim.agn.worker.AsyncWorkerOptimizer`: its commit round.

    It uses the optimizer's connection (``_require_connected``), its per-algorithm pieces
    (``_payload_target``, ``_payload_part``, ``_payload``, ``_absorb_part``, ``_absorbed``,
    ``_absorb``, ``_server_rule``, ``_in_parts``) and ``_resync``/``_reset_to``; it updates
    ``global_step`` and ``lost_commits``.
    """

    def _outbox(self, link: ShardLink) -> dict[str, torch.Tensor] | None:
        """The transport's free buffers for this link's payload, typed like its layout."""
        specs = link.layout.buffers()
        sizes = [n * torch.empty((), dtype=d).element_size() for _, d, n in specs]
        raw = self._require_connected().cluster.transport.outbox(link.shard, sizes)
        if raw is None:
            return None
        return {k: b.view(d) for (k, d, _), b in zip(specs, raw)}

    def _hparams(self, link: ShardLink) -> dict[int, dict[str, Any]] | None:
        """Numeric hyperparameters that changed since the last commit (LR schedules)."""
        changed: dict[int, dict[str, Any]] = {}
        for gi, g in enumerate(self.param_groups):
            now = {
                k: v
                for k, v in g.items()
                if k != "params" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            if now != link.sent_hparams.get(gi):
                changed[gi] = now
                link.sent_hparams[gi] = now
        return changed or None

    def _commit(self) -> None:
        conn = self._require_connected()
        cluster = conn.cluster
        for link in conn.links:  # a shard restarted under another optimizer's request
            if cluster.incarnation(link.shard) != link.incarnation:
                self._resync(link)
        parts_out, parts_in = self._in_parts()
        multi = len(conn.links) > 1
        uses_opt = self._server_rule().uses_optimizer
        flows = [_Flow(link) for link in conn.links]
        try:
            for f in flows:  # streams start now, so each shard works while payloads are written
                link = f.link
                link.out = self._outbox(link)
                link.plan(cluster.transport.chunk_bytes(link.shard))
                if parts_out and link.streamable:
                    f.payload = self._payload_target(link)
                    f.hparams = self._hparams(link) if uses_opt else None
                    commit = self._commit_request(link, f.payload, f.hparams, False)
                    try:
                        f.stream = cluster.stream(link.shard, commit, link.chunks, link.inbox)
                    except ShardLostError as exc:
                        f.lost = exc
            for f in flows:
                self._write_payload(f, parts_out, check=multi)
            refuse = not all(f.finite for f in flows)
            for f in flows:
                self._send(f, cluster, refuse, uses_opt)
            reasons: list[str] = []
            for f in flows:
                self._finish_link(f, cluster, parts_in, reasons)
        except BaseException:
            for f in flows:  # wind every exchange down: the connections stay usable
                if f.stream is not None:
                    f.stream.abandon()
                if f.pending is not None:
                    with contextlib.suppress(Exception):
                        f.pending.wait()
            raise
        lost = [f for f in flows if f.lost is not None]
        for f in lost:  # the commit is lost; wait for the shard, take its center
            cluster.reconnect(f.link.shard, f.lost)
            self._resync(f.link)
        self.lost_commits += bool(lost)
        if reasons:
            warnings.warn(
                f"{self._name}: worker {conn.task_index}'s commit at local step {self.local_step} "
                f"was refused by the parameter server ({'; '.join(sorted(set(reasons)))}); the "
                "center is unchanged and the local parameters were reset to it",
                RuntimeWarning,
                stacklevel=3,
            )

    def _commit_request(
        self,
        link: ShardLink,
        flats: dict[str, torch.Tensor],
        hparams: dict[int, dict[str, Any]] | None,
        refused: bool,
    ) -> Commit:
        conn = self._require_connected()
        transmit(nbytes(flats))
        return Commit(self._name, conn.task_index, link.version, flats, hparams, refused)

    def _write_payload(self, f: _Flow, parts: bool, check: bool) -> None:
        """Write link ``f.link``'s payload (chunk by chunk, each made ready as it is written
        when streaming); with ``check``, note whether it is finite (a sum per chunk, in cache)."""
        link = f.link
        if not parts:
            f.payload = self._payload(link)
            f.finite = not check or finite(f.payload)
            return
        dst = f.payload if f.payload is not None else self._payload_target(link)
        f.payload = dst
        for chunk in link.chunks:
            self._payload_part(link, chunk, dst)
            if check and f.finite:
                f.finite = finite_tensor(chunk.of(dst))
            if f.stream is not None and f.lost is None:
                try:
                    f.stream.ready(chunk.index)
                except ShardLostError as exc:
                    f.lost, f.stream = exc, None

    def _send(self, f: _Flow, cluster: Cluster, refuse: bool, uses_opt: bool) -> None:
        """Tell a streaming shard the verdict; send a whole commit to the others."""
        link = f.link
        if f.lost is not None:
            return
        try:
            if f.stream is not None:
                f.stream.finish("refuse" if refuse else "ok")
                return
            assert f.payload is not None
            hp = self._hparams(link) if uses_opt and not refuse else None
            commit = self._commit_request(link, {} if refuse else f.payload, hp, refuse)
            f.pending = cluster.send(link.shard, commit, into=link.reply_buffers())
        except ShardLostError as exc:
            f.lost, f.stream = exc, None

    def _finish_link(self, f: _Flow, cluster: Cluster, parts: bool, reasons: list[str]) -> None:
        """Take the reply: chunk by chunk as it arrives (streaming), then the outcome. A whole
        reply may be the shard's own memory, read in place: released once absorbed."""
        link = f.link
        if f.lost is not None:
            return
        assert f.payload is not None
        pending: Pending | None = None
        try:
            if f.stream is not None:
                stream = f.stream
                for chunk in link.chunks:
                    stream.arrived(chunk.index)
                    if parts:
                        self._absorb_part(link, chunk, stream.reply_flats)
                f.stream = None
                reply: Reply = stream.wait()
                center = stream.reply_flats
            else:
                assert f.pending is not None
                pending, f.pending = f.pending, None
                reply = pending.wait()
                center = getattr(reply, "flats", {})
        except ShardLostError as exc:
            f.lost = exc
            return
        try:  # absorbed, and only then released
            if isinstance(reply, ErrorReply):
                self._resync(link)  # the local copy may hold part of a reply: take the center
                raise reply.to_exception()
            assert isinstance(reply, CommitReply)
            link.version = reply.version
            self.global_step = max(self.global_step, reply.version)
            if reply.refused:
                reasons.append(reply.reason or "refused")
                link.sent_hparams.clear()
                self._reset_to(link, reply.flats)
            elif reply.streamed and parts:
                self._absorbed(link, center)
            else:
                self._absorb(link, f.payload, center if reply.streamed else reply.flats)
        finally:
            if pending is not None:
                pending.release()
