"""Per-rank optimizer checkpoints through ``torch.distributed.checkpoint`` (DCP).

Owns the per-rank checkpoint format of ``CrossShardOptimizer`` -- each rank writes and reads
only the optimizer state it holds (with ``shard_optimizer_state=True``, its ``1/n``), with no
gather -- and the resharding on load to any number of ranks, sharded or not. (``state_dict()``
keeps the gathered, unsharded format of the wrapped optimizer; this is the other path.)

Format: a state dict DCP understands (:func:`state_dict_of`), saved by ``dcp.save`` alone or
nested in a larger one (the model's next to it)::

    {"distoptim": (FORMAT, iterations, param_groups, layout),   # replicated: written once
     "state": {"<i>": {key: value}}}

``i`` is the parameter's index in torch's optimizer state dict (the parameters of every param
group, in order), ``param_groups`` torch's own (hyperparameters and those indices), ``layout``
``{"optimizer": "<module>.<class>", "shapes": [shape of parameter i, ...], "counts":
{"wrapped_iterations": n, ...}}`` (the wrapped optimizer's type, and the step counts of its
chain as ``state_dict()`` names them: a Keras-style optimizer's schedule reads its own;
checkpoints of the earlier format ``per-rank-1`` have no layout, earlier ``per-rank-2`` ones no
counts). Per-element
state (Adam's moments, SGD's momentum) is a 1-D tensor of the parameter's ``numel`` elements in
its flat (row-major) order: a ``ShardedTensor`` whose local shards are the pieces this rank
holds (weight-update sharding: its pieces of the flat bucket layout, :mod:`distoptim.comm.shard`),
or a plain tensor where every rank holds all of it (DCP then writes it once). Everything else
(Adam's ``step``, ...) is stored as it is, by every rank that holds a piece (written once).

Resharding. :func:`template_of` asks, for this rank, exactly what its current layout holds --
its pieces of the agreed plan (any number of ranks ``m``), or whole tensors -- and DCP reads the
overlapping parts of whatever chunks the checkpoint has (a run of ``n`` ranks, sharded or not).
:func:`loaded_state` turns the filled template back into the strategy's
:class:`~distoptim.sync.apply.Owned` pieces. Nothing is gathered on any rank.

Checks, before any optimizer state changes (the same verdict on every rank: they read the same
metadata and the same header, and agreed on the same parameters; :func:`check_fit`): the
checkpoint holds this format under the given prefix; it was saved by the same optimizer type;
every param group has the same hyperparameter keys and number of parameters; every parameter
has the saved shape (not only its number of elements); the state keys of every parameter this
optimizer already holds state for are the saved ones; and every saved per-element state has
its parameter's number of elements. Each refusal is a ``ValueError`` naming what differs.

Errors of DCP itself (a missing or truncated file, a directory that cannot be written) arrive as
its ``CheckpointException``, a ``BaseException`` that ``except Exception`` does not catch; they
leave here as :class:`CheckpointError` (a ``RuntimeError``) naming the checkpoint, the file
(missing, or shorter than the metadata says), and every rank's cause (:func:`dcp_errors`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from distoptim.protocol import wrapped_step_counts
from distoptim.sync.apply import ApplyStrategy, Owned

__all__ = [
    "FORMAT",
    "CheckpointError",
    "HEADER",
    "check_fit",
    "dcp_errors",
    "dotted",
    "loaded_state",
    "nest",
    "read",
    "state_dict_of",
    "template_of",
    "unnest",
]

FORMAT = "distoptim.CrossShardOptimizer/per-rank-2"
"""The format tag stored in the header (bumped if the layout above changes)."""
_FORMAT_1 = "distoptim.CrossShardOptimizer/per-rank-1"
"""The earlier format (a header without the layout): still loaded, without the layout checks."""
HEADER = "distoptim"
"""The header's key: ``(FORMAT, iterations, param_groups)``."""


class CheckpointError(RuntimeError):
    """A per-rank checkpoint that could not be read or written: DCP's ``CheckpointException``
    (a ``BaseException``) as an ``Exception`` naming the checkpoint, the file and the cause."""


@contextlib.contextmanager
def dcp_errors(action: str, checkpoint_id: Any, metadata: Metadata | None = None) -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (and a missing checkpoint) into :class:`CheckpointError`.

    ``action``: ``"save"`` or ``"load"``; ``metadata``: the checkpoint's (on load), to name the
    file that is missing or shorter than the metadata says.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    where = os.fspath(checkpoint_id)
    try:
        yield
    except CheckpointException as exc:
        causes = "; ".join(
            f"rank {rank}: {type(e).__name__}: {e}" for rank, (e, _) in exc.failures.items()
        )
        found = _bad_files(where, metadata) if metadata is not None else ""
        raise CheckpointError(
            f"could not {action} the per-rank optimizer checkpoint {where!r}{found} ({causes})"
        ) from exc
    except FileNotFoundError as exc:
        if action != "load":
            raise
        raise CheckpointError(
            f"could not load the per-rank optimizer checkpoint {where!r}: "
            f"{exc.filename or where} does not exist (no checkpoint saved there?)"
        ) from exc


