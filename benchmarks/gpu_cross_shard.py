"""One CUDA GPU: the local update cost of weight-update sharding against DDP and ZeRO, world 1.

One GPU is a world of one: nothing is reduced or gathered across devices, so what this measures
honestly is the *local* cost of each way of updating a model -- how long the optimizer part of
a step takes and how much state and memory it keeps -- in fp32 and bf16 (``--dtypes``). A
world-1 process group (NCCL, gloo where NCCL is missing) lets DDP and
``ZeroRedundancyOptimizer`` run as they would on many GPUs. Contenders, all with
``torch.optim.Adam`` (``lr=1e-3``) on the same MLP from the same weights and data:

* ``adam`` / ``adam_fused``      -- plain torch Adam (foreach, fused), no wrapper: the floor;
* ``ddp``                        -- ``DistributedDataParallel`` + Adam;
* ``zero``                       -- DDP + ``ZeroRedundancyOptimizer(Adam)``;
* ``cross_shard``                -- ``CrossShardOptimizer(Adam)`` (one shard);
* ``sharded`` / ``sharded_fused`` -- ``CrossShardOptimizer(Adam, shard_optimizer_state=True)``
  (the flat segments of weight-update sharding; fused Adam in the second);
* ``sharded_views``              -- the same with ``gradient_as_bucket_view=True``.

Per contender: median step time (``zero_grad -> forward -> backward -> step``, synchronized),
median update time (``step()`` alone), optimizer state bytes, the memory the contender keeps
(allocated bytes after two warm-up steps minus before it was built) and the transient peak of
one step (``max_memory_allocated`` above what was allocated before it), and the max abs
parameter difference to ``adam`` (``adam_fused`` for the fused contenders) after the same
steps (0 where the same kernels run on the same values). Steps
are interleaved round-robin in a shuffled order; ratios are medians of paired ratios.

Everything runs under ``--time-limit`` seconds: timing stops early (recorded as ``rounds``)
when the budget runs low, and a hard alarm writes what was measured so far and exits 124.
Writes JSON to ``--out`` (default ``benchmarks/results/cross_shard_gpu.json``); without CUDA it
prints why and exits 0 (writing ``{"skipped": ...}``). ``--quick`` changes the defaults to
:data:`QUICK` -- a model of a few thousand parameters, on the GPU if there is one and on the
CPU otherwise, so the code path runs everywhere (flags given explicitly still win) -- and
writes ``benchmarks/results/quick/cross_shard_gpu.json`` unless ``--out`` says otherwise::

    python benchmarks/gpu_cross_shard.py --time-limit 150
    python benchmarks/gpu_cross_shard.py --quick            # a smoke run: seconds, CPU or GPU
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import Bench, machine
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import CrossShardOptimizer

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUICK = {
    "device": "cuda" if torch.cuda.is_available() else "cpu",
    "width": 32,
    "depth": 2,
    "batch": 4,
    "reps": 3,
    "time_limit": 60.0,
}
"""The defaults ``--quick`` changes: the code path in seconds, not the figures."""
CONTENDERS = [
    "adam",
    "adam_fused",
    "ddp",
    "zero",
    "cross_shard",
    "sharded",
    "sharded_fused",
    "sharded_views",
]


class _OutOfTime(Exception):
    pass


def _model(width: int, depth: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def _build(name: str, model: nn.Module, device: torch.device) -> tuple[nn.Module, Any]:
    fused = {"fused": True} if name.endswith("fused") else {}
    if name.startswith("adam"):
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, **fused)
    if name == "ddp":
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return net, torch.optim.Adam(net.parameters(), lr=1e-3)
    if name == "zero":
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return net, ZeroRedundancyOptimizer(
            net.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "world size 1: behaving as one shard"
        return model, CrossShardOptimizer(
            torch.optim.Adam(model.parameters(), lr=1e-3, **fused),
            shard_optimizer_state=name.startswith("sharded"),
            gradient_as_bucket_view=name.endswith("views"),
        )


def _state_bytes(name: str, opt: Any) -> int:
    if name.startswith("sharded"):
        return opt._apply.update.state_bytes()
    inner = opt.optim if name == "zero" else getattr(opt, "wrapped", opt)
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def run_dtype(args: argparse.Namespace, dtype_name: str, deadline: float) -> dict[str, Any]:
    """Build every contender in ``dtype``, check them, time them interleaved."""
    device = torch.device(args.device)
    dtype = _DTYPES[dtype_name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g).to(device=device, dtype=dtype)
    y = torch.randn(args.batch, args.width, generator=g).to(device=device, dtype=dtype)
    out: dict[str, Any] = {"contenders": {}}
    steps: dict[str, Callable[[], None]] = {}
    updates: dict[str, Callable[[], None]] = {}
    models: dict[str, nn.Module] = {}
    for name in CONTENDERS:
        _sync(device)
        before = _allocated(device)
        model = _model(args.width, args.depth, dtype, device)
        net, opt = _build(name, model, device)

        def backward(net: nn.Module = net, opt: Any = opt) -> None:
            opt.zero_grad()
            F.mse_loss(net(x), y).backward()

        def step(backward: Callable[[], None] = backward, opt: Any = opt) -> None:
            backward()
            opt.step()

        for _ in range(2):  # warm-up: lazy state, bucket rebuilds, flat parameters
            step()
        _sync(device)
        kept = _allocated(device) - before
        backward()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = _allocated(device)
        opt.step()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else 0
        steps[name] = step
        updates[name] = opt.step  # timed after its own backward(), see below
        models[name] = model
        out["contenders"][name] = {
            "state_bytes": _state_bytes(name, opt),
            "kept_bytes": kept,
            "update_peak_bytes": peak,
            "backward": backward,
        }
        if time.perf_counter() > deadline:
            raise _OutOfTime(f"building {name}")

    # the same steps from the same start: each contender ends where plain Adam (fused Adam for
    # the fused ones, whose kernel rounds differently) does -- exactly, for all but ZeRO's bf16
    def flat(model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])

    for name, model in models.items():
        reference = flat(models["adam_fused" if name.endswith("fused") else "adam"])
        out["contenders"][name]["max_abs_diff_vs_adam"] = (
            (flat(model) - reference).abs().max().item()
        )
    # interleaved timing: whole steps, and the update alone (after an untimed backward)
    times: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    upd: dict[str, list[float]] = {n: [] for n in CONTENDERS}
    rounds = 0
    for r in range(args.reps):
        if time.perf_counter() > deadline - 5:
            break
        order = CONTENDERS[:]
        random.Random(r).shuffle(order)
        for name in order:
            _sync(device)
            t0 = time.perf_counter()
            steps[name]()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
            out["contenders"][name]["backward"]()
            _sync(device)
            t0 = time.perf_counter()
            updates[name]()
            _sync(device)
            upd[name].append(time.perf_counter() - t0)
        rounds += 1
    for name in CONTENDERS:
        c = out["contenders"][name]
        del c["backward"]
        if times[name]:
            c["step_median_ms"] = statistics.median(times[name]) * 1e3
            c["update_median_ms"] = statistics.median(upd[name]) * 1e3
    if rounds:
        out["paired_step_vs_ddp"] = {
            n: statistics.median(a / b for a, b in zip(times[n], times["ddp"])) for n in CONTENDERS
        }
        out["paired_update_vs"] = {
            base: {
                n: statistics.median(a / b for a, b in zip(upd[n], upd[base])) for n in CONTENDERS
            }
            for base in ("adam", "ddp", "zero")
        }
    out["rounds"] = rounds
    out["params"] = sum(p.numel() for p in models["adam"].parameters())
    out["tensors"] = len(list(models["adam"].parameters()))
    return out


def main(argv: list[str] | None = None) -> int:
    bench = Bench(
        __file__,
        __doc__,
        quick="a smoke run: a tiny model, on the CPU without CUDA",
        quick_defaults=QUICK,
        name="cross_shard_gpu",
    )
    parser = bench.parser
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(_DTYPES))
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12, help="Linear layers (2 tensors each)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=50, help="timed rounds per dtype at most")
    parser.add_argument("--time-limit", type=float, default=150.0, help="seconds, all dtypes")
    args = bench.parse(argv)
    result: dict[str, Any] = {"settings": vars(args) | {}}
    result["settings"]["out"] = str(args.out)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        message = (
            "benchmarks/gpu_cross_shard.py: no CUDA device (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing measured"
        )
        print(message)
        bench.save({"skipped": message}, indent=2)
        return 0
    start = bench.started

    def write() -> None:
        bench.save(result, indent=2)

    def alarm(signum: int, frame: Any) -> None:
        result["timed_out"] = True
        write()
        print(f"time limit of {args.time_limit} s reached; partial results in {args.out}")
        os._exit(124)

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(args.time_limit) + 10)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        args.device = str(device)
        torch.cuda.set_device(device)
        result["gpu"] = torch.cuda.get_device_name(device)
    backend = "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    result["backend"] = f"{backend}, world size 1"
    result["machine"] = machine()
    result["dtypes"] = {}
    try:
        for dtype_name in args.dtypes:
            per_dtype_deadline = start + args.time_limit * (
                (args.dtypes.index(dtype_name) + 1) / len(args.dtypes)
            )
            try:
                result["dtypes"][dtype_name] = run_dtype(args, dtype_name, per_dtype_deadline)
            except _OutOfTime as exc:
                result["dtypes"][dtype_name] = {"out_of_time": str(exc)}
            summary = result["dtypes"][dtype_name]
            print(f"=== {dtype_name}: {summary.get('params', 0):,} parameters ===")
            for name, c in summary.get("contenders", {}).items():
                print(
                    f"  {name:<14} step {c.get('step_median_ms', float('nan')):8.3f} ms  "
                    f"update {c.get('update_median_ms', float('nan')):8.3f} ms  "
                    f"state {c['state_bytes'] / 1e6:8.1f} MB  kept {c['kept_bytes'] / 1e6:8.1f} MB"
                    f"  diff {c['max_abs_diff_vs_adam']:.2e}"
                )
    finally:
        signal.alarm(0)
        dist.destroy_process_group()
        write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
