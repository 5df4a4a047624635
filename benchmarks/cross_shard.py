"""Benchmark: CrossShardOptimizer vs DDP vs a naive per-tensor all-reduce, on local gloo ranks.

Same model, data and inner optimizer (SGD) for every method, side by side in one run; the
methods are interleaved round-robin so a change in machine load hits all of them alike. A
timed iteration is ``zero_grad -> forward -> backward -> step`` (the step includes the
gradient reduction); its time is the slowest rank's (MAX all-reduce, outside the timing).

Cases (issue 3):
* ``mlp5m``   -- an MLP of ~5.0M parameters in 100 tensors (50 Linear layers, width 316);
* ``small500`` -- 500 small tensors (250 Linear layers, width 32; 264k parameters).

Methods: ``local`` (no communication: the compute floor), ``cross_shard`` (overlap off),
``cross_shard_overlap``, the same two with ``sequence_guard=False`` (``..._noguard``) and with
``gradient_as_bucket_view=True`` (``cross_shard_views``, ``cross_shard_views_overlap``), ``ddp``
(``DistributedDataParallel`` + SGD), ``naive`` (one blocking ``dist.all_reduce`` per gradient
tensor). The guard's cost is the paired ratio guard on / guard off. Every round carries the
ranks' sequence words in its last bucket whatever the option (the parameter-list and
edit agreement need them), so the bandwidth part also times the bucketed reducer with and
without that trailer (words written and read back): the cost of the words themselves.
Bucket bandwidth: reducing ~5M float32 gradients in 100 tensors with the bucketed reducer
vs one ``dist.all_reduce`` of a flat tensor of the same bytes -- packing separate ``.grad``
tensors into the buckets (``bucketed_*``), or with the gradients already in the buckets
(``bucketed_*_views``: ``.grad`` as bucket aliases, nothing packed, reduced in place).

Run::

    python benchmarks/cross_shard.py            # ~3 minutes on 2 quiet cores
    python benchmarks/cross_shard.py --quick    # a smoke run: tiny models, seconds
    python benchmarks/cross_shard.py --bandwidth-only --repeats 100   # the reduction alone

Prints medians and ratios; writes ``benchmarks/results/cross_shard.json`` (``--out``). A
``--quick`` run measures :data:`QUICK_CASES` (every method and every bandwidth contender on
models of a few thousand parameters: the code paths, not the figures) and writes
``benchmarks/results/quick/cross_shard.json`` unless ``--out`` says otherwise, so it never
replaces the shipped figures.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import Bench
from _common import machine as common_machine
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import CrossShardOptimizer
from distoptim.comm.bucket import Bucket, BucketPlan
from distoptim.comm.compression import WireFormat
from distoptim.comm.guard import GuardCodec, GuardWords, RoundKind
from distoptim.comm.reducer import BucketAllReduce, ReduceRound
from distoptim.comm.stats import CommStats
from distoptim.launch import spawn

CASES = {"mlp5m": (316, 50, 32), "small500": (32, 250, 32)}  # width, depth, batch
QUICK_CASES = {"mlp_tiny": (32, 4, 8), "many_tiny": (8, 20, 4)}
"""``--quick``'s cases: the same shapes of model, small enough for a smoke run in seconds."""
METHODS = [
    "local",
    "cross_shard",
    "cross_shard_noguard",
    "cross_shard_overlap",
    "cross_shard_overlap_noguard",
    "cross_shard_views",
    "cross_shard_views_overlap",
    "ddp",
    "naive",
]


def model_of(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _iteration(
    method: str, case: tuple[int, int, int], rank: int, world: int
) -> tuple[Callable[[], None], Any]:
    """One training iteration of ``method`` on ``case`` (width, depth, batch), as a closure
    (and its owner)."""
    width, depth, batch = case
    model = model_of(width, depth)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    if method == "ddp":
        net: nn.Module = DDP(model)
        opt: Any = torch.optim.SGD(net.parameters(), lr=1e-3)
    elif method.startswith("cross_shard"):
        net = model
        opt = CrossShardOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3),
            overlap="overlap" in method,
            sequence_guard=not method.endswith("noguard"),
            gradient_as_bucket_view="views" in method,
        )
    else:
        net = model
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    params = list(model.parameters())

    def run() -> None:
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        if method == "naive":
            for p in params:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()

    return run, (net, opt)