def _bad_files(where: str, metadata: Metadata) -> str:
    """``": file X is missing"`` / ``"...truncated..."`` for the files the metadata names."""
    need: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(info, "relative_path", None)
        if isinstance(path, str):
            need[path] = max(need.get(path, 0), int(info.offset) + int(info.length))
    bad = []
    for name, size in sorted(need.items()):
        path = os.path.join(where, name)
        if not os.path.exists(path):
            bad.append(f"file {path} is missing")
        elif os.path.getsize(path) < size:
            bad.append(
                f"file {path} has {os.path.getsize(path)} bytes, its metadata needs at least "
                f"{size} (truncated)"
            )
    return f": {'; '.join(bad)}" if bad else ""


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters in torch's state-dict order (every param group, in order)."""
    return [p for g in opt.param_groups for p in g["params"]]


def _sharded(value: torch.Tensor, numel: int, owned: Owned, group: Any) -> ShardedTensor:
    """A 1-D tensor of ``numel`` elements of which this rank holds ``value`` (its piece)."""
    assert owned.holders is not None
    device = str(value.device)
    shards = [
        ShardMetadata([first], [size], f"rank:{rank}/{device}")
        for rank, first, size in owned.holders
    ]
    mine = ShardMetadata([owned.first], [owned.numel], f"rank:{dist.get_rank()}/{device}")
    meta = ShardedTensorMetadata(shards, torch.Size([numel]), TensorProperties(dtype=value.dtype))
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        [Shard(value, mine)], meta, process_group=group
    )


def state_dict_of(
    opt: torch.optim.Optimizer, apply: ApplyStrategy, iterations: int, group: Any
) -> dict[str, Any]:
    """This rank's per-rank state dict (the format above; local, no communication).

    ``group``: the replicas' process group (None: the default one), in which the pieces of a
    sharded entry live.
    """
    index = {id(p): i for i, p in enumerate(_params(opt))}
    state: dict[str, dict[str, Any]] = {}
    for p, owned in apply.owned().items():
        entry: dict[str, Any] = dict(owned.scalars)
        for key, value in owned.elements.items():
            entry[key] = (
                value if owned.holders is None else _sharded(value, p.numel(), owned, group)
            )
        state[str(index[id(p)])] = entry
    return {HEADER: (FORMAT, iterations, _groups(opt), _layout(opt)), "state": state}


def _type_name(opt: torch.optim.Optimizer) -> str:
    return f"{type(opt).__module__}.{type(opt).__qualname__}"


