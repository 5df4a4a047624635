"""Benchmark: weight-update sharding vs DDP + Adam vs ZeroRedundancyOptimizer, 2 gloo ranks.

Same models as ``benchmarks/cross_shard.py`` (``mlp5m``: 5.0M parameters in 100 tensors;
``small500``: 264k parameters in 500 tensors), the same data and the same inner optimizer
(``torch.optim.Adam``, torch's defaults) for every contender, side by side in one run: the
contenders are interleaved round-robin in a shuffled order per repeat, so a change of machine
load hits all of them alike; ratios are medians of per-repeat (paired) ratios. A timed
iteration is ``zero_grad -> forward -> backward -> step``; its time is the slowest rank's.

Contenders:
* ``ddp``            -- ``DistributedDataParallel`` + Adam (every rank updates everything);
* ``zero``           -- DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer(Adam)``
  (whole parameters partitioned between ranks, owners broadcast them);
* ``zero_bucketview`` -- the same with ``parameters_as_bucket_view=True``;
* ``cross_shard``    -- ``CrossShardOptimizer(Adam)`` (all-reduce, every rank updates all);
* ``sharded``        -- ``CrossShardOptimizer(Adam, shard_optimizer_state=True)``: on gloo its
  reduce-scatter and all-gather are a pairwise exchange of point-to-point messages
  (:mod:`distoptim.comm.shard_transport`);
* ``sharded_views``  -- the same with ``gradient_as_bucket_view=True``;
* ``sharded_all_reduce``, ``sharded_views_all_reduce`` -- the same two with the previous gloo
  method: an in-place all-reduce of each bucket standing in for the reduce-scatter (twice the
  bytes; with bucket views it reduces a copy), and gloo's own all-gather. The paired ratio
  ``paired_pairwise_vs_all_reduce`` decides which one sharding uses on gloo.

Memory, per contender, in a process of its own (so high-water marks do not mix): the
optimizer state bytes this rank holds, and the peak resident memory of the process above its
resident size before the model was built -- over the first three steps (``first_steps``:
includes one-time work such as moving the parameters into flat buffers) and, after resetting
the high-water mark (``/proc/self/clear_refs``), over three more (``steady``). glibc's malloc
runs with a fixed mmap threshold there (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave
the resident set and it tracks live memory.

Run::

    python benchmarks/zero.py               # a few minutes on 2 quiet cores
    python benchmarks/zero.py --quick       # a smoke run: tiny models, seconds
    python benchmarks/zero.py --foreach     # every contender with Adam(foreach=True)

Prints medians and ratios; writes ``benchmarks/results/zero.json`` (``--out``). A ``--quick``
run times every contender on ``cross_shard.QUICK_CASES`` (models of a few thousand parameters:
the code paths, not the figures), measures the memory of one contender (``sharded``) on the
first of them -- in the timing's two processes, after the timing (a smoke run's CPU is mostly
process start-up; its high-water marks are not figures) -- and writes
``benchmarks/results/quick/zero.json`` unless ``--out`` says otherwise, so it never replaces
the shipped figures.
"""

from __future__ import annotations

import os
import statistics
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from _common import Bench
from cross_shard import CASES, QUICK_CASES, machine, model_of, paired, round_robin
from memory import MALLOC, peak_rss_bytes, reset_peak, rss_bytes
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import CrossShardOptimizer
from distoptim.comm.shard_transport import AllReduceStandIn
from distoptim.launch import spawn

METHODS = [
    "ddp",
    "zero",
    "zero_bucketview",
    "cross_shard",
    "sharded",
    "sharded_views",
    "sharded_all_reduce",
    "sharded_views_all_reduce",
]
QUICK_MEMORY = ["sharded"]
"""``--quick``'s memory contenders, measured in the timing's processes after the timing."""
REPEATS = 40
"""Samples per contender by default (``--repeats``)."""


def _adam(foreach: bool) -> dict[str, Any]:
    return {"lr": 1e-3, "foreach": True} if foreach else {"lr": 1e-3}