def _bandwidth(rank: int, world: int, repeats: int, case: tuple[int, int, int]) -> dict[str, Any]:
    """Bucketed reduction of ``case``'s gradients (``mlp5m``: 100 tensors, ~5M float32) vs one
    all-reduce of the same bytes."""
    width, depth, _ = case
    params = [p.detach().requires_grad_() for p in model_of(width, depth).parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    numel = sum(p.numel() for p in params)
    flat = torch.randn(numel)
    stats = CommStats()
    reducer = BucketAllReduce(None, world, WireFormat.parse(None), stats)
    plans = {cap: BucketPlan(params, cap_bytes=cap << 20) for cap in (25, 5)}
    codec = GuardCodec(world, rank, list(range(world)))
    guarded = BucketPlan(params, cap_bytes=25 << 20, trailer=codec.size)
    words = GuardWords(RoundKind.STEP, step=1, passes=1, plan=12345, params=len(params))

    def bucketed(plan: BucketPlan) -> Callable[[], None]:
        return _grad_round(plan, params, reducer, codec, words)

    fns: dict[str, Callable[[], None]] = {"single_all_reduce": lambda: dist.all_reduce(flat)}
    for cap, plan in plans.items():
        fns[f"bucketed_cap{cap}mb"] = bucketed(plan)
    fns["bucketed_cap25mb_words"] = bucketed(guarded)
    # the same collectives on already-packed buffers: separates the pack copy from the wire
    packed = plans[25]
    bucketed(packed)()

    def comm_only() -> None:
        pending = [reducer.launch(b, b.persistent_buffer(), 1) for b in packed.buckets]
        for p in pending:
            reducer.finish(p)

    fns["bucketed_cap25mb_comm_only"] = comm_only
    # gradients as bucket views: .grad aliases the bucket slots, the round packs nothing
    for name, trailer in (("bucketed_cap25mb_views", 0), ("bucketed_cap25mb_views_words", 1)):
        own = [p.detach().clone().requires_grad_() for p in params]  # each plan its own .grad
        plan = BucketPlan(own, cap_bytes=25 << 20, trailer=codec.size * trailer)
        for bucket in plan.buckets:
            for i, alias in zip(bucket.members, bucket.grad_aliases()):
                alias.copy_(params[i].grad)
                own[i].grad = alias
        fns[name] = _grad_round(plan, own, reducer, codec, words)
    times = round_robin(fns, warmup=2, repeats=repeats)
    out: dict[str, Any] = {"bytes": numel * 4, "tensors": len(params)}
    out["paired_ratio_vs_single"] = {
        k: paired(times, "single_all_reduce", k) for k in fns if k != "single_all_reduce"
    }
    out["paired_ratio_words_vs_none"] = paired(times, "bucketed_cap25mb_words", "bucketed_cap25mb")
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"median_s": med, "GB_per_s": numel * 4 / med / 1e9, "samples": len(ts)}
    for cap, plan in plans.items():
        out[f"bucketed_cap{cap}mb"]["buckets"] = len(plan)
    out["bucketed_cap25mb_words"]["trailer_elements"] = codec.size
    out["bucketed_cap25mb_comm_only"]["buckets"] = len(packed)
    return out


def _grad_round(
    plan: BucketPlan,
    params: list[torch.Tensor],
    reducer: BucketAllReduce,
    codec: GuardCodec,
    words: GuardWords,
) -> Callable[[], None]:
    """One round over the ``.grad`` of ``params`` in ``plan``'s persistent buckets (packed,
    unless ``.grad`` already lives there), with the words when the plan has a trailer."""

    def run() -> None:
        rnd = ReduceRound(
            plan,
            reducer,
            grads_of=lambda b: [params[i].grad for i in b.members],
            buffer_of=Bucket.persistent_buffer,
            divisor=1,
        )
        if not plan.buckets[-1].trailer:
            rnd.wait_all()
            return
        buffers = rnd.wait_all(lambda trailer: codec.write(trailer, words))
        codec.read(rnd.trailer(buffers))

    return run


