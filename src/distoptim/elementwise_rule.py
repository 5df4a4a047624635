"""Which optimizers are element-wise, so that they may run on any slice of the parameters.

Owns one promise that two features rely on: weight-update sharding (each rank steps the wrapped
optimizer on its flat slice of the parameters, :mod:`distoptim.sync.sharding`) and the
parameter server's chunked server optimizer (a shard steps a table's optimizer chunk by chunk,
:mod:`distoptim.agn.server_optimizer`). Both are exact only for an *element-wise* update: the new
value of each parameter element depends only on that element's parameter, gradient and
per-element state, and on per-tensor scalars (0-dim tensors or numbers in the state, such as
Adam's ``step`` or NAdam's ``mu_product``) that depend on the step count and hyperparameters
alone. Then running the optimizer on any slice gives exactly the elements the whole update
would.

Which optimizers: :data:`ELEMENTWISE_OPTIMIZERS` (SGD with momentum/Nesterov, Adam, AdamW,
Adagrad, Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop -- exactly those classes, not
subclasses, which may override ``step``), and any class decorated with :func:`elementwise`.
Anything else (LBFGS, Adafactor's factored moments, Muon's orthogonalisation, an update with a
global-norm clip inside) is refused by :func:`check_elementwise`, whose error names the feature
that asked.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "SCALAR_KEYS",
    "check_elementwise",
    "elementwise",
    "is_elementwise",
    "is_per_element",
]

ELEMENTWISE_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Adamax,
        torch.optim.ASGD,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
    }
)
"""torch optimizers whose update is element-wise (exactly these classes)."""

SCALAR_KEYS = frozenset({"step", "mu_product", "eta", "mu"})
"""Per-tensor scalar state of torch's element-wise optimizers. Only needed to read a 0-dim
parameter's saved state, where a per-element value and a scalar have the same shape."""

_MARK = "_distoptim_elementwise_update"

_Cls = TypeVar("_Cls", bound=type)


def elementwise(cls: _Cls) -> _Cls:
    """Class decorator: ``cls``'s update is element-wise, so it may run on slices.

    Promise: the new value of each parameter element depends only on that element's
    parameter, gradient and per-element state, and on per-tensor scalars (0-dim tensors or
    numbers in the state) that depend on the step count and hyperparameters only; ``step``
    reads the parameters from ``self.param_groups`` and keeps state in ``self.state``, creating
    it lazily. A Lion-style optimizer qualifies; one that clips by a global norm inside
    ``step`` does not.
    """
    setattr(cls, _MARK, True)
    return cls


def is_elementwise(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s update is known to be element-wise (see the module docstring)."""
    cls = type(opt)
    return cls in ELEMENTWISE_OPTIMIZERS or getattr(cls, _MARK, False) is True


def check_elementwise(opt: torch.optim.Optimizer, owner: str, does: str) -> None:
    """Raise ``TypeError`` unless ``opt``'s update is known to be element-wise.

    ``owner`` names the feature that needs it (``"CrossShardOptimizer(shard_optimizer_state=
    True)"``), ``does`` what it does with the optimizer (``"runs the wrapped optimizer on each
    rank's flat slice of the parameters"``); both appear in the message.
    """
    if is_elementwise(opt):
        return
    cls = type(opt)
    allowed = ", ".join(sorted(c.__name__ for c in ELEMENTWISE_OPTIMIZERS))
    raise TypeError(
        f"{owner} {does}, which is exact only for an element-wise update; "
        f"{cls.__module__}.{cls.__qualname__} is not known to be one (an update that couples "
        f"elements -- a line search like LBFGS, factored or orthogonalised moments, a "
        f"global-norm clip inside step() -- would change). Allowed: {allowed} (those classes, "
        "not subclasses). For your own element-wise optimizer, decorate its class with "
        "@distoptim.elementwise."
    )


def is_per_element(key: str, value: Any, param_shape: torch.Size) -> bool:
    """Is ``value`` (saved state ``key`` of a parameter of ``param_shape``) one value per element?

    A tensor of the parameter's shape is, except for a 0-dim parameter's scalar keys
    (:data:`SCALAR_KEYS`), where a per-element value and a scalar look the same.
    """
    if not isinstance(value, torch.Tensor) or value.shape != param_shape:
        return False
    return len(param_shape) > 0 or key not in SCALAR_KEYS