def _contender(
    method: str, case: tuple[int, int, int], rank: int, foreach: bool
) -> tuple[Callable[[], None], nn.Module, Any]:
    """One training iteration of ``method`` on ``case`` (width, depth, batch) (closure), its
    model and optimizer."""
    width, depth, batch = case
    model = model_of(width, depth)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    kwargs = _adam(foreach)
    net: nn.Module = model
    if method == "ddp":
        net = DDP(model)
        opt: Any = torch.optim.Adam(net.parameters(), **kwargs)
    elif method.startswith("zero"):
        net = DDP(model)
        opt = ZeroRedundancyOptimizer(
            net.parameters(),
            optimizer_class=torch.optim.Adam,
            parameters_as_bucket_view=method == "zero_bucketview",
            **kwargs,
        )
    else:
        opt = CrossShardOptimizer(
            torch.optim.Adam(model.parameters(), **kwargs),
            shard_optimizer_state=method.startswith("sharded"),
            gradient_as_bucket_view="views" in method,
        )
        if method.endswith("all_reduce"):  # the previous gloo method, for the comparison
            scatter = opt._rounds.comm.scatter
            t = scatter.transport
            scatter.transport = AllReduceStandIn(t.group, t.size, t.rank, t.ranks)

    def run() -> None:
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()

    return run, model, opt


def state_bytes(method: str, opt: Any) -> int:
    """Optimizer state bytes this rank holds (tensors of one or more dimensions: moments)."""
    if method.startswith("sharded"):
        return opt._apply.update.state_bytes()
    inner = opt.optim if method.startswith("zero") else getattr(opt, "wrapped", opt)
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


def _timing(
    rank: int, world: int, repeats: int, foreach: bool, cases: dict[str, tuple[int, int, int]]
) -> dict[str, Any]:
    torch.set_flush_denormal(True)
    warnings.filterwarnings("ignore", category=UserWarning)
    out: dict[str, Any] = {}
    for case, dims in cases.items():
        runs = {m: _contender(m, dims, rank, foreach) for m in METHODS}
        times = round_robin({m: r[0] for m, r in runs.items()}, 3, repeats)
        model = runs["ddp"][1]
        params = list(model.parameters())
        # every contender trained the same steps from the same start: the same parameters
        reference = torch.cat([p.detach().reshape(-1) for p in params])
        drift = {
            m: (torch.cat([p.detach().reshape(-1) for p in r[1].parameters()]) - reference)
            .abs()
            .max()
            .item()
            for m, r in runs.items()
        }
        out[case] = {
            "params": sum(p.numel() for p in params),
            "tensors": len(params),
            "median_s": {m: statistics.median(ts) for m, ts in times.items()},
            "samples": len(times["ddp"]),
            "paired_vs_ddp": {m: paired(times, m, "ddp") for m in METHODS if m != "ddp"},
            "paired_sharded_vs": {
                m: paired(times, "sharded", m) for m in METHODS if m != "sharded"
            },
            "paired_sharded_views_vs": {
                m: paired(times, "sharded_views", m) for m in METHODS if m != "sharded_views"
            },
            "paired_pairwise_vs_all_reduce": {
                "packed": paired(times, "sharded", "sharded_all_reduce"),
                "views": paired(times, "sharded_views", "sharded_views_all_reduce"),
            },
            "state_bytes": {m: state_bytes(m, r[2]) for m, r in runs.items()},
            "max_abs_param_difference_vs_ddp": drift,
        }
    return out


def _memory(
    rank: int, world: int, method: str, case: tuple[int, int, int], foreach: bool
) -> dict[str, int]:
    """Peak-RSS growth of this process over steps of ``method`` alone (see the docstring)."""
    warnings.filterwarnings("ignore", category=UserWarning)
    before = rss_bytes()
    run, _, opt = _contender(method, case, rank, foreach)
    for _ in range(3):
        run()
    first = peak_rss_bytes() - before
    reset_peak()
    for _ in range(3):
        run()
    return {
        "peak_rss_growth_first_steps_bytes": first,
        "peak_rss_growth_steady_bytes": peak_rss_bytes() - before,
        "state_bytes": state_bytes(method, opt),
    }


