"""Re-export module: the 0.2.0 import path of weight-update sharding's public names.

Weight-update sharding lives in :mod:`distoptim.sync.sharding`, the element-wise rule in
:mod:`distoptim.elementwise_rule`; this module only keeps ``distoptim.cross_shard_sharding.*``
working.
"""

from __future__ import annotations

from distoptim.elementwise_rule import ELEMENTWISE_OPTIMIZERS, elementwise
from distoptim.sync.sharding import ShardedUpdate, check_elementwise

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedUpdate", "check_elementwise", "elementwise"]
