"""The pieces of a 4-rank spawn of 2 replica groups x 2 processes that several test modules
build alike (tests/test_cross_shard_groups.py, tests/outer/test_groups.py,
tests/ft/test_cross_shard_hsdp.py): the 2-D device mesh, FSDP2 sharding inside a group, the
gathered model, one torchft manager per process, and the record of what a construction or a
first round raised. Spawned children import this module, so it is importable on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

GROUPS, PER_GROUP = 2, 2

_MESHES: dict[str, Any] = {}  # per process: each mesh made once (making one is collective)


def mesh(inner: str = "shard") -> Any:
    """The ``(GROUPS, PER_GROUP)`` CPU mesh with dimensions ``("replicate", inner)``."""
    from torch.distributed.device_mesh import init_device_mesh

    if inner not in _MESHES:
        _MESHES[inner] = init_device_mesh(
            "cpu", (GROUPS, PER_GROUP), mesh_dim_names=("replicate", inner)
        )
    return _MESHES[inner]


def shard(model: nn.Module, over: Any) -> nn.Module:
    """FSDP2 on ``model[0]``, ``model[2]`` and the whole ``model``, over the mesh ``over``."""
    from torch.distributed.fsdp import fully_shard

    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=over)
    return fully_shard(model, mesh=over)


def full(model: nn.Module) -> torch.Tensor:
    """Every parameter gathered whole (a collective over the mesh for DTensors), flattened."""
    out = []
    for p in model.parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(whole.detach().reshape(-1).clone())
    return torch.cat(out)


def raised(fn: Callable[[], object], *kinds: type[BaseException]) -> str:
    """What ``fn()`` raised of ``kinds``, as ``"TypeName: message"``; ``"no error"`` if it
    raised nothing (anything else propagates)."""
    try:
        fn()
    except kinds as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


class Attempts:
    """Constructions a test expects refused: ``attempt(key, fn)`` keeps what ``fn()`` raised
    (a TypeError or ValueError) under ``key`` in ``attempt.said``."""

    def __init__(self) -> None:
        self.said: dict[str, str] = {}

    def __call__(self, key: str, fn: Callable[[], object]) -> None:
        self.said[key] = raised(fn, TypeError, ValueError)


def laid_out_per_group(model: nn.Module, fsdp: Callable[[nn.Module], object]) -> nn.Module:
    """``model`` as group 0 shards it (``fsdp(model)``, FSDP2 over ``mesh()["shard"]``) and
    group 1 (tensor parallelism over the same dimension): counterparts hold pieces of other
    shapes."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if dist.get_rank() < PER_GROUP:
        fsdp(model)
        return model
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(model, mesh()["shard"], plan)


def group_manager(rank: int, world: int, lighthouse: str, **options: Any) -> tuple[Any, Any]:
    """A torchft manager for this process of its replica group (``group{rank // PER_GROUP}``,
    group rank ``rank % PER_GROUP``) over the group's own TCPStore, which its group rank 0
    hosts; returns ``(manager, store)`` -- keep the store (``None`` off rank 0) alive while the
    manager runs. ``options`` go to ``make_manager`` after the defaults."""
    from distoptim.ft import make_manager

    group, j = rank // PER_GROUP, rank % PER_GROUP
    store = (
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if j == 0 else None
    )
    ports: list[Any] = [None] * world
    dist.all_gather_object(ports, store.port if store is not None else None)
    kwargs: dict[str, Any] = {
        "replica_id": f"group{group}",
        "state_dict": lambda: {},
        "load_state_dict": lambda _: None,
        "min_replica_size": GROUPS,
        "rank": j,
        "world_size": PER_GROUP,
        "store_addr": "127.0.0.1",
        "store_port": ports[group * PER_GROUP],
        "init_sync": False,
        "timeout": 60.0,
        "quorum_timeout": 120.0,
    }
    kwargs.update(options)
    return make_manager(lighthouse, **kwargs), store
