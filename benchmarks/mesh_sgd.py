"""Benchmark: distoptim.dtensor.SGD against torch.optim.SGD (foreach, fused) and a plain copy.

Side by side in one run, momentum 0.9 + Nesterov, fp32 unless --dtypes says otherwise:

* plain   -- ~10M elements in 200 tensors of mixed shapes, one process;
* dtensor -- the same tensors as DTensors Shard(0) on 2 gloo ranks (one thread each);
* jit     -- our SGD with ``jit_compile=True`` (torch.compile; the compile time is reported
  apart from the step time).

The contenders run round-robin, one step each per round, in a freshly shuffled order every
round (the same order on both ranks), so that load from other processes hits all of them
alike. For each it prints the median step time, the effective bandwidth at 5 tensor accesses
per element (read w, g, b; write w, b: 20 B/element in fp32, 10 in bf16), the ratio of that to
a plain tensor copy of the same number of elements (read + write, the memory-bandwidth limit),
and the **paired** speed-up of distoptim over it (the median over rounds of
``t_contender / t_distoptim``, both timed in the same round). Results go to
``benchmarks/results/mesh_sgd.json`` (``--out``). Goals: distoptim >= 0.9x torch's fused SGD on
plain tensors, >= 1.8x torch's foreach SGD on DTensor Shard(0).

    python benchmarks/mesh_sgd.py                     # CPU, default sizes (~2-3 min, 2 cores)
    python benchmarks/mesh_sgd.py --device cuda --dtypes fp32,bf16 --no-dtensor   # one GPU
    python benchmarks/mesh_sgd.py --quick             # a smoke run: seconds

``--quick`` changes the defaults to :data:`QUICK` (every contender but ``jit``, whose
compilation alone takes longer than the whole smoke run, on ~20,000 elements; flags given
explicitly still win) and writes ``benchmarks/results/quick/mesh_sgd.json`` unless ``--out``
says otherwise, so it never replaces the shipped figures.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from _common import Bench, machine

from distoptim.dtensor import SGD

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_MOMENTUM, _LR = 0.9, 0.01
QUICK = {"tensors": 20, "elements": 20_000, "reps": 5, "dt_reps": 5, "warmup": 1, "no_jit": True}
"""The defaults ``--quick`` changes: the code paths in seconds, not the figures."""


def make_shapes(n_tensors: int, n_elements: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Mixed shapes (3 in 4 matrices with an even first dim, 1 in 4 vectors), sizes log-normal,
    scaled to about ``n_elements`` in total."""
    rng = random.Random(seed)
    weights = [math.exp(rng.gauss(0.0, 1.2)) for _ in range(n_tensors)]
    scale = n_elements / sum(weights)
    shapes: list[tuple[int, ...]] = []
    for i, w in enumerate(weights):
        size = max(2, int(w * scale))
        if i % 4 == 3:
            shapes.append((size,))
        else:
            cols = rng.choice([16, 64, 128, 256, 512])
            rows = max(2, 2 * round(size / cols / 2))
            shapes.append((rows, cols))
    return shapes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(
    fns: dict[str, Any], reps: int, warmup: int, device: torch.device, barrier=None, seed: int = 0
) -> dict[str, list[float]]:
    """Per-step times of every callable: ``reps`` rounds, one step of each per round, in an order
    shuffled every round (seeded: every rank shuffles alike). ``out[name][r]`` is round ``r``."""
    live = {k: f for k, f in fns.items() if callable(f)}
    for _ in range(warmup):
        for f in live.values():
            f()
    order = list(live)
    rng = random.Random(seed)
    out: dict[str, list[float]] = {k: [] for k in live}
    for _ in range(reps):
        rng.shuffle(order)
        for name in order:
            if barrier is not None:
                barrier()
            _sync(device)
            t0 = time.perf_counter()
            live[name]()
            _sync(device)
            out[name].append(time.perf_counter() - t0)
    return out