def round_robin(
    fns: dict[str, Callable[[], None]], warmup: int, repeats: int
) -> dict[str, list[float]]:
    """One sample of every fn per repeat, in a shuffled order; slowest rank per sample.

    Sample ``r`` of every fn is taken within the same short window, so a load spike from
    other processes hits all of them alike; the order is shuffled per repeat (same seed on
    every rank) so no fn always follows the same neighbour.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    for r in range(repeats):
        order = names[:]
        random.Random(r).shuffle(order)
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[name].append(dt.item())
    return times


def paired(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over repeats of ``time_a / time_b`` (samples taken side by side)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def _bench(
    rank: int,
    world: int,
    repeats: int,
    cases: dict[str, tuple[int, int, int]],
    bandwidth_case: tuple[int, int, int],
) -> dict[str, Any]:
    torch.set_flush_denormal(True)
    out: dict[str, Any] = {"cases": {}}
    for case, dims in cases.items():
        runs = {m: _iteration(m, dims, rank, world) for m in METHODS}
        times = round_robin({m: r[0] for m, r in runs.items()}, 3, repeats)
        n_params = sum(p.numel() for p in runs["local"][1][0].parameters())
        n_tensors = len(list(runs["local"][1][0].parameters()))
        case_out: dict[str, Any] = {"params": n_params, "tensors": n_tensors, "methods": {}}
        for m, ts in times.items():
            case_out["methods"][m] = {"median_s": statistics.median(ts), "samples": len(ts)}
        case_out["paired_ratios"] = {
            "guard_on_vs_off": paired(times, "cross_shard", "cross_shard_noguard"),
            "guard_on_vs_off_overlap": paired(
                times, "cross_shard_overlap", "cross_shard_overlap_noguard"
            ),
            "cross_shard_vs_ddp": paired(times, "cross_shard", "ddp"),
            "cross_shard_noguard_vs_ddp": paired(times, "cross_shard_noguard", "ddp"),
            "cross_shard_overlap_vs_ddp": paired(times, "cross_shard_overlap", "ddp"),
            "cross_shard_views_vs_ddp": paired(times, "cross_shard_views", "ddp"),
            "cross_shard_views_overlap_vs_ddp": paired(times, "cross_shard_views_overlap", "ddp"),
            "views_vs_cross_shard": paired(times, "cross_shard_views", "cross_shard"),
            "naive_vs_cross_shard": paired(times, "naive", "cross_shard"),
            "naive_vs_cross_shard_overlap": paired(times, "naive", "cross_shard_overlap"),
        }
        cs = runs["cross_shard"][1][1].comm_stats
        case_out["cross_shard_collectives_per_step"] = (cs.collectives - 1) / (
            len(times["cross_shard"]) + 3
        )
        case_out["repeated_rounds"] = {
            m: r[1][1].comm_stats.repeated_rounds
            for m, r in runs.items()
            if m.startswith("cross_shard")
        }
        out["cases"][case] = case_out
        for _, (_, opt) in runs.items():
            if isinstance(opt, CrossShardOptimizer):
                opt.remove_hooks()
    out["bandwidth"] = _bandwidth(rank, world, repeats, bandwidth_case)
    return out


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets: paired (side-by-side) ratios, and ratios of the medians."""
    r: dict[str, Any] = {}
    for case, c in result["cases"].items():
        med = {m: v["median_s"] for m, v in c["methods"].items()}
        r[case] = {
            "paired": c["paired_ratios"],
            "of_medians": {
                "guard_on_vs_off": med["cross_shard"] / med["cross_shard_noguard"],
                "guard_on_vs_off_overlap": med["cross_shard_overlap"]
                / med["cross_shard_overlap_noguard"],
                "cross_shard_vs_ddp": med["cross_shard"] / med["ddp"],
                "cross_shard_overlap_vs_ddp": med["cross_shard_overlap"] / med["ddp"],
                "cross_shard_views_vs_ddp": med["cross_shard_views"] / med["ddp"],
                "cross_shard_views_overlap_vs_ddp": med["cross_shard_views_overlap"] / med["ddp"],
                "naive_vs_cross_shard": med["naive"] / med["cross_shard"],
                "naive_vs_cross_shard_overlap": med["naive"] / med["cross_shard_overlap"],
            },
        }
    bw = result["bandwidth"]
    single = bw["single_all_reduce"]["GB_per_s"]
    r["bandwidth"] = {
        "paired": bw["paired_ratio_vs_single"],
        "words_vs_none_paired": bw["paired_ratio_words_vs_none"],
        "of_medians": {
            k: v["GB_per_s"] / single for k, v in bw.items() if k.startswith("bucketed")
        },
    }
    return r


def machine(backend: str) -> dict[str, Any]:
    """What a result was measured on: cores, versions, backend (the load is the ending's)."""
    return common_machine(
        ranks=2,
        backend=backend,
        note="shared 2-core machine; other jobs may have run at the same time",
    )


def main() -> None:
    bench = Bench(__file__, __doc__, quick="a smoke run: tiny models, seconds")
    parser = bench.parser
    parser.add_argument("--repeats", type=int, default=60, help="samples per method")
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON")
    parser.add_argument(
        "--bandwidth-only",
        action="store_true",
        help="only the bucketed-reduction part (printed, not saved)",
    )
    args = bench.parse()
    repeats = 4 if args.quick else args.repeats
    sizes = QUICK_CASES if args.quick else CASES
    cases = {} if args.bandwidth_only else sizes
    args.no_save = args.no_save or args.bandwidth_only
    bandwidth_case = next(iter(sizes.values()))
    result = spawn(_bench, 2, args=(repeats, cases, bandwidth_case), timeout=900)[0]
    result["ratios"] = _ratios(result)
    result["machine"] = machine("gloo (loopback), 1 intra-op thread per rank")
    result["settings"] = {"repeats": repeats, "cases": cases}

    for case, c in result["cases"].items():
        print(f"\n{case}: {c['params']:,} params in {c['tensors']} tensors (median step, ms)")
        ddp = c["methods"]["ddp"]["median_s"]
        for m, v in c["methods"].items():
            print(f"  {m:<22}{v['median_s'] * 1e3:9.2f}   x{v['median_s'] / ddp:5.2f} of DDP")
    print("\nratios:", json.dumps(result["ratios"], indent=2))
    bw = result["bandwidth"]
    print(f"\nbandwidth, {bw['bytes'] / 1e6:.1f} MB in {bw['tensors']} tensors:")
    for k, v in bw.items():
        if isinstance(v, dict) and "median_s" in v:
            print(f"  {k:<28}{v['median_s'] * 1e3:9.2f} ms  {v['GB_per_s']:.2f} GB/s")
    bench.save(result, write=not args.no_save, indent=2)


if __name__ == "__main__":
    main()
