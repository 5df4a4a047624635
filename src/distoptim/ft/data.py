"""Which samples a replica group trains on when replicas die and join: data follows the step.

Owns the rule that decides, for replica *slot* ``r`` of ``R`` and the committed step ``s``,
which samples that replica's batch holds -- with no per-replica state to heal, so a replica
that joins mid-epoch, healed from a peer, lands on the right batch by itself.

Slots. A job has ``R`` replica slots (the number of replica groups it launches). A slot's
index is fixed for the whole job: a replica that dies and is restarted takes its old slot back
(``--chaos`` restarts do; with torchrun, give the restarted group the same ``replica_id``
suffix). Slots, not the quorum's ranks, own data: quorum ranks are renumbered every time
membership changes, which would move every live replica onto another shard mid-epoch.

The rule. Epoch ``e`` is a permutation ``π_e`` of the ``N`` samples (seeded by ``seed`` and
``e``; the last ``N mod R`` samples of it are left out of that epoch so every slot has
``n = ⌊N/R⌋``, and the next permutation reshuffles them in). Slot ``r``'s shard is
``π_e[r n : (r + 1) n]``, read in batches of ``b``: ``B = ⌊n / b⌋`` batches per epoch (a last
partial batch is dropped, so every step has ``b`` samples per replica). Step ``s`` (counted
from 0) is batch ``s mod B`` of epoch ``⌊s / B⌋``.

What a death costs. While slot ``r`` is down, the steps the others commit pass its batches by:
those samples are not seen in that epoch (they are not re-dealt to the survivors, who keep
their own shards), and the next epoch's permutation gives them a new chance. A joiner is
healed with the step counter, so it resumes at the batch the others are on. Without faults,
every step consumes ``R b`` distinct samples and an epoch sees ``R B b`` of them, each once.
The CLI counts the samples the committed steps actually consumed, so a run reports what it
saw instead of assuming it.
"""

from __future__ import annotations

import torch

from distoptim import checks

__all__ = ["SlotShards"]


class SlotShards:
    """The batches of one replica slot, as a pure function of the committed step.

    Args:
        num_samples: ``N``, the training set's size.
        num_slots: ``R``, replica slots of the job.
        slot: ``r``, this replica's slot in ``[0, R)``.
        batch_size: ``b``, samples per replica per step.
        seed: seeds every epoch's permutation (the same on every replica).
    """

    def __init__(
        self, num_samples: int, num_slots: int, slot: int, batch_size: int, seed: int = 0
    ) -> None:
        self.num_samples = checks.check_int("num_samples", num_samples, 1)
        self.num_slots = checks.check_int("num_slots", num_slots, 1)
        self.slot = checks.check_int("slot", slot, 0)
        self.batch_size = checks.check_int("batch_size", batch_size, 1)
        self.seed = checks.check_int("seed", seed, 0)
        if self.slot >= self.num_slots:
            raise ValueError(f"slot must be in [0, num_slots={num_slots}), got {slot}")
        per_slot = self.num_samples // self.num_slots
        if per_slot < self.batch_size:
            raise ValueError(
                f"{num_samples} samples over {num_slots} replica slots leave {per_slot} per "
                f"slot, fewer than one batch of {batch_size}: use fewer slots or a smaller batch"
            )
        self.shard_size = per_slot
        self.batches_per_epoch = per_slot // self.batch_size
        self._epoch = -1
        self._shard = torch.empty(0, dtype=torch.int64)

    def _shard_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples, generator=gen)
            n = self.shard_size
            self._shard = order[self.slot * n : (self.slot + 1) * n]
            self._epoch = epoch
        return self._shard

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, batch index in the epoch)`` of committed step ``step`` (from 0)."""
        step = checks.check_int("step", step, 0)
        return divmod(step, self.batches_per_epoch)

    def batch(self, step: int) -> torch.Tensor:
        """The sample indices of this slot's batch at committed step ``step`` (int64)."""
        epoch, k = self.position(step)
        b = self.batch_size
        return self._shard_of(epoch)[k * b : (k + 1) * b]
