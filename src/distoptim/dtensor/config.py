"""What a valid mesh-aware SGD configuration is, and its (de)serialization, Keras' included.

Owns: the checks of SGD's hyperparameters (``learning_rate``, ``momentum``; the generic rules
are :mod:`distoptim.checks`'), the JSON form of a configuration (:func:`to_config`), and the
parsing of a configuration dict into constructor arguments (:func:`parse_config`) -- from
distoptim's own form or from a Keras 2 ``tf.keras.optimizers.SGD(...).get_config()`` dict --
with the learning-rate schedules and the device mesh they carry.

distoptim's form (``SGD.get_config()``)::

    {"name", "learning_rate", "momentum", "nesterov", "amsgrad", "gradients_clip_option",
     "ema_option", "jit_compile", "mesh"}

``learning_rate`` is a number or ``{"class_name": "module.QualName", "config": {...}}`` (any
class with ``get_config()`` and a ``from_config`` classmethod); ``mesh`` is ``None`` or
``{"device_type", "mesh" (nested rank lists), "mesh_dim_names"}``.

Keras 2's form (flat)::

    {"name", "weight_decay", "clipnorm", "global_clipnorm", "clipvalue", "use_ema",
     "ema_momentum", "ema_overwrite_frequency", "jit_compile", "is_legacy_optimizer",
     "learning_rate", "momentum", "nesterov"}   (+ "mesh", ours)

with schedules serialized as ``{"module": "keras.optimizers.schedules", "class_name":
"ExponentialDecay", "config": {..., "name": None}, "registered_name": None}``. It maps onto
the same optimizer: ``clipnorm``/``global_clipnorm``/``clipvalue`` (``None`` or 0 = off) become
a :class:`GradientsClipOption`, the three EMA keys an :class:`EMAOption`; Keras'
``ExponentialDecay`` and ``PiecewiseConstantDecay`` become :mod:`distoptim.dtensor.schedules`'
classes of the same name. Refused with a ``ValueError`` that says why: a non-zero
``weight_decay`` (not implemented here), ``is_legacy_optimizer=True`` or a ``decay`` key (the
legacy optimizer), any other Keras schedule. The wrapper ``tf.keras.optimizers.serialize``
adds (``{"class_name": "SGD", "config": {...}, ...}``) is accepted too.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from distoptim.checks import check_bool, check_real, check_type
from distoptim.dtensor.options import EMAOption, GradientsClipOption
from distoptim.dtensor.schedules import ExponentialDecay, PiecewiseConstantDecay

__all__ = [
    "CONFIG_KEYS",
    "KERAS_KEYS",
    "check_lr",
    "check_momentum",
    "parse_config",
    "to_config",
]

DEFAULT_LR = 0.01
CONFIG_KEYS = (
    "name",
    "learning_rate",
    "momentum",
    "nesterov",
    "amsgrad",
    "gradients_clip_option",
    "ema_option",
    "jit_compile",
    "mesh",
)
KERAS_KEYS = (
    "name",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "jit_compile",
    "is_legacy_optimizer",
    "learning_rate",
    "momentum",
    "nesterov",
)
_KERAS_ONLY = frozenset(KERAS_KEYS) - frozenset(CONFIG_KEYS)
_KERAS_SCHEDULES: dict[str, type] = {
    "ExponentialDecay": ExponentialDecay,
    "PiecewiseConstantDecay": PiecewiseConstantDecay,
}


# ---- hyperparameter checks ---------------------------------------------------------------------
def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_lr(value: Any, what: str = "learning_rate") -> float:
    """``value`` as a float if it is a finite number >= 0 (numpy scalars too): ``TypeError``
    for anything but a number (the message mentions schedules, which the constructor and the
    ``learning_rate`` setter also take), ``ValueError`` for NaN, +-Inf or a negative rate."""
    if type(value) is float and 0.0 <= value < math.inf:  # every step, per group: quickly
        return value
    check_type(what, value, numbers.Real, "a number >= 0 or a callable schedule of iterations")
    return check_real(what, float(value), 0.0)


def check_momentum(value: Any) -> float:
    """``value`` as a float if it is a number in [0, 1] (Keras' range for ``momentum``)."""
    if type(value) is float and 0.0 <= value <= 1.0:  # every step, per group (NaN fails)
        return value
    check_type("momentum", value, numbers.Real, "a number in [0, 1]")
    return check_real("momentum", value, 0.0, 1.0)


# ---- to JSON ------------------------------------------------------------------------------------
def to_config(
    *,
    name: str,
    learning_rate: float | Callable[[int], float],
    momentum: float,
    nesterov: bool,
    clip: GradientsClipOption | None,
    ema: EMAOption | None,
    jit_compile: bool,
    mesh: DeviceMesh | None,
) -> dict[str, Any]:
    """distoptim's JSON form of these constructor arguments (see the module docstring)."""
    return {
        "name": name,
        "learning_rate": (
            _schedule_to_config(learning_rate) if callable(learning_rate) else learning_rate
        ),
        "momentum": momentum,
        "nesterov": nesterov,
        "amsgrad": False,
        "gradients_clip_option": None if clip is None else clip.get_config(),
        "ema_option": None if ema is None else ema.get_config(),
        "jit_compile": jit_compile,
        "mesh": None if mesh is None else _mesh_to_config(mesh),
    }


def _schedule_to_config(sched: Callable[[int], float]) -> dict[str, Any]:
    if not (hasattr(sched, "get_config") and callable(getattr(type(sched), "from_config", None))):
        raise ValueError(
            f"learning_rate is a {type(sched).__name__} without get_config/from_config: "
            "it cannot be serialized; use a schedule from distoptim.dtensor.schedules "
            "or give yours get_config() and a from_config classmethod"
        )
    cls = type(sched)
    return {"class_name": f"{cls.__module__}.{cls.__qualname__}", "config": sched.get_config()}


def _mesh_to_config(mesh: DeviceMesh) -> dict[str, Any]:
    return {
        "device_type": mesh.device_type,
        "mesh": mesh.mesh.tolist(),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
    }


# ---- from JSON ----------------------------------------------------------------------------------
def parse_config(config: Any) -> dict[str, Any]:
    """Constructor keyword arguments from distoptim's or Keras 2's config dict.

    Raises ``TypeError``/``ValueError`` naming the offending key; builds nothing but the
    schedule and the mesh.
    """
    check_type("config", config, dict, "a dict")
    if _is_keras_serialized_optimizer(config):
        config = check_type("config['config']", config["config"], dict, "a dict")
    if "decay" in config:
        raise ValueError(
            "this looks like a config of the legacy tf.keras.optimizers.legacy.SGD (it has "
            "'decay'); only Keras 2 optimizer configs (tf.keras.optimizers.SGD) are accepted"
        )
    kwargs = _from_keras(config) if _KERAS_ONLY & set(config) else _from_native(config)
    lr = kwargs.get("learning_rate", DEFAULT_LR)
    if isinstance(lr, dict):
        kwargs["learning_rate"] = _schedule_from_config(lr)
    mesh = kwargs.get("mesh")
    if isinstance(mesh, dict):
        kwargs["mesh"] = _mesh_from_config(mesh)
    else:
        check_type("config['mesh']", mesh, DeviceMesh, "a dict", optional=True)
    return kwargs


def _is_keras_serialized_optimizer(config: dict[str, Any]) -> bool:
    return config.get("class_name") == "SGD" and "config" in config and "name" not in config


def _from_native(config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; allowed: {list(CONFIG_KEYS)}")
    return dict(config)


def _from_keras(config: dict[str, Any]) -> dict[str, Any]:
    allowed = (*KERAS_KEYS, "mesh")
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown keys {unknown} in a Keras SGD config; allowed: {list(allowed)} "
            "(a config mixing Keras' flat clip/EMA keys with gradients_clip_option/ema_option "
            "is not accepted)"
        )
    if config.get("is_legacy_optimizer", False) is not False:
        raise ValueError(
            "is_legacy_optimizer must be False: configs of the legacy "
            "tf.keras.optimizers.legacy.SGD are not accepted"
        )
    wd = config.get("weight_decay")
    if wd is not None and not (_real(wd) and float(wd) == 0.0):
        raise ValueError(
            f"weight_decay={wd!r}: Keras' decoupled weight decay is not implemented by "
            "distoptim.dtensor.SGD; use weight_decay=None (or 0), or decay the weights yourself"
        )
    clip = {
        k: config[k]
        for k in ("clipnorm", "clipvalue", "global_clipnorm")
        if config.get(k) is not None and not (_real(config[k]) and float(config[k]) == 0.0)
    }
    ema = None
    if config.get("use_ema", False):
        ema = EMAOption(
            use_ema=check_bool("use_ema", config["use_ema"]),
            ema_momentum=config.get("ema_momentum", 0.99),
            ema_overwrite_frequency=config.get("ema_overwrite_frequency"),
        )
    kwargs: dict[str, Any] = {
        k: config[k]
        for k in ("name", "learning_rate", "momentum", "nesterov", "jit_compile", "mesh")
        if k in config
    }
    kwargs["gradients_clip_option"] = GradientsClipOption(**clip) if clip else None
    kwargs["ema_option"] = ema
    return kwargs


def _schedule_from_config(spec: dict[str, Any]) -> Callable[[int], float]:
    name = spec.get("class_name")
    if not isinstance(name, str) or "config" not in spec:
        raise ValueError(
            "a serialized learning_rate schedule is {'class_name': 'module.Class', "
            "'config': {...}} or a Keras schedule {'module': 'keras.optimizers.schedules', "
            f"'class_name': ..., 'config': {{...}}, 'registered_name': None}}, got {spec!r}"
        )
    if "module" in spec or "registered_name" in spec or "." not in name:
        return _keras_schedule_from_config(spec)
    if set(spec) != {"class_name", "config"}:
        raise ValueError(f"unknown keys {sorted(set(spec) - {'class_name', 'config'})} in {spec}")
    module_name, _, qualname = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"cannot find schedule class {name!r}: {exc}") from exc
    if not (isinstance(obj, type) and callable(getattr(obj, "from_config", None))):
        raise ValueError(f"{name!r} is not a class with a from_config classmethod")
    return obj.from_config(spec["config"])


