"""The synchronous outer-optimizer family: LocalSGD, DiLoCo and Streaming DiLoCo.

Modules: :mod:`~distoptim.outer.diloco` (the optimizer: schedule, outer step, checkpoints),
:mod:`~distoptim.outer.localsgd` (parameter averaging as DiLoCo with outer SGD at rate 1),
:mod:`~distoptim.outer.fragments` (Streaming DiLoCo's fragments and their sync steps),
:mod:`~distoptim.outer.exchange` (one fragment's pseudo-gradients averaged over the group, in
the chosen wire format), :mod:`~distoptim.outer.agreement` (the header every sync starts with:
the replicas agree on step, options and global copy). See ``docs/diloco.md``.
"""

from distoptim.outer.diloco import DiLoCo
from distoptim.outer.localsgd import LocalSGD

__all__ = ["DiLoCo", "LocalSGD"]
