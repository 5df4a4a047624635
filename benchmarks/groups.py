"""Benchmark: per-process outer-state memory and bytes per sync of DiLoCo over FSDP2 groups.

2 replica groups of ``k`` processes each (gloo, CPU): the model is ``fully_shard``-ed over its
group's 1-D mesh, DiLoCo (Nesterov outer SGD, ``int8`` wire so error-feedback residuals exist,
and ``fp32``) runs across the groups over ``group=mesh``. Per process it records

* the **outer state** in live storage: the distinct storages of the global copy, the outer
  optimizer's state and the error-feedback residuals (bytes, each storage once);
* the **bytes sent per sync** (``comm_stats.bytes_sent`` over one sync, headers included).

``k = 1`` (each group one process holding the whole model, over the same cross-group pairs of
the 4-process run, interleaved with ``k = 2`` wire by wire) is the unsharded baseline; the
printed ratios are ``k``'s figure over the baseline's (expected ``1/k``). These are counts,
not timings, so they do not depend on load; the load is recorded anyway.

Usage::

    python benchmarks/groups.py            # k = 1, 2 (4 processes), 4 (8), a 1.1 M-param MLP
    python benchmarks/groups.py --quick    # k = 1, 2 in one 4-process spawn, a tiny MLP

Writes ``benchmarks/results/groups.json`` (``results/quick/groups.json`` with ``--quick``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from _common import Bench
from torch import nn

from distoptim.launch import spawn

GROUPS = 2
H = 2
WIRES = ("fp32", "int8")


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    from distoptim.outer.groups import local_view

    seen: dict[int, int] = {}
    for t in tensors:
        storage = local_view(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _one(mesh: Any, k: int, width: int, wire: str, rank: int) -> dict[str, int]:
    """One DiLoCo over the model, sharded over ``mesh["shard"]`` when ``k > 1`` (``k = 1``:
    plain, each process a one-process group averaging with its counterpart). The ranks import
    FSDP and ``distoptim.outer`` here, not at the top: the parent, which only launches and
    prints, would pay a second of CPU for them."""
    from torch.distributed.fsdp import fully_shard

    from distoptim.outer import DiLoCo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    if k > 1:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    opt = DiLoCo(inner, outer, H, wire=wire, group=mesh["replicate"])
    g = torch.Generator().manual_seed(rank)
    before = 0
    for t in range(H):
        if t == H - 1:
            before = opt.comm_stats.bytes_sent
        x = torch.randn(8, width, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        opt.step()
    residuals = [v for e in opt._exchanges for r in e.residuals for v in r.values()]
    outer_state = [v for s in opt.outer.state.values() for v in s.values() if v.dim() > 0]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "global_copy": _storage_bytes(list(opt.global_parameters)),
        "outer_state": _storage_bytes(outer_state),
        "residuals": _storage_bytes(residuals),
        "bytes_per_sync": opt.comm_stats.bytes_sent - before,
    }


def _measure(rank: int, world: int, width: int, base: bool) -> dict[Any, dict[str, int]]:
    """Every wire at this world's ``k`` (and, with ``base``, at ``k = 1``, unsharded models
    over the same cross-group pairs), interleaved wire by wire."""
    from torch.distributed.device_mesh import init_device_mesh

    k = world // GROUPS
    mesh = init_device_mesh("cpu", (GROUPS, k), mesh_dim_names=("replicate", "shard"))
    out: dict[Any, dict[str, int]] = {}
    for wire in WIRES:
        for run_k in ([1] if base else []) + [k]:
            out[wire, run_k] = _one(mesh, run_k, width, wire, rank)
    return out


def main() -> None:
    bench = Bench(__file__, __doc__, quick="k = 1, 2 and a tiny model")
    args = bench.parse()
    ks = [2] if args.quick else [2, 4]
    width = 64 if args.quick else 736  # 736: 2 x (736^2 + 736) ≈ 1.08 M parameters
    runs: dict[str, Any] = {"width": width, "rows": []}
    measured: dict[Any, list[dict[str, int]]] = {}
    for k in ks:  # one spawn per world size; k = 1 inside the first
        outs = spawn(_measure, GROUPS * k, args=(width, k == ks[0]), timeout=900)
        for key in outs[0]:
            measured[key] = [o[key] for o in outs]  # every rank's own figures
    for wire in WIRES:
        base = measured[wire, 1][0]
        base_state = base["global_copy"] + base["outer_state"] + base["residuals"]
        for k in [1, *ks]:
            rows = measured[wire, k]
            mine = rows[0]
            state = mine["global_copy"] + mine["outer_state"] + mine["residuals"]
            keys = ("outer_state", "bytes_per_sync")
            row = {
                "wire": wire,
                "k": k,
                **mine,
                "outer_total": state,
                "state_ratio": state / base_state,
                "bytes_ratio": mine["bytes_per_sync"] / base["bytes_per_sync"],
                "spread_over_ranks": {key: sorted({r[key] for r in rows}) for key in keys},
            }
            runs["rows"].append(row)
            print(
                f"{wire:5s} k={k}: outer state {state:>10,} B per process "
                f"(global {mine['global_copy']:,}, outer {mine['outer_state']:,}, residuals "
                f"{mine['residuals']:,}) = {row['state_ratio']:.3f}x of k=1 (1/k = {1 / k:.3f}); "
                f"bytes per sync {mine['bytes_per_sync']:>9,} = {row['bytes_ratio']:.3f}x",
                flush=True,
            )
    bench.save(runs)


if __name__ == "__main__":
    main()
