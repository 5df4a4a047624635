"""Benchmark: replica groups of FSDP2 shards: DiLoCo's state, bytes and step time; HSDP's bytes.

2 replica groups of ``k`` processes each (gloo, CPU): the model is ``fully_shard``-ed over its
group's 1-D mesh, DiLoCo (Nesterov outer SGD, ``int8`` wire so error-feedback residuals exist,
and ``fp32``) runs across the groups over ``group=mesh``. Per process it records

* the **outer state** in live storage: the distinct storages of the global copy, the outer
  optimizer's state and the error-feedback residuals (bytes, each storage once);
* the **bytes sent per sync** (``comm_stats.bytes_sent`` over one sync, headers included);
* the **bytes sent per step by CrossShard over FSDP2** (HSDP: ``CrossShardOptimizer(SGD,
  group=mesh)`` averaging each process's shard of the gradient with its counterparts), the
  steps after the first, beside the ring all-reduce of a ``1/k`` shard,
  ``(1/k)·(n-1)/n·2·P·4`` bytes (``n`` groups, ``P`` parameters, fp32).

In the 2 x 2 spawn, a torchft lighthouse in this process and one manager per process
(``use_async_quorum=False``, which torchft's DiLoCo requires), it also times **DiLoCo over
FSDP2 against torchft's own** ``local_sgd.DiLoCo`` on the same FSDP2 model (the same seeded
model, inner SGD, outer Nesterov, data, ``sync_every``; one manager per process shared by the
two, which step through whole sync cycles in turn): blocks of ``sync_every`` steps from the end
of one sync to the end of the next, the contenders' order shuffled per repetition (the same
order on every rank), after one untimed cycle each. A block's wall time is the slowest
process's, its CPU time all four processes' (every thread, the manager's included); the paired
ratio is the median of the per-block ratios (goal <= 1.0), and the load is recorded as the
timed blocks start and end.

``k = 1`` (each group one process holding the whole model, over the same cross-group pairs of
the 4-process run, interleaved with ``k = 2`` wire by wire) is the unsharded baseline; the
printed ratios are ``k``'s figure over the baseline's (expected ``1/k``). These are counts,
not timings, so they do not depend on load; the load is recorded anyway.

Usage::

    python benchmarks/groups.py            # k = 1, 2 (4 processes), 4 (8), a 1.1 M-param MLP
    python benchmarks/groups.py --quick    # k = 1, 2 in one 4-process spawn, a tiny MLP, 2 blocks
    python benchmarks/groups.py --blocks 20 --sync-every 20 --profile ours   # cProfile rank 0

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
HSDP_STEPS = 3
CONTENDERS = ("ours", "torchft")


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
    from distoptim.outer import DiLoCo

    model = _mlp(width, k, mesh)
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


def _mlp(width: int, k: int, mesh: Any) -> nn.Module:
    """The seeded MLP, ``fully_shard``-ed over ``mesh["shard"]`` (each layer, then the root)
    when ``k > 1``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
    if k > 1:
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
    return model


def _hsdp_bytes(mesh: Any, k: int, width: int, rank: int) -> dict[str, Any]:
    """CrossShard across the groups: over FSDP2 shards with ``group=mesh`` when ``k > 1``
    (HSDP), the whole model over ``mesh["replicate"]`` when ``k = 1``; the bytes of each of
    :data:`HSDP_STEPS` steps (the first adds the parameter-list agreement)."""
    from distoptim import CrossShardOptimizer

    model = _mlp(width, k, mesh)
    opt = CrossShardOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), group=mesh if k > 1 else mesh["replicate"]
    )
    g = torch.Generator().manual_seed(rank)
    per_step = []
    for _ in range(HSDP_STEPS):
        x = torch.randn(8, width, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), x).backward()
        before = opt.comm_stats.bytes_sent
        opt.step()
        per_step.append(opt.comm_stats.bytes_sent - before)
    opt.finish()
    buckets = opt.bucket_plan.buckets
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "per_step": per_step,
        "payload": sum(b.payload_bytes for b in buckets),
        "bucket_bytes": sum(
            b.size * torch.empty((), dtype=b.dtype).element_size() for b in buckets
        ),
    }


def _manager(rank: int, k: int, lighthouse: str) -> tuple[Any, Any]:
    """This process's torchft manager: replica group ``rank // k`` of ``k`` processes, its
    store on the group's first process (as ``tests/outer/test_groups.py`` sets them up)."""
    import torch.distributed as dist

    from distoptim.ft import make_manager

    group, j = rank // k, rank % k
    store = (
        dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if j == 0 else None
    )
    ports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ports, store.port if store is not None else None)
    manager = make_manager(
        lighthouse,
        replica_id=f"group{group}",
        state_dict=lambda: {},
        load_state_dict=lambda _: None,
        min_replica_size=GROUPS,
        rank=j,
        world_size=k,
        store_addr="127.0.0.1",
        store_port=ports[group * k],
        use_async_quorum=False,  # torchft's DiLoCo requires it
        init_sync=False,  # identically seeded models
        timeout=60.0,
        quorum_timeout=120.0,
    )
    return manager, store  # the store must outlive the manager


