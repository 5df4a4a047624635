"""One CUDA GPU: distoptim.dtensor.SGD's one-pass Nesterov against torch.optim.SGD (fused, foreach).

For fp32 and bf16 (``--dtypes``), on plain tensors (200 tensors of mixed shapes, ~100M elements
by default), momentum 0.9, Nesterov, constant learning rate:

1. **correctness** -- 5 steps of each contender from the same weights and gradients: the max
   abs difference to a float64 replay of Keras' rule, distoptim against torch's fused SGD
   (the same kernel at a constant rate: expected 0), and whether every ``.grad`` is bit-identical
   after distoptim's steps (the fused kernel must never write into a user's gradient);
2. **speed** -- shuffled round-robin steps (``mesh_sgd.time_interleaved``), median step times,
   effective bandwidth (5 accesses per element) and distoptim's paired speed-up over each.

Everything runs under ``--time-limit`` seconds: timing stops early (recorded as ``rounds``) when
the budget runs low, and a hard alarm writes what was measured so far and exits 124. Writes
JSON to ``--out`` (default ``benchmarks/results/gpu_mesh_sgd.json``); without CUDA it prints why
and exits 0 (writing ``{"skipped": ...}``). ``--quick`` changes the defaults to :data:`QUICK`
-- ~20,000 elements, on the GPU if there is one and on the CPU otherwise, so the code path runs
everywhere (flags given explicitly still win) -- and writes
``benchmarks/results/quick/gpu_mesh_sgd.json`` unless ``--out`` says otherwise::

    python benchmarks/gpu_mesh_sgd.py --time-limit 240
    python benchmarks/gpu_mesh_sgd.py --quick            # a smoke run: seconds, CPU or GPU
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import Bench, machine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh_sgd import make_shapes, optimizers, summarize, time_interleaved

from distoptim.dtensor import SGD

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_MOMENTUM, _LR, _CHECK_STEPS = 0.9, 0.01, 5
QUICK = {
    "device": "cuda" if torch.cuda.is_available() else "cpu",
    "tensors": 20,
    "elements": 20_000,
    "reps": 5,
    "warmup": 1,
    "time_limit": 60.0,
}
"""The defaults ``--quick`` changes: the code path in seconds, not the figures."""


class _OutOfTime(Exception):
    pass


def _params(shapes, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in shapes:
        p = torch.randn(s, generator=gen).to(device=device, dtype=dtype)
        p.grad = (torch.randn(s, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        out.append(p)
    return out


def check(shapes, dtype, device) -> dict[str, Any]:
    """Five steps of each contender from the same start; differences and ``.grad`` integrity."""
    # weights ~0.1 and gradients ~1: every step moves the weights by many bf16 ulps, so a
    # wrong kernel shows (with the timing's gradients ~1e-3 a bf16 weight would not move)
    gen = torch.Generator(device=device).manual_seed(1)
    start = [torch.randn(s, generator=gen, device=device).mul_(0.1).to(dtype) for s in shapes]
    grads = [
        [torch.randn(p.shape, generator=gen, device=device).to(dtype) for p in start]
        for _ in range(_CHECK_STEPS)
    ]

    def run(make):
        """Final weights, and whether every gradient was left bit-identical (each run gets
        its own copies: torch's foreach Nesterov SGD adds the momentum into ``.grad``)."""
        ps = [p.detach().clone() for p in start]
        opt = make(ps)
        grads_ok = True
        for step in grads:
            gs = [g.clone() for g in step]
            for p, g in zip(ps, gs):
                p.grad = g
            opt.step()
            grads_ok &= all(torch.equal(g, k) for g, k in zip(gs, step))
        return ps, grads_ok

    kw = {"lr": _LR, "momentum": _MOMENTUM, "nesterov": True}
    runs = {
        "distoptim": run(lambda ps: SGD(ps, **kw)),
        "torch_fused": run(lambda ps: torch.optim.SGD(ps, **kw, fused=True)),
        "torch_foreach": run(lambda ps: torch.optim.SGD(ps, **kw, foreach=True)),
    }
    # Keras' rule in float64: v = mu v - lr g; w += mu v - lr g
    ref = []
    for i, p in enumerate(start):
        w, v = p.double(), torch.zeros_like(p, dtype=torch.float64)
        for step in grads:
            g = step[i].double()
            v = _MOMENTUM * v - _LR * g
            w = w + _MOMENTUM * v - _LR * g
        ref.append(w)

    def maxdiff(a, b):
        return max(float((x.double() - y.double()).abs().max()) for x, y in zip(a, b))

    return {
        "steps": _CHECK_STEPS,
        "max_abs_diff_vs_fp64_keras": {k: maxdiff(ps, ref) for k, (ps, _) in runs.items()},
        "distoptim_vs_torch_fused_max_abs_diff": maxdiff(
            runs["distoptim"][0], runs["torch_fused"][0]
        ),
        "grads_bit_identical_after_steps": {k: ok for k, (_, ok) in runs.items()},
    }


def bench(shapes, dtype, dtype_name, device, args, deadline) -> dict[str, Any]:
    params = _params(shapes, dtype, device)
    numel = sum(p.numel() for p in params)
    runs = optimizers(params, jit=args.jit)
    extra = {k: runs.pop(k) for k in list(runs) if k.startswith("_")}
    # rounds that fit: a probe of each contender, then what is left of the budget
    t0 = time.perf_counter()
    for f in runs.values():
        if callable(f):
            f()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    per_round = time.perf_counter() - t0
    left = deadline - time.perf_counter()
    rounds = max(3, min(args.reps, int(0.8 * left / max(per_round, 1e-6)) - args.warmup))
    times = time_interleaved(runs, rounds, args.warmup, device)
    times.update({k: v for k, v in runs.items() if isinstance(v, str)})
    itemsize = torch.empty((), dtype=dtype).element_size()
    # no copy contender here: the bandwidth ratio is against a copy timed once, apart
    src = torch.empty(numel, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    copy_t = time_interleaved({"copy": lambda: dst.copy_(src)}, 20, 3, device)["copy"]
    res = summarize(times, numel, itemsize, statistics.median(copy_t))
    res.update({"numel": numel, "tensors": len(params), "dtype": dtype_name, "rounds": rounds})
    res.update(extra)
    return res


def main(argv: list[str] | None = None) -> int:
    cli = Bench(
        __file__,
        __doc__,
        quick="a smoke run: tiny sizes, on the CPU without CUDA",
        quick_defaults=QUICK,
        raw_help=True,
    )
    ap = cli.parser
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke test")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--reps", type=int, default=200, help="timed rounds at most")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--jit", action="store_true", help="also time jit_compile=True")
    ap.add_argument("--time-limit", type=float, default=240.0, help="seconds for everything")
    args = cli.parse(argv)
    out = cli.out
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        msg = (
            f"gpu_mesh_sgd: no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}): skipped"
        )
        print(msg)
        cli.save({"skipped": msg}, indent=2)
        return 0
    for d in args.dtypes.split(","):
        if d not in _DTYPES:
            ap.error(f"unknown dtype {d!r}; choose from {sorted(_DTYPES)}")
    deadline = cli.started + args.time_limit
    report: dict[str, Any] = {
        "machine": machine(
            device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        ),
        "config": {"momentum": _MOMENTUM, "nesterov": True, "lr": _LR, **vars(args)},
        "results": {},
        "timed_out": False,
    }

    def write() -> None:
        cli.save(report, indent=2)

    def alarm(signum, frame):  # the hard limit: keep what was measured
        raise _OutOfTime

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(max(1, int(args.time_limit + 30)))
    shapes = make_shapes(args.tensors, args.elements)
    try:
        dtypes = args.dtypes.split(",")
        for i, name in enumerate(dtypes):
            dtype = _DTYPES[name]
            res = report["results"][name] = {"check": check(shapes, dtype, device)}
            print(f"== {name}: {json.dumps(res['check'])}", flush=True)
            share = (deadline - time.perf_counter()) / (len(dtypes) - i)
            res["speed"] = bench(shapes, dtype, name, device, args, time.perf_counter() + share)
            for k, r in res["speed"].items():
                if isinstance(r, dict) and "median_s" in r:
                    print(
                        f"   {k:<14} {r['median_s'] * 1e3:8.3f} ms  {r['effective_GBps']:8.1f} GB/s"
                        f"  distoptim x{r['distoptim_paired_speedup']:.2f}",
                        flush=True,
                    )
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except _OutOfTime:
        report["timed_out"] = True
        write()
        print(f"gpu_mesh_sgd: passed the {args.time_limit:.0f} s limit; partial results in {out}")
        return 124
    finally:
        signal.alarm(0)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
