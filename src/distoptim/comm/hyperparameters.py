"""An optimizer's hyperparameters as plain data: what replicas compare, and how they differ.

Owns three things a synchronous optimizer needs to check that its replicas run the *same*
optimizer (the same type, the same learning rate, momentum, ... in every param group, the same
grouping of the parameters) without sending the hyperparameters at every round:

* :func:`describe_optimizer` -- ``torch.optim.Optimizer`` -> JSON-able dict: the type's
  qualified name and, per param group, which parameters it holds (:func:`group_members`: their
  count and a short hash of their positions in a reference list) and every hyperparameter,
  values made plain (numbers stay exact: ``json`` writes floats with ``repr``; tensors become
  lists, or a hash when large; other objects their type's name). The implementation flags
  ``foreach``, ``fused``, ``capturable`` and ``differentiable`` are left out: they choose a
  kernel, not the math, and may differ between machines.
* :func:`fingerprint` -- a description -> a 64-bit BLAKE2b of its canonical JSON: equal
  descriptions give equal fingerprints; different ones differ except with probability 2^-64.
* :func:`differences` -- the descriptions every replica sent (exchanged only once fingerprints
  differed) -> one line per differing entry, each naming every replica's value.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["describe_optimizer", "differences", "fingerprint", "group_members"]

IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param-group keys that select an implementation, not the update; never compared."""

_TENSOR_ITEMS = 16  # tensors of up to this many elements are described by their values


def _short_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=4).hexdigest()


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data that is equal on two processes iff the values are."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # 'nan', 'inf': valid JSON
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.numel() <= _TENSOR_ITEMS:
            return {"tensor": _plain(t.tolist()), "dtype": str(t.dtype)}
        digest = _short_hash(t.contiguous().numpy().tobytes())
        return {"tensor": f"shape {tuple(t.shape)} #{digest}", "dtype": str(t.dtype)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, numbers.Integral):  # numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # numpy floats of other widths, fractions
        return _plain(float(value))
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def group_members(opt: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> list[str]:
    """Per param group of ``opt``, which parameters it holds: their count and a short hash of
    their positions in ``params`` (a parameter not in ``params`` counts as position -1)."""
    position = {id(p): i for i, p in enumerate(params)}
    out = []
    for group in opt.param_groups:
        members = [position.get(id(p), -1) for p in group["params"]]
        out.append(f"{len(members)} #{_short_hash(json.dumps(members).encode())}")
    return out


def describe_optimizer(
    opt: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    members: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``opt``'s type and param groups as plain data (see the module).

    ``params``: the reference order for :func:`group_members`; ``members``: its result, when
    the caller keeps it (the grouping of a fixed parameter list does not change).
    """
    if members is None or len(members) != len(opt.param_groups):
        members = group_members(opt, params)
    groups = []
    for group, held in zip(opt.param_groups, members):
        entry: dict[str, Any] = {"params": held}
        for key in sorted(group):
            if key != "params" and key not in IMPLEMENTATION_FLAGS:
                entry[key] = _plain(group[key])
        groups.append(entry)
    kind = type(opt)
    return {"type": f"{kind.__module__}.{kind.__qualname__}", "groups": groups}


def fingerprint(description: Any) -> int:
    """64-bit fingerprint of a JSON-able description (canonical: keys sorted)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    if isinstance(value, Mapping) and "tensor" not in value:
        for k, v in value.items():
            _flatten(v, f"{path}: {k}" if path else str(k), out)
    elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
        for i, v in enumerate(value):
            name = (
                f"{path[: -len('groups')]}group {i}" if path.endswith("groups") else f"{path}[{i}]"
            )
            _flatten(v, name, out)
    else:
        out[path] = value


def differences(descriptions: Sequence[Any], names: Sequence[str], limit: int = 8) -> list[str]:
    """One line per entry whose value is not the same in every description.

    ``names[i]`` names description ``i`` (e.g. ``"rank 3"``). Entries keep their first-seen
    order; an entry one description lacks shows as ``(none)``. At most ``limit`` lines, then a
    line counting the rest.
    """
    flat = []
    for d in descriptions:
        entries: dict[str, Any] = {}
        _flatten(d, "", entries)
        flat.append(entries)
    paths = list(dict.fromkeys(p for entries in flat for p in entries))
    missing = object()
    lines = []
    for path in paths:
        values = [entries.get(path, missing) for entries in flat]
        if all(v == values[0] for v in values[1:]):
            continue
        shown = ", ".join(
            f"{name} {'(none)' if v is missing else json.dumps(v)}"
            for name, v in zip(names, values)
        )
        lines.append(f"{path}: {shown}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more differences"]
    return lines
