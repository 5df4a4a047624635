"""distoptim: TensorFlow's distributed optimizers, rebuilt on ``torch.distributed``.

The public names are resolved lazily: ``import distoptim`` stays cheap and does not load
``torch.distributed.rpc`` or DTensor until an optimizer that needs them is touched.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from distoptim._version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "CrossShardOptimizer": "distoptim.cross_shard",
    "Reduction": "distoptim.cross_shard",
    "AGNOptimizer": "distoptim.agn.agn",
    "AGNCustomGetter": "distoptim.agn.getter",
    "DownpourOptimizer": "distoptim.agn.downpour",
    "ElasticAverageOptimizer": "distoptim.agn.easgd",
    "SGD": "distoptim.dtensor.sgd",
    "WrappedOptimizer": "distoptim.protocol",
    "TFOptimizerProtocol": "distoptim.protocol",
}

__all__ = [
    "AGNCustomGetter",
    "AGNOptimizer",
    "CrossShardOptimizer",
    "DownpourOptimizer",
    "ElasticAverageOptimizer",
    "Reduction",
    "SGD",
    "TFOptimizerProtocol",
    "WrappedOptimizer",
    "__version__",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from distoptim.agn.agn import AGNOptimizer
    from distoptim.agn.downpour import DownpourOptimizer
    from distoptim.agn.easgd import ElasticAverageOptimizer
    from distoptim.agn.getter import AGNCustomGetter
    from distoptim.cross_shard import CrossShardOptimizer, Reduction
    from distoptim.dtensor.sgd import SGD
    from distoptim.protocol import TFOptimizerProtocol, WrappedOptimizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distoptim' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
