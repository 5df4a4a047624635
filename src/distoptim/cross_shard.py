"""Re-export module: the 0.2.0 import path of ``CrossShardOptimizer``.

The synchronous optimizer lives in :mod:`distoptim.sync` (the class in
:mod:`distoptim.sync.optimizer`); this module only keeps ``distoptim.cross_shard.*`` working.
"""

from __future__ import annotations

from distoptim.comm.groups import check_group_assignment
from distoptim.comm.guard import DesyncError
from distoptim.sync.optimizer import CrossShardOptimizer, Reduction

__all__ = ["CrossShardOptimizer", "DesyncError", "Reduction", "check_group_assignment"]