def _timing_then_memory(
    rank: int,
    world: int,
    repeats: int,
    foreach: bool,
    cases: dict[str, tuple[int, int, int]],
    memory: dict[str, list[str]],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``--quick``: :func:`_timing`, then :func:`_memory` of each of ``memory``'s methods per
    case, on the same ranks (one launch instead of one per memory contender)."""
    timed = _timing(rank, world, repeats, foreach, cases)
    mem = {
        case: {m: _memory(rank, world, m, cases[case], foreach) for m in methods}
        for case, methods in memory.items()
    }
    return timed, mem


def main() -> None:
    bench = Bench(__file__, __doc__, quick="a smoke run: tiny models, seconds")
    parser = bench.parser
    parser.add_argument("--repeats", type=int, default=REPEATS, help="samples per contender")
    parser.add_argument("--foreach", action="store_true", help="Adam(foreach=True) everywhere")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    parser.add_argument("--no-save", action="store_true", help="do not write the JSON")
    args = bench.parse()
    repeats = 4 if args.quick else args.repeats
    cases = QUICK_CASES if args.quick else CASES
    memory_cases = dict(list(cases.items())[:1]) if args.quick else cases
    memory_methods = QUICK_MEMORY if args.quick else METHODS
    if args.quick:  # one launch: the timing, then the memory in the same processes
        memory = {} if args.no_memory else {case: memory_methods for case in memory_cases}
        launch_args = (repeats, args.foreach, cases, memory)
        timed, mem = spawn(_timing_then_memory, 2, args=launch_args, timeout=600)[0]
        for case, rows in mem.items():
            timed[case]["memory"] = rows
        result: dict[str, Any] = {"cases": timed}
    else:
        result = {"cases": spawn(_timing, 2, args=(repeats, args.foreach, cases), timeout=1800)[0]}
    if not args.no_memory and not args.quick:
        with mock.patch.dict(os.environ, MALLOC):  # read by each process's malloc at start-up
            for case, dims in memory_cases.items():
                result["cases"][case]["memory"] = {
                    m: spawn(
                        _memory, 2, args=(m, dims, args.foreach), timeout=300, start_method="spawn"
                    )[0]
                    for m in memory_methods
                }
    result["machine"] = machine("gloo (loopback)")
    result["settings"] = {"repeats": repeats, "adam": _adam(args.foreach), "cases": cases}
    for case, c in result["cases"].items():
        print(f"\n{case}: {c['params']:,} params in {c['tensors']} tensors, Adam")
        print(
            f"  {'method':<18}{'median ms':>10}{'x DDP':>8}{'state MB':>10}"
            f"{'peak MB (first, steady)':>25}"
        )
        for m in METHODS:
            ratio = 1.0 if m == "ddp" else c["paired_vs_ddp"][m]
            mem = c.get("memory", {}).get(m, {})
            first = mem.get("peak_rss_growth_first_steps_bytes", float("nan")) / 1e6
            steady = mem.get("peak_rss_growth_steady_bytes", float("nan")) / 1e6
            print(
                f"  {m:<18}{c['median_s'][m] * 1e3:10.2f}{ratio:8.2f}"
                f"{c['state_bytes'][m] / 1e6:10.2f}{first:14.1f}{steady:11.1f}"
            )
        print("  sharded vs:", {k: round(v, 3) for k, v in c["paired_sharded_vs"].items()})
        print(
            "  pairwise exchange / all-reduce stand-in:",
            {k: round(v, 3) for k, v in c["paired_pairwise_vs_all_reduce"].items()},
        )
    bench.save(result, write=not args.no_save, indent=2)


if __name__ == "__main__":
    main()
