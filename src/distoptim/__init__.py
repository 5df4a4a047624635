"""distoptim: TensorFlow's distributed optimizers, rebuilt on ``torch.distributed``.

The public names, and the subpackages ``distoptim.launch``, ``distoptim.agn``,
``distoptim.dtensor``, ``distoptim.comm``, ``distoptim.sync`` and ``distoptim.cli``, are
resolved lazily: ``import distoptim`` stays cheap and loads the parameter server or DTensor
only when something that needs them is touched.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

from distoptim._version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CrossShardOptimizer": "distoptim.sync.optimizer",
    "Reduction": "distoptim.sync.optimizer",
    "DesyncError": "distoptim.comm.guard",
    "CheckpointError": "distoptim.sync.sharded_checkpoint",
    "AGNOptimizer": "distoptim.agn.agn",
    "AGNCustomGetter": "distoptim.agn.getter",
    "AsyncDiLoCoOptimizer": "distoptim.agn.async_diloco",
    "DownpourOptimizer": "distoptim.agn.downpour",
    "ElasticAverageOptimizer": "distoptim.agn.easgd",
    "SGD": "distoptim.dtensor.sgd",
    "DiLoCo": "distoptim.outer.diloco",
    "LocalSGD": "distoptim.outer.localsgd",
    "WrappedOptimizer": "distoptim.protocol",
    "elementwise": "distoptim.elementwise_rule",
    "TFOptimizerProtocol": "distoptim.protocol",
}

# subpackages and modules reachable as attributes (``distoptim.launch.spawn``)
_SUBMODULES = (
    "agn",
    "checks",
    "cli",
    "comm",
    "cross_shard",
    "dtensor",
    "elementwise_rule",
    "launch",
    "outer",
    "protocol",
    "sync",
)

__all__ = [
    "AGNCustomGetter",
    "AGNOptimizer",
    "AsyncDiLoCoOptimizer",
    "CheckpointError",
    "CrossShardOptimizer",
    "DesyncError",
    "DiLoCo",
    "DownpourOptimizer",
    "ElasticAverageOptimizer",
    "LocalSGD",
    "Reduction",
    "SGD",
    "TFOptimizerProtocol",
    "WrappedOptimizer",
    "__version__",
    "elementwise",
]

if _typing.TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from distoptim import agn, cli, comm, dtensor, launch, outer, sync  # noqa: F401
    from distoptim.agn.agn import AGNOptimizer
    from distoptim.agn.async_diloco import AsyncDiLoCoOptimizer
    from distoptim.agn.downpour import DownpourOptimizer
    from distoptim.agn.easgd import ElasticAverageOptimizer
    from distoptim.agn.getter import AGNCustomGetter
    from distoptim.comm.guard import DesyncError
    from distoptim.dtensor.sgd import SGD
    from distoptim.outer.diloco import DiLoCo
    from distoptim.outer.localsgd import LocalSGD
    from distoptim.protocol import TFOptimizerProtocol, WrappedOptimizer
    from distoptim.sync.optimizer import CrossShardOptimizer, Reduction
    from distoptim.sync.sharded_checkpoint import CheckpointError


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        value: object = _importlib.import_module(f"distoptim.{name}")
    elif name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'distoptim' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *_SUBMODULES})
