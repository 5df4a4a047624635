"""The synchronous optimizer: ``CrossShardOptimizer`` and the machinery only it uses.

Down the floors a ``step()`` takes:

* :mod:`distoptim.sync.optimizer` -- the optimizer class (options, ``step``, ``zero_grad``),
  thin, with its mixins :mod:`~distoptim.sync.tf_path` (the TF path) and
  :mod:`~distoptim.sync.state` (the state dict, per-rank checkpoints);
  :mod:`distoptim.sync.options` -- its validated options;
* :mod:`distoptim.sync.rounds` -- the round driver: the bucket plan every rank agreed on, and
  each round's launch, agreement (the sequence guard's words) and settling;
  :mod:`distoptim.sync.notices` -- the one-time warnings every rank gives about what some
  rank's words marked (``.grad`` edited after backward, a model wrapped in DDP);
* :mod:`distoptim.sync.collectives` -- the replicas and every collective issued over them;
* :mod:`distoptim.sync.apply` -- how a round's result reaches the parameters, one strategy
  chosen at construction: :mod:`~distoptim.sync.packed`, :mod:`~distoptim.sync.views`
  (gradients as bucket views) or :mod:`~distoptim.sync.sharded` (weight-update sharding, over
  the flat update of :mod:`distoptim.sync.sharding`); :mod:`distoptim.sync.clipping` --
  ``max_grad_norm``, the reduced gradient clipped by its global norm;
* :mod:`distoptim.sync.local_grads` -- ``DTensor`` parameters across replica groups (HSDP):
  each process reduces its local piece of the gradient over the cross-group ``group=``;
  :mod:`distoptim.sync.replicated` -- the rounds of a torchft manager, and
  :mod:`distoptim.sync.managed_shards` -- those over ``DTensor`` shards (HSDP under torchft:
  the manager averages each piece with its counterparts; the group's combined checksum).

The bytes themselves move in :mod:`distoptim.comm`. ``distoptim.cross_shard`` and
``distoptim.cross_shard_sharding`` re-export the 0.2.0 names.
"""

from __future__ import annotations

from distoptim.sync.optimizer import CrossShardOptimizer, Reduction

__all__ = ["CrossShardOptimizer", "Reduction"]
