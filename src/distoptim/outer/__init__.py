"""The synchronous outer-optimizer family: LocalSGD, DiLoCo and Streaming DiLoCo.

Modules: :mod:`~distoptim.outer.diloco` (the optimizer: schedule, outer step, checkpoints),
:mod:`~distoptim.outer.localsgd` (parameter averaging as DiLoCo with outer SGD at rate 1),
:mod:`~distoptim.outer.fragments` (Streaming DiLoCo's fragments and their sync steps),
:mod:`~distoptim.outer.exchange` (one fragment's pseudo-gradients averaged over the group, in
the chosen wire format), :mod:`~distoptim.outer.agreement` (the header every sync starts with:
the replicas agree on step, options, optimizers and global copy, and refuse a non-finite
pseudo-gradient), :mod:`~distoptim.outer.checkpoint` (what a checkpoint's wrapper entry holds
and its checks). See ``docs/diloco.md``.
"""

from distoptim.outer.agreement import NonFiniteSyncError
from distoptim.outer.diloco import DiLoCo, GlobalParameters
from distoptim.outer.localsgd import LocalSGD

__all__ = ["DiLoCo", "GlobalParameters", "LocalSGD", "NonFiniteSyncError"]