def _vs_torchft(mesh: Any, k: int, rank: int, lighthouse: str, cfg: dict[str, Any]) -> Any:
    """DiLoCo(manager=) and torchft's ``local_sgd.DiLoCo`` on the same FSDP2 model, in timed
    blocks of ``sync_every`` steps (a sync ends each), shuffled per repetition."""
    import os
    import random
    import time

    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    from distoptim.outer import DiLoCo
    from distoptim.outer.groups import local_view

    every, width = cfg["sync_every"], cfg["width"]
    manager, _store = _manager(rank, k, lighthouse)
    g = torch.Generator().manual_seed(rank)
    xs = torch.randn(4, cfg["batch"], width, generator=g)
    models, opts, theirs = {}, {}, None
    for name in CONTENDERS:
        models[name] = _mlp(width, k, mesh)
        inner = torch.optim.SGD(models[name].parameters(), lr=0.01)
        outer = torch.optim.SGD(models[name].parameters(), lr=0.7, momentum=0.9, nesterov=True)
        if name == "ours":
            opts[name] = DiLoCo(inner, outer, every, manager=manager)
        else:
            theirs = TorchftDiLoCo(manager, [models[name]], inner, outer, sync_every=every)
            theirs.__enter__()
            opts[name] = inner
    profiler = None
    if cfg.get("profile") and rank == 0:
        import cProfile

        profiler = cProfile.Profile()

    def cycle(name: str, profiled: bool = False) -> None:
        model, opt = models[name], opts[name]
        for t in range(every):
            opt.zero_grad()
            F.mse_loss(model(xs[t % 4]), xs[t % 4]).backward()
            if profiled:
                profiler.runcall(opt.step)
            else:
                opt.step()

    out: dict[str, Any] = {"wall": {n: [] for n in CONTENDERS}, "cpu": {n: [] for n in CONTENDERS}}
    try:
        for name in CONTENDERS:
            cycle(name)  # untimed: the first sync (its quorum, the outer state's first step)
        out["load_start"] = [round(x, 2) for x in os.getloadavg()]
        for rep in range(cfg["blocks"]):
            order = list(CONTENDERS)
            random.Random(rep).shuffle(order)  # the same order on every rank
            for name in order:
                began, cpu = time.perf_counter(), time.process_time()
                cycle(name, profiler is not None and name == cfg["profile"])
                out["wall"][name].append((time.perf_counter() - began) / every)
                out["cpu"][name].append((time.process_time() - cpu) / every)
        out["load_end"] = [round(x, 2) for x in os.getloadavg()]
        # the same cycles on the same data: the two models should be one (the test's bitwise)
        pairs = zip(models["ours"].parameters(), models["torchft"].parameters())
        out["max_abs_diff"] = max(
            (local_view(a) - local_view(b)).abs().max().item() for a, b in pairs
        )
    finally:
        if theirs is not None:
            theirs.__exit__(None, None, None)
        manager.shutdown(wait=False)
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        out["profile"] = text.getvalue()
    return out


def _measure(
    rank: int, world: int, width: int, base: bool, lighthouse: str | None, cfg: dict[str, Any]
) -> dict[Any, Any]:
    """Every wire at this world's ``k`` (and, with ``base``, at ``k = 1``, unsharded models
    over the same cross-group pairs), interleaved wire by wire; CrossShard's bytes at the same
    ``k``s; with a ``lighthouse``, DiLoCo against torchft's on FSDP2 (``k`` of this world)."""
    from torch.distributed.device_mesh import init_device_mesh

    k = world // GROUPS
    mesh = init_device_mesh("cpu", (GROUPS, k), mesh_dim_names=("replicate", "shard"))
    out: dict[Any, Any] = {}
    for wire in WIRES:
        for run_k in ([1] if base else []) + [k]:
            out[wire, run_k] = _one(mesh, run_k, width, wire, rank)
    for run_k in ([1] if base else []) + [k]:
        out["hsdp", run_k] = _hsdp_bytes(mesh, run_k, width, rank)
    if lighthouse is not None:
        out["vs_torchft"] = _vs_torchft(mesh, k, rank, lighthouse, cfg)
    return out


