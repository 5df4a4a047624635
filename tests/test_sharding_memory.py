"""Weight-update sharding keeps less memory than the unsharded optimizer: counted as a user would.

After a few steps, every live floating-point tensor storage of the process is counted once
(deduplicated by storage), the parameters' and the gradients' storages excluded: what is left is
the optimizer's state and whatever working buffers the optimizer keeps between steps. With
``shard_optimizer_state=True`` on ``n`` ranks the state is ``1/n`` of the unsharded state, so
sharding must save at least 80 % of ``(1 - 1/n)`` of the unsharded state, compared with the
unsharded optimizer with ``.grad`` as bucket views on both sides (the leanest unsharded run):
no full-size flat buffer may stay behind. Adam (two moments) and momentum SGD (one), ``n`` = 2
and 4, gloo.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distoptim import CrossShardOptimizer
from distoptim.launch import spawn

STEPS = 3
SAVED_SHARE = 0.8
"""Sharding saves at least this share of ``(1 - 1/n)`` of the unsharded state."""


def _model() -> nn.Module:
    torch.manual_seed(0)  # 5,281 parameters in 6 tensors
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 48), nn.Tanh(),
                         nn.Linear(48, 1))  # fmt: skip


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "Adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True)


def live_float_elements(exclude: set[int]) -> int:
    """Elements of every live floating-point tensor storage, once per storage, except the
    storages whose data pointers are in ``exclude``."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in exclude and storage.nbytes():
                seen[ptr] = storage.nbytes() // obj.element_size()
    return sum(seen.values())


def _measure(rank: int, name: str, shard: bool) -> tuple[int, int]:
    """(live float elements beyond parameters and gradients, state elements) after STEPS."""
    model = _model()
    opt = CrossShardOptimizer(
        _optimizer(name, model.parameters()),
        shard_optimizer_state=shard,
        gradient_as_bucket_view=True,
    )
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    del x, y
    params = list(model.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    exclude |= {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
    live = live_float_elements(exclude)
    state = 0
    if not shard:
        state = sum(
            v.numel() for s in opt.wrapped.state.values() for v in s.values() if v.dim() > 0
        )
    opt.remove_hooks()
    return live, state


def _memory(rank: int, world: int) -> dict[str, tuple[int, int]]:
    warnings.simplefilter("ignore")  # torch's own deprecation notes
    out = {}
    for name in ("Adam", "SGD"):
        for shard in (False, True):
            out[f"{name}/{shard}"] = _measure(rank, name, shard)
            gc.collect()
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_sharding_saves_its_share_of_the_state(world: int) -> None:
    for out in spawn(_memory, world, timeout=240):
        for name in ("Adam", "SGD"):
            unsharded, state = out[f"{name}/False"]
            sharded, _ = out[f"{name}/True"]
            want = SAVED_SHARE * (1 - 1 / world) * state
            saved = unsharded - sharded
            assert saved >= want, (
                f"{name}, {world} ranks: sharding keeps {sharded} float elements beyond "
                f"parameters and gradients, the unsharded optimizer {unsharded} (state {state}): "
                f"saves {saved}, want >= {want:.0f}"
            )