def _copy_fn(numel: int, dtype, device):
    src = torch.randn(numel, device=device).to(dtype)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def optimizers(params: list[torch.Tensor], jit: bool) -> dict[str, Any]:
    """name -> zero-argument step function (fresh copies of the params for each)."""
    runs: dict[str, Any] = {}

    def clone(ps):
        out = []
        for p in ps:
            q = p.detach().clone().requires_grad_(True)
            q.grad = p.grad.clone()
            out.append(q)
        return out

    ps = clone(params)
    ours = SGD(ps, learning_rate=_LR, momentum=_MOMENTUM, nesterov=True)
    runs["distoptim"] = ours.step
    ps = clone(params)
    runs["torch_foreach"] = torch.optim.SGD(
        ps, lr=_LR, momentum=_MOMENTUM, nesterov=True, foreach=True
    ).step
    ps = clone(params)
    try:
        fused = torch.optim.SGD(ps, lr=_LR, momentum=_MOMENTUM, nesterov=True, fused=True)
        fused.step()
        runs["torch_fused"] = fused.step
    except Exception as exc:  # fused is not implemented for every device / tensor type
        runs["torch_fused"] = f"not run: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    if jit:
        ps = clone(params)
        opt = SGD(ps, learning_rate=_LR, momentum=_MOMENTUM, nesterov=True, jit_compile=True)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            opt.step()
            _sync(ps[0].device)
        runs["distoptim_jit"] = opt.step
        runs["_jit_compile_s"] = time.perf_counter() - t0
        runs["_jit_fell_back"] = bool(opt._jit_failed) or any(
            "falls back" in str(w.message) for w in caught
        )
    return runs


def summarize(times: dict[str, Any], numel: int, itemsize: int, copy_s: float) -> dict:
    """Medians, bandwidths and distoptim's paired speed-up over each contender."""
    res: dict[str, Any] = {
        "copy_median_s": copy_s,
        "copy_GBps": 2 * itemsize * numel / copy_s / 1e9,
    }
    ours = times.get("distoptim")
    for name, t in times.items():
        if isinstance(t, str):
            res[name] = {"skipped": t}
            continue
        med = statistics.median(t)
        bw = 5 * itemsize * numel / med / 1e9
        res[name] = {
            "median_s": med,
            "effective_GBps": bw,
            "ratio_to_copy_bw": bw / res["copy_GBps"],
            "distoptim_paired_speedup": (
                statistics.median(a / b for a, b in zip(t, ours)) if ours else None
            ),
        }
    return res


def goal(res: dict, contender: str, target: float) -> dict:
    r = res.get(contender, {}).get("distoptim_paired_speedup")
    return {
        "distoptim_over": contender,
        "paired_speedup": r,
        "target": target,
        "met": None if r is None else r >= target,
    }


def run_plain(args, dtype_name: str, jit: bool) -> dict:
    device, dtype = torch.device(args.device), _DTYPES[dtype_name]
    shapes = make_shapes(args.tensors, args.elements)
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.randn(s, generator=gen).to(device=device, dtype=dtype)
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        params.append(p)
    numel = sum(p.numel() for p in params)
    runs = optimizers(params, jit=jit)
    extra = {k: runs.pop(k) for k in list(runs) if k.startswith("_")}
    runs["_copy"] = _copy_fn(numel, dtype, device)
    times: dict[str, Any] = time_interleaved(runs, args.reps, args.warmup, device)
    copy_s = statistics.median(times.pop("_copy"))
    times.update({k: v for k, v in runs.items() if isinstance(v, str)})
    res = summarize(times, numel, torch.empty((), dtype=dtype).element_size(), copy_s)
    res.update({"numel": numel, "tensors": len(params), "dtype": dtype_name, **extra})
    res["goal"] = goal(res, "torch_fused", 0.9)
    return res


