"""Benchmark: the Shakespeare language model under the communication-efficient family.

Two parts, both on the default GPT of ``distoptim compare --dataset shakespeare`` (2 layers x
128, 4 heads, context 64, 414,592 parameters; ``distoptim.cli.gpt``), Adam at lr 3e-3 inside
every wrapper, batches of 16 windows per worker from the LM's disjoint window shards
(``distoptim.cli.lm.WindowPlan``, seed 0), local gloo ranks, one intra-op thread each.

**1. Validation loss and bytes at the same token budget** (``--world`` 4 replicas, ``--steps``
1,000 local steps each: every contender's workers read exactly the same windows). Contenders:

* ``sync``: ``CrossShardOptimizer(Adam)``, a gradient all-reduce every step (global batch 64),
  at the command line's lr 3e-3 (measured best for one worker's batch of 16);
* ``sync_sqrt_lr``: the same with Adam's lr scaled by the square root of its ``world``-times
  larger batch (6e-3 for 4 replicas), the usual rule for Adam: a sync that is not handicapped
  by a learning rate chosen for a smaller batch;
* ``diloco_h100``: ``DiLoCo(Adam, outer, sync_every=100)``, fp32;
* ``streaming_h100_f4_int8`` / ``streaming_h100_f4_int4``: ``DiLoCo(..., sync_every=100,
  fragments=4, fragment_sync_delay=1, fragment_update_alpha=0.5, wire="int8" / "int4")`` --
  Streaming DiLoCo, one fragment syncing every 25 steps;
* ``diloco_h100_topk0.02_int2``: ``DiLoCo(..., sync_every=100, wire="topk:0.02+int2")`` --
  chunked top-k at 2 % density with 2-bit values (SparseLoCo's recipe), error feedback on.

``outer`` is the command line's default outer optimizer, Nesterov SGD at lr 1.0, momentum 0.5
(``--outer-lr``, ``--outer-momentum``). The contenders run one after another in a shuffled
order inside one launch, each from the same seeded model. Every ``--eval-every`` steps (and
at the end) the ranks stop their clocks, rank 0 scores the run's model -- sync's parameters,
the DiLoCo family's global copy -- on the fixed validation subset (256 windows of the five
held-out plays, ``distoptim.cli.lm``), and the clocks start again. Bytes are the optimizers'
own ``comm_stats.bytes_sent`` of every rank, summed (exact: counted as sent, headers and
setup checks included). Reported per contender: the final validation loss (nats, bits per
character), the relative loss gap ``(L - L_sync) / L_sync`` against the better of the two
syncs (the lower final loss; both send the same bytes), total bytes and the paired ratio
``bytes(sync) / bytes(contender)`` (the same token budget), training wall time; and the
issue's goals, each met or missed: Streaming DiLoCo (int8 or lower) within 2 % of sync's
validation loss with >= 400x fewer bytes; a top-k + low-bit variant within 2 % with >= 1,000x
fewer bytes.

Part 1 is deterministic: a contender's losses and bytes do not depend on the machine's load
or on the other contenders (same seed, same windows, gloo on the CPU), only its wall time
does. ``--resume FILE`` therefore adds the contenders a recorded run lacks (a contender added
to the script later, or a run that was stopped) to that run's figures instead of training
every contender again; each invocation's contenders and load are recorded.

**2. Step time under each wrapper against plain DDP** (2 ranks: on a 2-core machine more
would time the scheduler). Contenders, each on its own copy of the model: ``ddp``
(``DistributedDataParallel`` + Adam), ``cross_shard`` (``CrossShardOptimizer``),
``localsgd_h20``, ``diloco_h20``, ``streaming_h20_f4_int4`` and ``diloco_h20_topk0.02_int2``.
Interleaved: each of ``--rounds`` rounds runs every contender for one block of ``H = 20``
steps, in a shuffled order; a block's time is the slowest rank's, so each block holds exactly
one full sync of the H = 20 wrappers (Streaming: four fragment syncs of a quarter each) and
the time per step includes its share of a sync -- a heavier share than at H = 100. Reported:
the median step time per contender, and the paired ratio to DDP (the median over rounds of
``block(contender) / block(ddp)`` of the same round).

Run::

    python benchmarks/lm.py            # ~25-40 min on 2 shared cores
    python benchmarks/lm.py --quick    # a smoke run: 2 replicas, 8 steps, H = 8, a 28 k GPT,
                                       # both parts in one launch
    python benchmarks/lm.py --resume benchmarks/results/lm.json --skip-step-time   # add the
                                       # contenders the recorded run lacks

Prints the tables and writes ``benchmarks/results/lm.json`` (``--out``; a ``--quick`` run
writes ``benchmarks/results/quick/lm.json`` unless ``--out`` says otherwise). The machine's
load average is recorded at the start and the end of each part.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import Bench, load, machine

import distoptim
from distoptim.cli.gpt import GPTConfig, build_gpt
from distoptim.cli.lm import (
    VAL_WINDOWS,
    WindowPlan,
    evaluate_lm,
    lm_loss,
    validation_starts,
    windows,
)
from distoptim.cli.shakespeare import load_corpus
from distoptim.launch import spawn

BATCH = 16
LR = 3e-3
SIZE = {"layers": 2, "width": 128, "heads": 4, "context": 64}
QUICK = {"world": 2, "steps": 8, "eval_every": 8, "sync_every": 8, "rounds": 1}
"""The defaults ``--quick`` changes (arguments given explicitly still win): one sync of every
DiLoCo contender, every fragment of the streaming ones, one round of part 2."""
QUICK_VAL_WINDOWS = 32
"""``--quick``'s validation windows (the real runs score the CLI's fixed subset)."""
QUICK_SIZE = {"layers": 2, "width": 32, "heads": 2, "context": 32}
"""``--quick``'s GPT (28 k parameters instead of 415 k): a smoke run checks the code paths,
and its CPU is mostly the training of 12 contenders; same layer structure, so every wrapper
(fragments included) meets the same kinds of parameters."""
GOALS = {
    "streaming": {"max_loss_gap": 0.02, "min_bytes_ratio": 400.0},
    "topk_lowbit": {"max_loss_gap": 0.02, "min_bytes_ratio": 1000.0},
}
"""The issue's goals: Streaming DiLoCo (int8 or lower) within 2 % of sync's validation loss
with >= 400x fewer bytes; a top-k + low-bit variant within 2 % with >= 1,000x fewer bytes."""


def _contenders(h: int, fragments: int) -> dict[str, dict[str, Any] | None]:
    """Part 1's contenders: name -> DiLoCo's keyword arguments (None: sync; ``{"lr_scale":
    "sqrt"}``: sync with Adam's lr times the square root of the number of replicas)."""
    streaming = {"fragments": fragments, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    return {
        "sync": None,
        "sync_sqrt_lr": {"lr_scale": "sqrt"},
        f"diloco_h{h}": {"sync_every": h},
        f"streaming_h{h}_f{fragments}_int8": {"sync_every": h, **streaming, "wire": "int8"},
        f"streaming_h{h}_f{fragments}_int4": {"sync_every": h, **streaming, "wire": "int4"},
        f"diloco_h{h}_topk0.02_int2": {"sync_every": h, "wire": "topk:0.02+int2"},
    }


def _step_contenders(h: int, fragments: int) -> dict[str, dict[str, Any] | None]:
    """Part 2's wrappers: name -> DiLoCo's keyword arguments (None: DDP or CrossShard;
    ``{"localsgd": H}``: LocalSGD)."""
    streaming = {"fragments": fragments, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    return {
        "ddp": None,
        "cross_shard": None,
        f"localsgd_h{h}": {"localsgd": h},
        f"diloco_h{h}": {"sync_every": h},
        f"streaming_h{h}_f{fragments}_int4": {"sync_every": h, **streaming, "wire": "int4"},
        f"diloco_h{h}_topk0.02_int2": {"sync_every": h, "wire": "topk:0.02+int2"},
    }


def _model(vocab: int, size: dict[str, int]) -> torch.nn.Module:
    return build_gpt(GPTConfig(vocab, **size), seed=0)  # the same weights for every contender


def _optimizer(
    model: torch.nn.Module, kwargs: dict[str, Any] | None, outer: tuple[float, float]
) -> Any:
    if kwargs is not None and kwargs.get("lr_scale") == "sqrt":
        lr = LR * math.sqrt(dist.get_world_size())
        adam = torch.optim.Adam(model.parameters(), lr=lr)
        return distoptim.CrossShardOptimizer(adam, reduction="mean")
    inner = torch.optim.Adam(model.parameters(), lr=LR)
    if kwargs is None:
        return distoptim.CrossShardOptimizer(inner, reduction="mean")
    if "localsgd" in kwargs:
        return distoptim.LocalSGD(inner, sync_every=kwargs["localsgd"])
    lr, momentum = outer
    global_opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=True)
    return distoptim.DiLoCo(inner, global_opt, **kwargs)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _total(count: int) -> int:
    t = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


# ---------------------------------------------------------------------------------------------
# part 1: validation loss and bytes at the same token budget
# ---------------------------------------------------------------------------------------------
def _quality_run(
    rank: int, world: int, name: str, kwargs: dict | None, corpus: Any, cfg: dict
) -> dict[str, Any]:
    context = cfg["size"]["context"]
    model = _model(corpus.vocab_size, cfg["size"])
    opt = _optimizer(model, kwargs, cfg["outer"])
    scratch = _model(corpus.vocab_size, cfg["size"])
    val = validation_starts(corpus.val.numel(), context, cfg["val_windows"])
    plan = WindowPlan(corpus.train.numel(), context, BATCH, world, 0)
    batches = plan.batch_starts(rank, cfg["steps"] / plan.steps_per_epoch)
    history: list[dict[str, Any]] = []
    clock = 0.0

    def score(step: int) -> None:  # outside the clock: every rank waits for rank 0's scoring
        sent = _total(opt.comm_stats.bytes_sent)
        if rank == 0:
            # the run's model: sync's parameters, the DiLoCo family's global copy
            params = getattr(opt, "global_parameters", None) or list(model.parameters())
            with torch.no_grad():
                for p, v in zip(scratch.parameters(), params):
                    p.copy_(v)
            loss = evaluate_lm(scratch, corpus.val, val, context).loss
            history.append({"step": step, "train_s": clock, "bytes": sent, "val_loss": loss})
        dist.barrier()

    score(0)
    step = 0
    while step < cfg["steps"]:
        chunk = min(cfg["eval_every"], cfg["steps"] - step)
        dist.barrier()
        began = time.perf_counter()
        for _ in range(chunk):
            x, y = windows(corpus.train, next(batches), context)
            opt.zero_grad(set_to_none=True)
            lm_loss(model(x), y).backward()
            opt.step()
        clock += _slowest(time.perf_counter() - began)
        step += chunk
        score(step)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, int(opt.comm_stats.bytes_sent))
    if rank != 0:
        return {}
    final = history[-1]["val_loss"]
    sync = kwargs is None or "lr_scale" in kwargs
    lr = LR * (math.sqrt(world) if kwargs is not None and "lr_scale" in kwargs else 1.0)
    return {
        "settings": {"wrapper": "CrossShardOptimizer", "lr": lr} if sync else kwargs,
        "steps_per_worker": step,
        "tokens_per_worker": step * BATCH * context,
        "train_s": clock,
        "bytes": sum(per_rank),
        "bytes_per_rank": per_rank,
        "val_loss": final,
        "val_bpc": final / math.log(2),
        "history": history,
    }


def _quality_worker(rank: int, world: int, order: list[str], corpus: Any, cfg: dict) -> dict:
    contenders = _contenders(cfg["h"], cfg["fragments"])
    out = {}
    for name in order:
        record = _quality_run(rank, world, name, contenders[name], corpus, cfg)
        if rank == 0:
            out[name] = record
            print(
                f"  {name:<28} val {record['val_loss']:.4f} nats  {record['bytes'] / 1e6:10.2f} "
                f"MB  {record['train_s']:6.0f} s",
                flush=True,
            )
    return out


def _verdicts(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Byte ratios and loss gaps against the better sync (the lower final validation loss;
    every sync sends the same bytes), and the goals met or missed."""
    syncs = [n for n in runs if n.startswith("sync")]
    reference = min(syncs, key=lambda n: runs[n]["val_loss"])
    sync, plain = runs[reference], runs["sync"]["val_loss"]
    for r in runs.values():
        r["bytes_ratio_vs_sync"] = sync["bytes"] / r["bytes"] if r["bytes"] else None
        r["loss_gap_vs_sync"] = (r["val_loss"] - sync["val_loss"]) / sync["val_loss"]
        r["loss_gap_vs_sync_lr3e-3"] = (r["val_loss"] - plain) / plain
    goals = {}
    for goal, names in (
        ("streaming", [n for n in runs if n.startswith("streaming")]),
        ("topk_lowbit", [n for n in runs if "topk" in n]),
    ):
        need = GOALS[goal]
        rows = {}
        for name in names:
            r = runs[name]
            rows[name] = {
                "loss_gap": r["loss_gap_vs_sync"],
                "bytes_ratio": r["bytes_ratio_vs_sync"],
                "loss_met": r["loss_gap_vs_sync"] <= need["max_loss_gap"],
                "bytes_met": (r["bytes_ratio_vs_sync"] or 0) >= need["min_bytes_ratio"],
            }
            rows[name]["met"] = rows[name]["loss_met"] and rows[name]["bytes_met"]
        goals[goal] = {**need, "contenders": rows, "met": any(v["met"] for v in rows.values())}
    return {"reference": reference, **goals}


# ---------------------------------------------------------------------------------------------
# part 2: step time under each wrapper vs plain DDP
# ---------------------------------------------------------------------------------------------
def _step_worker(rank: int, world: int, order: list[list[str]], corpus: Any, cfg: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    context = cfg["size"]["context"]
    contenders = _step_contenders(cfg["h"], cfg["fragments"])
    models, opts = {}, {}
    for name, kwargs in contenders.items():
        model = _model(corpus.vocab_size, cfg["size"])
        if name == "ddp":
            models[name] = DistributedDataParallel(model)
            opts[name] = torch.optim.Adam(models[name].parameters(), lr=LR)
        else:
            models[name] = model
            opts[name] = _optimizer(model, kwargs, cfg["outer"])
    plan = WindowPlan(corpus.train.numel(), context, BATCH, world, 0)
    steps = cfg["h"] * len(order) * len(contenders)
    batches = plan.batch_starts(rank, steps / plan.steps_per_epoch)
    blocks: dict[str, list[float]] = {name: [] for name in contenders}
    for round_order in order:
        for name in round_order:
            model, opt = models[name], opts[name]
            dist.barrier()
            began = time.perf_counter()
            for _ in range(cfg["h"]):
                x, y = windows(corpus.train, next(batches), context)
                opt.zero_grad(set_to_none=True)
                lm_loss(model(x), y).backward()
                opt.step()
            blocks[name].append(_slowest(time.perf_counter() - began))
    return blocks if rank == 0 else {}


def _both_parts_worker(
    rank: int,
    world: int,
    quality: tuple[list[str], dict],
    steps: tuple[list[list[str]], dict],
    corpus: Any,
) -> tuple[dict, dict]:
    """``--quick``: part 1, then part 2, on the same ranks (one spawn instead of two: each
    start of a rank costs seconds of CPU, more than a smoke run's training)."""
    (quality_order, quality_cfg), (step_order, step_cfg) = quality, steps
    ran = _quality_worker(rank, world, quality_order, corpus, quality_cfg)
    return ran, _step_worker(rank, world, step_order, corpus, step_cfg)


def _step_summary(blocks: dict[str, list[float]], h: int) -> dict[str, Any]:
    ddp = blocks["ddp"]
    out = {}
    for name, times in blocks.items():
        ratios = [t / d for t, d in zip(times, ddp)]
        out[name] = {
            "median_step_ms": 1000 * statistics.median(times) / h,
            "block_s": times,
            "paired_ratio_vs_ddp": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
        }
    return out


# ---------------------------------------------------------------------------------------------
def _print_quality(runs: dict[str, dict[str, Any]], goals: dict[str, Any]) -> None:
    print(
        f"\n{'contender':<28} {'val nats':>9} {'bpc':>6} {'gap vs sync':>11} {'MB':>10} "
        f"{'fewer bytes':>11} {'train s':>8}"
    )
    for name, r in runs.items():
        ratio = r["bytes_ratio_vs_sync"]
        print(
            f"{name:<28} {r['val_loss']:>9.4f} {r['val_bpc']:>6.3f} "
            f"{100 * r['loss_gap_vs_sync']:>10.2f}% {r['bytes'] / 1e6:>10.2f} "
            f"{'-' if ratio is None else f'{ratio:,.0f}x':>11} {r['train_s']:>8.0f}"
        )
    print(f"loss gaps against {goals['reference']}")
    for goal, g in goals.items():
        if goal == "reference":
            continue
        print(
            f"goal {goal}: within {100 * g['max_loss_gap']:g} % with >= "
            f"{g['min_bytes_ratio']:,.0f}x fewer bytes: {'MET' if g['met'] else 'MISSED'}"
        )


class _TwoSpawns:
    """How the real runs start the parts: each in its own launch, part 1 on ``world`` ranks,
    part 2 on 2."""

    def __init__(self, world: int, corpus: Any) -> None:
        self.world, self.corpus = world, corpus

    def quality(self, order: list[str], cfg: dict) -> dict:
        args = (order, self.corpus, cfg)
        return spawn(_quality_worker, self.world, args, timeout=7200, num_threads=1)[0]

    def steps(self, order: list[list[str]], cfg: dict) -> dict:
        return spawn(_step_worker, 2, (order, self.corpus, cfg), timeout=3600, num_threads=1)[0]


class _OneSpawn(_TwoSpawns):
    """``--quick`` (2 replicas): both parts on the same 2 ranks in one launch, part 2's plan
    fixed before part 1 starts (a rank's start costs more CPU than a smoke run's training)."""

    def __init__(self, corpus: Any, step_order: list[list[str]], step_cfg: dict) -> None:
        super().__init__(2, corpus)
        self.step_plan = (step_order, step_cfg)
        self.blocks: dict | None = None

    def quality(self, order: list[str], cfg: dict) -> dict:
        both = ((order, cfg), self.step_plan, self.corpus)
        ran, self.blocks = spawn(_both_parts_worker, 2, both, timeout=3600, num_threads=1)[0]
        return ran

    def steps(self, order: list[list[str]], cfg: dict) -> dict:
        if self.blocks is None or (order, cfg) != self.step_plan:  # part 1 had nothing to run
            return super().steps(order, cfg)
        return self.blocks


def _quality(
    args: argparse.Namespace,
    corpus: Any,
    outer: tuple,
    rng: random.Random,
    before: dict | None,
    size: dict[str, int],
    launch: _TwoSpawns,
) -> dict[str, Any]:
    """Part 1: train the contenders ``before`` (a recorded run's ``quality``, with
    ``--resume``) lacks, and judge all of them."""
    cfg = {
        "size": size,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "h": args.sync_every,
        "fragments": 4,
        "outer": outer,
        "val_windows": QUICK_VAL_WINDOWS if args.quick else VAL_WINDOWS,
    }
    shape = {
        "world": args.world,
        "steps_per_worker": args.steps,
        "eval_every": args.eval_every,
        "sync_every": args.sync_every,
        "fragments": cfg["fragments"],
        "outer": list(outer),
    }
    done: dict[str, Any] = {}
    invocations: list[dict[str, Any]] = []
    if before is not None:
        recorded = {k: before.get(k) for k in shape}
        recorded["outer"] = before.get("outer", list(outer))
        if recorded != shape:
            raise SystemExit(f"--resume: the recorded run was {recorded}, this one {shape}")
        done = dict(before["runs"])
        invocations = before.get("invocations") or [
            {k: before[k] for k in ("order", "load_before", "load_after")}
        ]
    every = list(_contenders(cfg["h"], cfg["fragments"]))
    order = [name for name in every if name not in done]
    rng.shuffle(order)
    load_before, began = load(), time.perf_counter()
    if order:
        print(f"part 1: {args.world} replicas, {args.steps} steps each, order {order}", flush=True)
        done.update(launch.quality(order, cfg))
    invocations.append(
        {
            "order": order,
            "load_before": load_before,
            "load_after": load(),
            "elapsed_s": time.perf_counter() - began,
        }
    )
    runs = {name: done[name] for name in every if name in done}
    goals = _verdicts(runs)
    _print_quality(runs, goals)
    return {
        **shape,
        "order": [name for inv in invocations for name in inv["order"]],
        "load_before": invocations[0]["load_before"],
        "load_after": invocations[-1]["load_after"],
        "invocations": invocations,
        "runs": runs,
        "goals": goals,
    }


def _step_plan(
    args: argparse.Namespace, outer: tuple, rng: random.Random, size: dict[str, int]
) -> tuple[list[list[str]], dict]:
    """Part 2's rounds (each a shuffled order of the wrappers) and its settings."""
    step_h = 8 if args.quick else 20
    names = list(_step_contenders(step_h, 4))
    order = [rng.sample(names, len(names)) for _ in range(args.rounds)]
    return order, {"h": step_h, "fragments": 4, "outer": outer, "size": size}


def _step_time(
    args: argparse.Namespace, plan: tuple[list[list[str]], dict], launch: _TwoSpawns
) -> dict[str, Any]:
    """Part 2: every wrapper's step time against DDP's, interleaved over ``args.rounds``."""
    order, cfg = plan
    step_h = cfg["h"]
    load_before = load()
    print(f"\npart 2: 2 ranks, {args.rounds} rounds of {step_h} steps per contender", flush=True)
    blocks = launch.steps(order, cfg)
    steps = _step_summary(blocks, step_h)
    print(f"{'wrapper':<28} {'median step ms':>14} {'vs DDP (paired)':>16}")
    for name, s in steps.items():
        print(f"{name:<28} {s['median_step_ms']:>14.1f} {s['paired_ratio_vs_ddp']:>16.3f}")
    return {
        "world": 2,
        "sync_every": step_h,
        "rounds": args.rounds,
        "order": order,
        "load_before": load_before,
        "load_after": load(),
        "contenders": steps,
    }


def main() -> None:
    bench = Bench(__file__, __doc__, quick="2 replicas, 8 steps, H = 8", quick_defaults=QUICK)
    parser = bench.parser
    parser.add_argument("--world", type=int, default=4, help="replicas of part 1 (default 4)")
    parser.add_argument("--steps", type=int, default=1000, help="local steps per worker")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--sync-every", type=int, default=100, help="H of part 1")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of part 2")
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.5)
    parser.add_argument("--skip-quality", action="store_true", help="part 2 only")
    parser.add_argument("--skip-step-time", action="store_true", help="part 1 only")
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a recorded lm.json: train only the contenders it lacks, keep its figures (and, "
        "with --skip-step-time, its part 2); written to --out (default: that file)",
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffles the contenders' order")
    args = bench.parse()
    if args.resume and not bench.out_given:
        bench.out = args.out = args.resume
    previous = json.loads(args.resume.read_text()) if args.resume else {}
    rng = random.Random(args.seed)
    outer = (args.outer_lr, args.outer_momentum)
    corpus = load_corpus()
    size = QUICK_SIZE if args.quick else SIZE
    launch = _TwoSpawns(args.world, corpus)
    step_plan = None
    if args.quick and args.world == 2 and not (args.skip_quality or args.skip_step_time):
        step_plan = _step_plan(args, outer, rng, size)
        launch = _OneSpawn(corpus, *step_plan)
    result: dict[str, Any] = {
        "benchmark": "lm",
        "machine": machine(processor=platform.processor(), threads_per_rank=1),
        "config": {
            "model": size,
            "parameters": sum(p.numel() for p in _model(corpus.vocab_size, size).parameters()),
            "batch_windows_per_worker": BATCH,
            "inner": {"optimizer": "Adam", "lr": LR},
            "outer": {"optimizer": "SGD", "lr": outer[0], "momentum": outer[1], "nesterov": True},
            "quick": args.quick,
        },
        "corpus": corpus.describe(),
        "goals": GOALS,
    }
    if not args.skip_quality:
        result["quality"] = _quality(
            args, corpus, outer, rng, previous.get("quality"), size, launch
        )
    if not args.skip_step_time:
        result["step_time"] = _step_time(
            args, step_plan or _step_plan(args, outer, rng, size), launch
        )
    elif "step_time" in previous:
        result["step_time"] = previous["step_time"]
    bench.save(result)


if __name__ == "__main__":
    main()
