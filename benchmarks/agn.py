"""Benchmark: the AGN parameter server (torch.distributed.rpc) against a raw rpc echo.

Side by side in one run, on local processes (loopback, TensorPipe), with the paper's MNIST MLP
784-1000-2000-1000-10 (4,798,010 float32 parameters, 19.2 MB):

* ``round trip`` -- one AGN commit + pull (``AGNOptimizer._commit``: build ``a/λ``, one RPC per
  shard, the server applies SGD under its lock and replies with a snapshot of the center, the
  worker copies it into its parameters) vs a raw ``rpc_sync`` echo of the same bytes (a dict
  with one 4.8M-element tensor sent to the PS and returned as is). The two are interleaved, so
  load changes hit both alike. Target: overhead <= 1.5x.
* ``commits/s`` -- aggregate accepted commits per second with 1, 2 and 4 workers on one shard,
  every worker stepping as fast as it can at λ=1 (fixed gradients: this measures the PS path,
  not the model's compute); then 4 workers on 2 shards vs 1.
* ``2 shards vs 1`` -- the round trip of one worker with the model split over 2 shards.
* ``10 Gbit/s`` -- the 1-shard round trip again with an emulated 10 Gbit/s link
  (``distoptim.comm.link``; both the AGN path and the echo pay the same wire time).

Run::

    python benchmarks/agn.py            # ~2-3 minutes on 2 cores
    python benchmarks/agn.py --quick    # a smoke run

Prints medians and ratios; writes ``benchmarks/results/agn.json``. On a shared 2-core machine
processes compete for cores: more workers cannot add throughput there, and the figures move
with the load (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

import distoptim
from distoptim.agn import spawn
from distoptim.agn.flat import nbytes
from distoptim.comm.link import ENV_VAR, Link, transmit

SIZES = (784, 1000, 2000, 1000, 10)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _echo(payload: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    transmit(nbytes(payload))  # the reply's wire time, as a shard pays it (no-op without a link)
    return payload


def _echo_call(dst: str, payload: dict[str, torch.Tensor]) -> torch.futures.Future:
    transmit(nbytes(payload))  # the request's wire time, as a worker pays it
    return rpc.rpc_async(dst, _echo, args=(payload,))


def _setup(ctx) -> tuple[nn.Module, distoptim.AGNOptimizer]:
    model = _mlp()
    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-9), ctx.num_worker, communication_period=1
    )
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()
    g = torch.Generator().manual_seed(ctx.task_index)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return model, opt


def _round_trip(ctx, reps: int) -> dict[str, Any]:
    model, opt = _setup(ctx)
    n = sum(p.numel() for p in model.parameters())
    flat = {"float32": torch.randn(n)}
    commit, echo = [], []
    for i in range(reps + 2):  # two warm-up rounds
        t = time.perf_counter()
        opt._commit()
        c = time.perf_counter() - t
        t = time.perf_counter()
        if ctx.num_ps == 1:
            _echo_call("ps:0", flat).wait()
        else:  # the same bytes split over the shards, in parallel, as a commit is
            half = n // 2
            futs = [
                _echo_call("ps:0", {"float32": flat["float32"][:half].clone()}),
                _echo_call("ps:1", {"float32": flat["float32"][half:].clone()}),
            ]
            for f in futs:
                f.wait()
        e = time.perf_counter() - t
        if i >= 2:
            commit.append(c)
            echo.append(e)
    return {"params": n, "commit_s": commit, "echo_s": echo}


def _throughput(ctx, seconds: float) -> dict[str, Any]:
    _, opt = _setup(ctx)
    start = time.time()
    steps = 0
    while time.time() - start < seconds:
        opt.step()  # λ=1: local SGD step + accumulate + commit + pull
        steps += 1
    return {"start": start, "end": time.time(), "commits": steps}


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (few repetitions)")
    ap.add_argument("--reps", type=int, default=None, help="round trips per configuration")
    ap.add_argument("--seconds", type=float, default=None, help="throughput window per run")
    ap.add_argument(
        "--link",
        default=None,
        metavar="LATENCY_MS,MBPS",
        help="emulate a slower network for both the AGN path and the echo (e.g. 0.05,10000)",
    )
    ap.add_argument("--rt-only", action="store_true", help="only the round-trip comparison")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "agn.json"))
    args = ap.parse_args()
    if args.link:
        Link.from_env(args.link)  # validates
    reps = args.reps or (5 if args.quick else 25)
    seconds = args.seconds or (2.0 if args.quick else 6.0)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "loadavg_start": _load(),
        },
        "model": "MLP 784-1000-2000-1000-10 (float32)",
        "link": args.link or "loopback (no emulation)",
    }

    print(f"round trip, {reps} reps each (interleaved) ...", flush=True)
    rt: dict[str, dict[str, float]] = {}
    cases = [("1ps", 1, args.link), ("2ps", 2, args.link)]
    if not args.link:  # plus an emulated 10 Gbit/s network (50 us latency), for both paths
        cases.append(("1ps_10gbit", 1, "0.05,10000"))
    for key, num_ps, link in cases:
        if link:
            os.environ[ENV_VAR] = link  # the spawned processes inherit it
        else:
            os.environ.pop(ENV_VAR, None)
        out = spawn(_round_trip, 1, num_ps=num_ps, args=(reps,), timeout=300).worker_results[0]
        rt[key] = {
            "link": link or "loopback",
            "commit_ms": 1e3 * statistics.median(out["commit_s"]),
            "echo_ms": 1e3 * statistics.median(out["echo_s"]),
            "commit_min_ms": 1e3 * min(out["commit_s"]),
            "echo_min_ms": 1e3 * min(out["echo_s"]),
        }
        r = rt[key]
        r["ratio"] = r["commit_ms"] / r["echo_ms"]
        r["ratio_min"] = r["commit_min_ms"] / r["echo_min_ms"]  # best case: least disturbed
        results["params"] = out["params"]
        print(
            f"  {key} ({r['link']}): AGN commit+pull median {r['commit_ms']:.1f} ms (min "
            f"{r['commit_min_ms']:.1f}), raw echo median {r['echo_ms']:.1f} ms (min "
            f"{r['echo_min_ms']:.1f}); ratio {r['ratio']:.2f}x of medians, {r['ratio_min']:.2f}x "
            "of minima (target <= 1.5x)",
            flush=True,
        )
    if args.link:
        os.environ[ENV_VAR] = args.link
    else:
        os.environ.pop(ENV_VAR, None)
    results["round_trip"] = rt
    results["round_trip_2_vs_1_shard"] = rt["2ps"]["commit_ms"] / rt["1ps"]["commit_ms"]

    if args.rt_only:
        results["machine"]["loadavg_end"] = _load()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
        return
    print(f"commits/s, {seconds:g} s per run ...", flush=True)
    tp: dict[str, dict[str, float]] = {}
    for num_worker, num_ps in ((1, 1), (2, 1), (4, 1), (4, 2)):
        res = spawn(_throughput, num_worker, num_ps=num_ps, args=(seconds,), timeout=300)
        outs = res.worker_results
        span = max(o["end"] for o in outs) - min(o["start"] for o in outs)
        commits = sum(o["commits"] for o in outs)
        assert commits == res.stats.global_step, (commits, res.stats.global_step)
        key = f"{num_worker}w_{num_ps}ps"
        tp[key] = {
            "commits_per_s": commits / span,
            "commits": commits,
            "span_s": span,
            "staleness_mean": sum(s * n for s, n in res.stats.staleness_histogram.items())
            / max(1, commits),
            "mb_per_s_in": res.stats.bytes_in / span / 1e6,
        }
        print(
            f"  {num_worker} worker(s), {num_ps} shard(s): {tp[key]['commits_per_s']:.1f} "
            f"commits/s ({commits} commits, mean staleness {tp[key]['staleness_mean']:.2f})",
            flush=True,
        )
    base = tp["1w_1ps"]["commits_per_s"]
    results["commits_per_s"] = tp
    results["scaling_vs_1_worker"] = {
        k: v["commits_per_s"] / base for k, v in tp.items() if k.endswith("_1ps")
    }
    results["4w_2ps_vs_4w_1ps"] = tp["4w_2ps"]["commits_per_s"] / tp["4w_1ps"]["commits_per_s"]
    results["machine"]["loadavg_end"] = _load()

    print("\nsummary")
    for k, r in rt.items():
        print(
            f"  round trip vs raw echo ({k}, {r['link']}): {r['ratio']:.2f}x medians, "
            f"{r['ratio_min']:.2f}x minima  (target <= 1.5x)"
        )
    print(f"  round trip 2 shards / 1 shard: {results['round_trip_2_vs_1_shard']:.2f}x")
    for k, v in results["scaling_vs_1_worker"].items():
        print(f"  commits/s {k} / 1w_1ps: {v:.2f}x")
    print(f"  commits/s 4w_2ps / 4w_1ps: {results['4w_2ps_vs_4w_1ps']:.2f}x")
    print(f"  load average start {results['machine']['loadavg_start']} end {_load()}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