def _layout(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The header's layout: the wrapped optimizer's type, every parameter's shape, and the step
    counts of the wrapped optimizer's chain (a Keras-style one's, whose schedule reads it:
    ``{"wrapped_iterations": n, ...}``, as ``state_dict()`` names them)."""
    return {
        "optimizer": _type_name(opt),
        "shapes": [tuple(p.shape) for p in _params(opt)],
        "counts": wrapped_step_counts(opt),
    }


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """torch's ``state_dict()["param_groups"]`` without packing the state."""
    out, start = [], 0
    for g in opt.param_groups:
        saved = {k: v for k, v in g.items() if k != "params"}
        saved["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        out.append(saved)
    return out


def _entries(metadata: Metadata, prefix: str) -> dict[int, dict[str, Any]]:
    """The saved state entries by parameter index: key -> storage metadata."""
    head = f"{prefix}state."
    out: dict[int, dict[str, Any]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(head):
            continue
        index, _, key = fqn[len(head) :].partition(".")
        if not index.isdigit() or not key:
            raise ValueError(f"per-rank optimizer checkpoint: unexpected entry {fqn!r}")
        out.setdefault(int(index), {})[key] = md
    return out


def template_of(
    opt: torch.optim.Optimizer, apply: ApplyStrategy, metadata: Metadata, prefix: str, group: Any
) -> dict[str, Any]:
    """What this rank asks DCP to load: its own pieces in its current layout (local).

    ``prefix``: where the optimizer's entries sit in the checkpoint (``""`` at the top, or
    ``"optim."`` for ``{"optim": opt.sharded_state_dict()}``). Raises ``ValueError`` if the
    checkpoint is not one of these, or does not fit the optimizer's parameters.
    """
    if f"{prefix}{HEADER}" not in metadata.state_dict_metadata:
        where = f" under {prefix[:-1]!r}" if prefix else ""
        raise ValueError(
            f"not a per-rank CrossShardOptimizer checkpoint{where}: no {HEADER!r} entry "
            f"(saved keys start with {sorted(metadata.state_dict_metadata)[:3]}...)"
        )
    params = _params(opt)
    entries = _entries(metadata, prefix)
    if entries and max(entries) >= len(params):
        raise ValueError(
            f"per-rank optimizer checkpoint: state for parameter {max(entries)}, but the "
            f"optimizer has {len(params)} parameters"
        )
    slots = apply.slots([params[i] for i in entries])
    state: dict[str, dict[str, Any]] = {}
    for i, keys in entries.items():
        p = params[i]
        owned = slots.get(p)
        if owned is None:
            continue  # this rank holds no piece of it
        entry: dict[str, Any] = {}
        for key, md in keys.items():
            if isinstance(md, BytesStorageMetadata):
                entry[key] = None  # a Python value: DCP puts it here
                continue
            assert isinstance(md, TensorStorageMetadata)
            if _per_element(md.size, p):
                piece = torch.empty(owned.numel, dtype=md.properties.dtype, device=p.device)
                entry[key] = (
                    piece if owned.holders is None else _sharded(piece, p.numel(), owned, group)
                )
            elif owned.holders is not None and len(md.size) > 0:
                raise ValueError(
                    f"per-rank optimizer checkpoint: state {key!r} of parameter {i} has shape "
                    f"{tuple(md.size)}: neither one value per element of the parameter "
                    f"({p.numel()} elements, shape {tuple(p.shape)}) nor a scalar, so it "
                    "cannot be sharded -- a checkpoint of another model or optimizer?"
                )
            else:
                entry[key] = torch.empty(md.size, dtype=md.properties.dtype, device=p.device)
        state[str(i)] = entry
    return {HEADER: None, "state": state}


def _per_element(size: torch.Size, p: torch.Tensor) -> bool:
    """Per-element state is saved as a 1-D tensor of ``p.numel()`` elements; scalars (torch's
    are 0-dim) and any other state keep their shape."""
    return len(size) == 1 and size[0] == p.numel()


def check_fit(
    opt: torch.optim.Optimizer,
    header: Any,
    saved_keys: dict[int, set[str]],
    held: dict[torch.Tensor, set[str]],
) -> tuple[int, list[dict[str, Any]]]:
    """``(iterations, param_groups)`` of a loaded header, after checking that it fits ``opt``.

    ``saved_keys``: the state keys saved per parameter index (from the checkpoint's metadata);
    ``held``: the state keys ``opt`` holds now, by parameter (those without state left out).
    Raises ``ValueError`` naming the first difference: the format, the optimizer type, a param
    group's size or hyperparameter keys, a parameter's shape, a parameter's state keys.
    Changes nothing.
    """
    ok = isinstance(header, tuple) and (
        (len(header) == 4 and header[0] == FORMAT) or (len(header) == 3 and header[0] == _FORMAT_1)
    )
    if not ok:
        raise ValueError(
            f"per-rank optimizer checkpoint: header {str(header)[:80]!r} is not {FORMAT!r}"
        )
    iterations, groups = header[1], header[2]
    layout = header[3] if len(header) == 4 else None
    mine = _type_name(opt)
    if layout is not None and layout.get("optimizer") != mine:
        raise ValueError(
            f"per-rank optimizer checkpoint of a {layout.get('optimizer')}, but this "
            f"CrossShardOptimizer wraps a {mine}: its state and hyperparameters would not fit"
        )
    if not isinstance(groups, list) or len(groups) != len(opt.param_groups):
        count = len(groups) if isinstance(groups, list) else groups
        raise ValueError(
            f"per-rank optimizer checkpoint: {count} param groups saved, the wrapped {mine} "
            f"has {len(opt.param_groups)}"
        )
    for i, (saved, group) in enumerate(zip(groups, opt.param_groups)):
        theirs, ours = set(saved) - {"params"}, set(group) - {"params"}
        if theirs != ours:
            raise ValueError(
                f"per-rank optimizer checkpoint: param group {i} has the hyperparameters "
                f"{sorted(theirs)}, the wrapped {mine}'s {sorted(ours)} (missing: "
                f"{sorted(ours - theirs)}, extra: {sorted(theirs - ours)}) -- a checkpoint of "
                "another optimizer (or torch version)?"
            )
        if len(saved.get("params", ())) != len(group["params"]):
            raise ValueError(
                f"per-rank optimizer checkpoint: param group {i} holds "
                f"{len(saved.get('params', ()))} parameters, the wrapped {mine}'s "
                f"{len(group['params'])}"
            )
    params = _params(opt)
    if layout is not None:
        shapes = [tuple(s) for s in layout.get("shapes", ())]
        wrong = [
            f"parameter {i}: saved {s}, this optimizer's {tuple(p.shape)}"
            for i, (s, p) in enumerate(zip(shapes, params))
            if s != tuple(p.shape)
        ]
        if len(shapes) != len(params) or wrong:
            raise ValueError(
                f"per-rank optimizer checkpoint: its parameters' shapes are not this "
                f"optimizer's ({len(shapes)} saved, {len(params)} here): "
                f"{'; '.join(wrong[:4]) or 'the counts differ'} -- a checkpoint of another model?"
            )
    for i, keys in sorted(saved_keys.items()):
        if i < len(params) and params[i] in held and held[params[i]] != keys:
            raise ValueError(
                f"per-rank optimizer checkpoint: parameter {i} (shape "
                f"{tuple(params[i].shape)}) has the saved state keys {sorted(keys)}, this "
                f"optimizer's state has {sorted(held[params[i]])}"
            )
    return iterations, groups


def loaded_state(opt: torch.optim.Optimizer, loaded: dict[str, Any]) -> dict[torch.Tensor, Owned]:
    """The owned pieces, by parameter, from a template DCP filled (local)."""
    params = _params(opt)
    out: dict[torch.Tensor, Owned] = {}
    for index, entry in loaded["state"].items():
        p = params[int(index)]
        owned = Owned(0, p.numel())
        for key, value in entry.items():
            if isinstance(value, ShardedTensor):
                (shard,) = value.local_shards()
                owned.first, owned.numel = shard.metadata.shard_offsets[0], shard.tensor.numel()
                owned.elements[key] = shard.tensor
            elif isinstance(value, torch.Tensor) and _per_element(value.shape, p):
                owned.elements[key] = value
            else:
                owned.scalars[key] = value
        out[p] = owned
    return out


def read(
    opt: torch.optim.Optimizer, apply: ApplyStrategy, group: Any, checkpoint_id: Any, prefix: str
) -> tuple[int, list[dict[str, Any]], dict[str, int], dict[torch.Tensor, Owned]]:
    """DCP-load this rank's part (:func:`template_of`) of the checkpoint at ``checkpoint_id``,
    saved under ``prefix`` (``""`` or ``"optim"``, ...): ``(iterations, param_groups, the
    wrapped chain's step counts, owned pieces)``, after :func:`check_fit` and
    :func:`saved_counts`.

    Every rank calls it (DCP's collectives); nothing of the optimizer changes here.
    """
    import torch.distributed.checkpoint as dcp

    where = dotted(prefix)
    with dcp_errors("load", checkpoint_id):
        metadata = dcp.FileSystemReader(checkpoint_id).read_metadata()
    nested = nest(template_of(opt, apply, metadata, where, group), where)
    with dcp_errors("load", checkpoint_id, metadata):
        dcp.load(nested, checkpoint_id=checkpoint_id)
    loaded = unnest(nested, where)
    saved_keys = {i: set(keys) for i, keys in _entries(metadata, where).items()}
    held = {p: set(o.elements) | set(o.scalars) for p, o in apply.owned().items()}
    iterations, groups = check_fit(opt, loaded[HEADER], saved_keys, held)
    return iterations, groups, saved_counts(opt, loaded[HEADER]), loaded_state(opt, loaded)


def saved_counts(opt: torch.optim.Optimizer, header: tuple[Any, ...]) -> dict[str, int]:
    """The step counts of the wrapped optimizer's chain a (checked) header holds, keyed as
    ``state_dict()`` names them (``{}`` for a checkpoint saved before they were, or of a plain
    torch optimizer). ``ValueError`` when one is not an int >= 0 or names a level ``opt``'s
    chain does not have. Changes nothing."""
    layout = header[3] if len(header) == 4 else {}
    counts = layout.get("counts", {}) if isinstance(layout, dict) else {}
    mine = wrapped_step_counts(opt)
    for key, count in counts.items() if isinstance(counts, dict) else [("counts", counts)]:
        if key not in mine or not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(
                f"per-rank optimizer checkpoint: step count {key!r} = {count!r} does not fit the "
                f"wrapped {_type_name(opt)}, whose chain keeps {sorted(mine) or 'none'} (ints >= 0)"
            )
    return dict(counts)


def nest(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``state`` under the dotted ``prefix`` (``"a.b."`` -> ``{"a": {"b": state}}``)."""
    for part in reversed([x for x in prefix.split(".") if x]):
        state = {part: state}
    return state


def unnest(state: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The inverse of :func:`nest`."""
    for part in (x for x in prefix.split(".") if x):
        state = state[part]
    return state


def dotted(prefix: str) -> str:
    """``"optim"`` -> ``"optim."`` (``""`` stays ``""``): how DCP names nested entries."""
    return f"{prefix.rstrip('.')}." if prefix else ""