def _dtensor_rank(rank: int, world: int, args_dict: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shapes = make_shapes(args_dict["tensors"], args_dict["elements"])
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = distribute_tensor(torch.randn(s, generator=gen), mesh, [Shard(0)])
        p.grad = distribute_tensor(torch.randn(s, generator=gen) * 1e-3, mesh, [Shard(0)])
        params.append(p)
    local_numel = sum(p.to_local().numel() for p in params)
    runs = optimizers(params, jit=False)
    barrier = torch.distributed.barrier
    runs["_copy"] = _copy_fn(local_numel, torch.float32, torch.device("cpu"))
    times: dict[str, Any] = time_interleaved(
        runs, args_dict["reps"], 2, torch.device("cpu"), barrier
    )
    copy_s = statistics.median(times.pop("_copy"))
    times.update({k: v for k, v in runs.items() if isinstance(v, str)})
    return {"times": times, "copy_s": copy_s, "local_numel": local_numel}


def run_dtensor(args) -> dict:
    from distoptim.launch import spawn

    outs = spawn(
        _dtensor_rank,
        2,
        args=({"tensors": args.tensors, "elements": args.elements, "reps": args.dt_reps},),
        timeout=600,
        num_threads=1,
    )
    # the step of the slower rank is the step of the job
    times = {}
    for name, t in outs[0]["times"].items():
        if isinstance(t, str):
            times[name] = t
        else:
            times[name] = [max(a, b) for a, b in zip(t, outs[1]["times"][name])]
    numel = max(o["local_numel"] for o in outs)
    copy_s = max(o["copy_s"] for o in outs)
    res = summarize(times, numel, 4, copy_s)
    res.update({"local_numel_per_rank": numel, "ranks": 2, "dtype": "fp32", "threads_per_rank": 1})
    res["goal"] = goal(res, "torch_foreach", 1.8)
    return res


def _print(title: str, res: dict) -> None:
    print(
        f"\n== {title}: {res.get('numel', res.get('local_numel_per_rank'))} elements "
        f"({res['dtype']}), copy {res['copy_GBps']:.2f} GB/s"
    )
    print(f"{'optimizer':<16}{'median ms':>11}{'eff GB/s':>10}{'/copy':>8}{'distoptim x':>13}")
    for name, r in res.items():
        if not isinstance(r, dict) or name == "goal":
            continue
        if "skipped" in r:
            print(f"{name:<16}  {r['skipped']}")
            continue
        sp = r["distoptim_paired_speedup"]
        print(
            f"{name:<16}{r['median_s'] * 1e3:>11.2f}{r['effective_GBps']:>10.2f}"
            f"{r['ratio_to_copy_bw']:>8.2f}{sp:>12.2f}x"
        )
    g = res["goal"]
    if g["paired_speedup"] is not None:
        print(
            f"goal: distoptim >= {g['target']}x {g['distoptim_over']} (paired): "
            f"{g['paired_speedup']:.2f}x, {'met' if g['met'] else 'NOT met'}"
        )


def main(argv: list[str] | None = None) -> int:
    bench = Bench(
        __file__,
        __doc__,
        quick="a smoke run: tiny sizes, no jit",
        quick_defaults=QUICK,
        raw_help=True,
    )
    ap = bench.parser
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="fp32", help="comma list of fp32,bf16,fp16")
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--elements", type=int, default=10_000_000)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--dt-reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on CPU (default 1: on a shared, loaded machine an OpenMP "
        "team waits at every barrier for a descheduled thread, which slows every contender "
        "by orders of magnitude and measures the scheduler, not the optimizer)",
    )
    ap.add_argument("--no-dtensor", action="store_true")
    ap.add_argument("--no-jit", action="store_true")
    args = bench.parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    for d in args.dtypes.split(","):
        if d not in _DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {sorted(_DTYPES)}")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    report: dict[str, Any] = {
        "machine": machine(
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            threads=torch.get_num_threads(),
        ),
        "config": {"momentum": _MOMENTUM, "nesterov": True, "lr": _LR, **vars(args)},
        "results": {},
    }
    for d in args.dtypes.split(","):
        res = run_plain(args, d, jit=not args.no_jit)
        report["results"][f"plain_{d}"] = res
        _print(f"plain {d} on {device}", res)
        if "_jit_compile_s" in res:
            print(
                f"   jit compile (first step) {res['_jit_compile_s']:.1f} s; "
                f"fell back to eager: {res['_jit_fell_back']}"
            )
    if not args.no_dtensor:
        if device.type != "cpu":
            print("(the DTensor leg runs on CPU/gloo only; skipped)")
        else:
            res = run_dtensor(args)
            report["results"]["dtensor_shard0_2ranks_fp32"] = res
            _print("DTensor Shard(0), 2 gloo ranks (per-rank local shard)", res)
    bench.save(report, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