def _keras_schedule_from_config(spec: dict[str, Any]) -> Callable[[int], float]:
    unknown = sorted(set(spec) - {"module", "class_name", "config", "registered_name"})
    if unknown:
        raise ValueError(f"unknown keys {unknown} in the Keras schedule {spec!r}")
    name = spec["class_name"]
    cls = _KERAS_SCHEDULES.get(name)
    if cls is None:
        raise ValueError(
            f"Keras schedule {name!r} is not supported; supported: {sorted(_KERAS_SCHEDULES)} "
            "(or pass any callable step -> learning rate as learning_rate)"
        )
    cfg = dict(check_type(f"the config of Keras schedule {name!r}", spec["config"], dict, "a dict"))
    label = cfg.pop("name", None)  # Keras' name scope: no meaning here
    check_type(f"Keras schedule {name!r}: name", label, str, "a str", optional=True)
    return cls.from_config(cfg)


def _mesh_from_config(spec: dict[str, Any]) -> DeviceMesh:
    allowed = {"device_type", "mesh", "mesh_dim_names"}
    if set(spec) - allowed or "device_type" not in spec or "mesh" not in spec:
        raise ValueError(f"config['mesh'] must have keys {sorted(allowed)}, got {sorted(spec)}")
    names = spec.get("mesh_dim_names")
    return DeviceMesh(
        spec["device_type"],
        torch.tensor(spec["mesh"], dtype=torch.int64),
        mesh_dim_names=tuple(names) if names else None,
    )
