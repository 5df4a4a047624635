"""The sync header: what every replica must agree on before a sync's payload collectives.

Owns the small fixed-size all-gather that precedes every collective of a sync whose size
depends on the fragment (the pseudo-gradient all-reduce, or each phase of a quantized mean):
each replica sends its sequence words (:class:`~distoptim.comm.guard.GuardWords`: the round
kind, the inner step, a 48-bit fingerprint of the parameters and the options, the parameter
count; with equal options the step fixes which fragment syncs and in which phase) and two
float64 numbers, ``Σ θ_g`` and ``Σ θ_g²`` over the syncing fragment's global copy. Every
replica receives the same table and reaches the same verdict:

* fingerprints differ (another model, other options) ->
  :class:`~distoptim.comm.guard.ParameterMismatchError`;
* steps differ (a ``step()`` skipped or added, a checkpoint loaded on some replicas only) ->
  :class:`~distoptim.comm.guard.DesyncError`;
* global copies differ (replicas built from different weights, or loaded different
  checkpoints) beyond a relative 1e-9 -> ``ParameterMismatchError``.

Why a separate header and not a trailer in the payload (as CrossShardOptimizer's rounds carry
their words): fragments have different sizes, and a gloo collective whose ranks disagree on the
size aborts the process. A fixed-size message first turns every such divergence into an error
on every rank, before any size-dependent collective. Cost per header: ``(n - 1)`` messages of
``CHUNKS + 16`` bytes (38 bytes) per rank and one latency.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from distoptim.comm.guard import CHUNKS, GuardCodec, GuardWords, ParameterMismatchError, check_round
from distoptim.comm.stats import CommStats

__all__ = ["SyncAgreement"]

_SUMS = 2  # Σ θ_g and Σ θ_g² (float64)


class SyncAgreement:
    """Checks one sync header over ``group`` (``group_size >= 2`` replicas).

    ``device``: where the message lives (the current GPU under NCCL, else the CPU); ``owner``
    names the optimizer in errors.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        group_size: int,
        stats: CommStats,
        device: torch.device,
        owner: str,
    ) -> None:
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(group_size))
        )
        self.group = group
        self.stats = stats
        self.device = device
        self.owner = owner
        self.codec = GuardCodec(group_size, dist.get_rank(group), ranks, owner=owner)

    def check(self, words: GuardWords, global_copy: Sequence[torch.Tensor]) -> None:
        """All-gather this replica's words and global-copy sums; raise on any disagreement."""
        codec = self.codec
        trailer = torch.zeros(codec.size, dtype=torch.uint8)
        codec.write(trailer, words)
        mine_words = trailer[codec.group_rank * CHUNKS : (codec.group_rank + 1) * CHUNKS]
        with torch.no_grad():
            sums = torch.stack(
                [
                    torch.stack([g.double().sum(), g.double().square().sum()]).cpu()
                    for g in global_copy
                ]
            ).sum(0)
        mine = torch.cat([mine_words, sums.view(torch.uint8)]).to(self.device)
        rows = [torch.empty_like(mine) for _ in range(codec.group_size)]
        self.stats.send((codec.group_size - 1) * mine.numel())
        dist.all_gather(rows, mine, group=self.group)
        table = torch.stack(rows).cpu()
        # every rank's slot, in rank order, is exactly the summed trailer the codec reads
        check_round(codec.read(table[:, :CHUNKS].reshape(-1)), codec.ranks, owner=self.owner)
        all_sums = table[:, CHUNKS:].contiguous().view(torch.float64).reshape(-1, _SUMS)
        if all(
            torch.allclose(row, all_sums[0], rtol=1e-9, atol=0.0, equal_nan=True)
            for row in all_sums
        ):
            return
        lines = [
            f"  rank {r}: sum {float(s[0]):.12g}, sum of squares {float(s[1]):.12g}"
            for r, s in zip(codec.ranks, all_sums)
        ]
        raise ParameterMismatchError(
            f"{self.owner}: replicas hold different global copies at step {words.step} (the "
            "parameters at construction, or the loaded checkpoints, differ):\n"
            + "\n".join(lines)
            + "\nBuild the model identically on every replica (e.g. torch.manual_seed before "
            "creating it, or broadcast rank 0's parameters) before creating the optimizer, and "
            "resume every replica from the same checkpoint step."
        )