def _hsdp_rows(measured: dict[Any, list[dict[str, Any]]], ks: list[int]) -> list[dict[str, Any]]:
    """CrossShard's bytes per process per step (the steps after the first) beside the ring
    all-reduce of a 1/k shard, ``(1/k)(n-1)/n 2 P 4``, and over the unsharded (k = 1) figure."""
    from distoptim.comm.stats import ring_allreduce_bytes

    base = measured["hsdp", 1][0]
    rows = []
    for k in [1, *ks]:
        per_rank = measured["hsdp", k]
        mine = per_rank[0]
        steady = sorted({b for r in per_rank for b in r["per_step"][1:]})  # every rank's
        goal = (1 / k) * (GROUPS - 1) / GROUPS * 2 * mine["params"] * 4
        fixed = mine["bucket_bytes"] - mine["payload"]  # the buckets' flags and sequence words
        row = {
            "k": k,
            "params": mine["params"],
            "bytes_per_step": mine["per_step"][1],
            "first_step": mine["per_step"][0],
            "steady_over_ranks": steady,
            "goal_bytes": goal,
            "ratio_to_goal": mine["per_step"][1] / goal,
            "ratio_to_k1": mine["per_step"][1] / base["per_step"][1],
            "payload": mine["payload"],
            "fixed_words": fixed,
            "ring_of_buckets": ring_allreduce_bytes(mine["bucket_bytes"], GROUPS),
        }
        rows.append(row)
        print(
            f"CrossShard over FSDP2 k={k}: {row['bytes_per_step']:>9,} B per process per step "
            f"(every rank {steady}); goal (1/k)(n-1)/n 2P4 = {goal:>11,.0f} B: "
            f"{row['ratio_to_goal']:.4f}x of it, {row['ratio_to_k1']:.3f}x of k=1 "
            f"(over it: the ring of the buckets' {fixed} B of flags and sequence words)",
            flush=True,
        )
    return rows


def _timing(outs: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """The paired figures of DiLoCo against torchft's: per block, wall = the slowest process's,
    CPU = all processes' summed; ratios ours / theirs, their median."""
    import statistics

    runs = [o["vs_torchft"] for o in outs]
    blocks = cfg["blocks"]
    wall = {n: [max(r["wall"][n][b] for r in runs) for b in range(blocks)] for n in CONTENDERS}
    cpu = {n: [sum(r["cpu"][n][b] for r in runs) for b in range(blocks)] for n in CONTENDERS}
    ratios = [a / b for a, b in zip(wall["ours"], wall["torchft"])]
    cpu_ratios = [a / b for a, b in zip(cpu["ours"], cpu["torchft"])]
    out = {
        "config": cfg,
        "load_start": runs[0]["load_start"],
        "load_end": runs[0]["load_end"],
        "wall_ms_per_step": {n: 1000 * statistics.median(v) for n, v in wall.items()},
        "cpu_ms_per_step_all_processes": {n: 1000 * statistics.median(v) for n, v in cpu.items()},
        "paired_ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "cpu_paired_ratios": cpu_ratios,
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "goal_ratio": 1.0,
        "goal_met": statistics.median(ratios) <= 1.0,
        "max_abs_diff_ours_vs_torchft": max(r["max_abs_diff"] for r in runs),
    }
    if runs[0].get("profile"):
        out["profile"] = runs[0]["profile"]
    w, c = out["wall_ms_per_step"], out["cpu_ms_per_step_all_processes"]
    print(
        f"DiLoCo over FSDP2 vs torchft's DiLoCo ({GROUPS} groups x 2, H={cfg['sync_every']}, "
        f"{blocks} blocks): wall {w['ours']:.2f} vs {w['torchft']:.2f} ms per step, paired "
        f"{out['ratio_median']:.3f} (goal <= 1.0; blocks "
        f"{' '.join(f'{r:.2f}' for r in ratios)}); CPU {c['ours']:.2f} vs {c['torchft']:.2f} ms, "
        f"paired {out['cpu_ratio_median']:.3f}; load {out['load_start']} -> {out['load_end']}; "
        f"models differ by {out['max_abs_diff_ours_vs_torchft']:.3g}",
        flush=True,
    )
    return out


def main() -> None:
    bench = Bench(__file__, __doc__, quick="k = 1, 2, a tiny model, 2 timed blocks of 2 steps")
    bench.parser.add_argument("--blocks", type=int, default=20, help="timed blocks per contender")
    bench.parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H when timed")
    bench.parser.add_argument("--batch", type=int, default=32, help="rows per process per step")
    bench.parser.add_argument(
        "--profile", choices=CONTENDERS, default=None, help="cProfile this contender's steps"
    )
    args = bench.parse()
    ks = [2] if args.quick else [2, 4]
    width = 64 if args.quick else 736  # 736: 2 x (736^2 + 736) ≈ 1.08 M parameters
    cfg = {
        "width": width,
        "blocks": 2 if args.quick else args.blocks,
        "sync_every": 2 if args.quick else args.sync_every,
        "batch": 8 if args.quick else args.batch,
        "profile": args.profile,
    }
    runs: dict[str, Any] = {"width": width, "rows": []}
    measured: dict[Any, list[dict[str, Any]]] = {}
    for k in ks:  # one spawn per world size; k = 1 and the timing inside the first
        if k == 2:
            from distoptim.ft.lighthouse import Lighthouse

            with Lighthouse(min_replicas=GROUPS) as lighthouse:
                outs = spawn(
                    _measure, GROUPS * k, args=(width, True, lighthouse.address, cfg), timeout=900
                )
            runs["vs_torchft"] = _timing(outs, cfg)
        else:
            outs = spawn(_measure, GROUPS * k, args=(width, False, None, cfg), timeout=900)
        for key in outs[0]:
            if key != "vs_torchft":
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
    runs["hsdp"] = _hsdp_rows(measured, ks)
    if runs["vs_torchft"].get("profile"):
        print(runs["vs_torchft"]["profile"])
    bench.save(runs)


if __name__ == "__main__":
    main()
