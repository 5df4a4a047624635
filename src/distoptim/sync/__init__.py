"""The synchronous optimizer: ``CrossShardOptimizer`` and the machinery only it uses.

Modules: :mod:`distoptim.sync.optimizer` (the optimizer class) and :mod:`distoptim.sync.sharding`
(weight-update sharding: the flat update and its state). The communication it stands on lives
in :mod:`distoptim.comm`.
"""

from __future__ import annotations

from distoptim.sync.optimizer import CrossShardOptimizer, Reduction

__all__ = ["CrossShardOptimizer", "Reduction"]
