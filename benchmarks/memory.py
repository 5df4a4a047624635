"""Benchmark: memory per rank of the synchronous optimizers and DiLoCo, 2 and 4 gloo ranks.

What each option keeps per rank, for the same model (``mlp5m`` of ``cross_shard.py``: 5.0M
float32 parameters in 100 tensors) and the same inner optimizer -- Adam (two moments) or SGD
with Nesterov momentum (one) -- on ``n`` = 2 and 4 ranks. Contenders:

* ``ddp``              -- ``DistributedDataParallel(gradient_as_bucket_view=True)`` + the
  optimizer (DDP's lean setting: ``.grad`` lives in its buckets);
* ``zero``             -- the same DDP + ``ZeroRedundancyOptimizer(parameters_as_bucket_view=
  True)`` (whole parameters partitioned between ranks);
* ``cross_shard``      -- ``CrossShardOptimizer`` (``.grad`` of its own, packed into buckets);
* ``cross_shard_views`` -- the same with ``gradient_as_bucket_view=True``;
* ``sharded``          -- ``CrossShardOptimizer(shard_optimizer_state=True)``;
* ``sharded_views``    -- the same with ``gradient_as_bucket_view=True``;
* ``diloco``           -- ``DiLoCo`` (the optimizer inside, ``SGD(0.7, momentum 0.9, Nesterov)``
  outside, ``sync_every=2``, fp32 wire): a global copy and the outer momentum on top.

Two measures per rank, each contender in a process pair (or quad) of its own:

* **live state**: after 3 steps, every live floating-point tensor storage visible from Python
  (``gc``), counted once, the parameters' and the gradients' storages excluded -- the
  optimizer state and whatever buffers the optimizer keeps between steps. (Storages only C++
  holds are not visible; DDP's buckets are the gradients here, with bucket views.) ``state``:
  the optimizer state alone (per-element tensors; DiLoCo's global copy counted with it).
* **peak RSS**: the peak resident size of the process above its resident size before the model
  was built, over the steps 4-6 (after ``/proc/self/clear_refs`` reset the high-water mark):
  parameters, gradients, state, buffers, activations and every temporary (Adam's, a
  collective's). glibc's malloc runs with a fixed mmap threshold (``MALLOC_MMAP_THRESHOLD_``),
  so freed tensors leave the resident set.

Run::

    python benchmarks/memory.py             # ~10 min on 2 loaded cores
    python benchmarks/memory.py --quick     # a smoke run: a tiny model, 2 ranks, Adam

Prints a table per optimizer and world size and writes ``benchmarks/results/memory.json``
(``--out``). ``--quick`` measures every contender on a model of a few thousand parameters,
one after another in one process pair (the code paths, not the figures), and writes
``benchmarks/results/quick/memory.json`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from _common import Bench
from cross_shard import CASES, QUICK_CASES, machine, model_of
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import CrossShardOptimizer
from distoptim.launch import spawn
from distoptim.outer import DiLoCo

CONTENDERS = [
    "ddp",
    "zero",
    "cross_shard",
    "cross_shard_views",
    "sharded",
    "sharded_views",
    "diloco",
]
OPTIMIZERS = ["adam", "sgd"]
WORLDS = [2, 4]
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "2"}
"""Read by each process's malloc at start-up: freed tensors leave the resident set."""
STEPS = 3


def rss_bytes() -> int:
    """This process's resident size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (since start, or the last :func:`reset_peak`)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Reset the resident high-water mark to the current resident size (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _inner(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, nesterov=True)


def _contender(
    method: str, optimizer: str, dims: tuple[int, int, int], rank: int
) -> tuple[Callable[[], None], nn.Module, Any]:
    """One training iteration of ``method`` (closure), its model and its optimizer."""
    width, depth, batch = dims
    model = model_of(width, depth)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    net: nn.Module = model
    if method == "ddp":
        net = DDP(model, gradient_as_bucket_view=True)
        opt: Any = _inner(optimizer, net.parameters())
    elif method == "zero":
        net = DDP(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(
            net.parameters(),
            optimizer_class=type(_inner(optimizer, [torch.zeros(1, requires_grad=True)])),
            parameters_as_bucket_view=True,
            **_hyper(optimizer),
        )
    elif method == "diloco":
        inner = _inner(optimizer, model.parameters())
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        opt = DiLoCo(inner, outer, sync_every=2)
    else:
        opt = CrossShardOptimizer(
            _inner(optimizer, model.parameters()),
            shard_optimizer_state=method.startswith("sharded"),
            gradient_as_bucket_view=method.endswith("views"),
        )

    def run() -> None:
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()

    return run, model, opt


def _hyper(optimizer: str) -> dict[str, Any]:
    if optimizer == "adam":
        return {"lr": 1e-3}
    return {"lr": 0.01, "momentum": 0.9, "nesterov": True}


def _live_elements(exclude: set[int]) -> int:
    """Elements of every live float tensor storage Python sees, once, outside ``exclude``."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.is_floating_point():
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in exclude and storage.nbytes():
                seen[ptr] = storage.nbytes() // obj.element_size()
    return sum(seen.values())


def _state_elements(method: str, opt: Any, model: nn.Module) -> int:
    """Per-element optimizer state this rank holds (DiLoCo: with its global copy)."""
    if method.startswith("sharded"):
        return _tensors(opt._apply.update.state)
    if method == "zero":
        inner = opt.optim
    elif method == "diloco":
        own = _tensors(opt.wrapped.state) + _tensors(opt.outer.state)
        return own + sum(t.numel() for t in opt.global_parameters)
    else:
        inner = getattr(opt, "wrapped", opt)
    return _tensors(inner.state)


def _tensors(state: Any) -> int:
    return sum(
        v.numel()
        for s in state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.is_floating_point()
    )


def _measure(
    rank: int, world: int, methods: list[str], optimizer: str, dims: tuple[int, int, int]
) -> dict[str, dict[str, int]]:
    """Each of ``methods`` in turn: live state after STEPS, peak RSS over STEPS more.

    What lives before the first contender is built (the imported modules, the process group:
    some 300,000 objects, no floating-point tensor among them) is frozen out of the garbage
    collector first (``gc.freeze``), so that each ``gc.collect`` and each scan of
    :func:`_live_elements` visits only what the contenders made: the same storages are
    counted, in a fraction of the time (the scans were most of a quick run's CPU)."""
    warnings.filterwarnings("ignore")
    gc.collect()
    gc.freeze()
    out = {}
    for method in methods:
        gc.collect()
        before = rss_bytes()
        run, model, opt = _contender(method, optimizer, dims, rank)
        for _ in range(STEPS):
            run()
        params = list(model.parameters())
        exclude = {p.untyped_storage().data_ptr() for p in params}
        exclude |= {p.grad.untyped_storage().data_ptr() for p in params if p.grad is not None}
        live = _live_elements(exclude)
        state = _state_elements(method, opt, model)
        reset_peak()
        for _ in range(STEPS):
            run()
        out[method] = {
            "live_elements": live,
            "state_elements": state,
            "params": sum(p.numel() for p in params),
            "peak_rss_growth_bytes": peak_rss_bytes() - before,
        }
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
        del run, model, opt, params
    return out


def _table(rows: dict[str, dict[str, int]], params: int) -> list[str]:
    lines = [
        f"  {'contender':<19}{'state MB':>9}{'live MB':>9}{'live/params':>12}{'peak RSS MB':>13}"
    ]
    for method, r in rows.items():
        lines.append(
            f"  {method:<19}{r['state_elements'] * 4 / 1e6:9.1f}"
            f"{r['live_elements'] * 4 / 1e6:9.1f}{r['live_elements'] / params:12.2f}"
            f"{r['peak_rss_growth_bytes'] / 1e6:13.1f}"
        )
    return lines


README_ROWS = {
    "cross_shard": "CrossShard, defaults",
    "cross_shard_views": "`gradient_as_bucket_view=True`",
    "sharded": "`shard_optimizer_state=True`",
    "sharded_views": "both",
    "ddp": "DDP (`gradient_as_bucket_view=True`), for reference",
}
"""The README's rows: what each CrossShard option costs and saves, DDP beside them."""


def readme_table(runs: dict[str, Any]) -> str:
    """The README's table, from a recorded run's ``runs``: per option, what a rank keeps
    between steps beyond parameters and gradients (live state, MB) and its peak RSS growth
    (MB), for Adam and momentum SGD on 2 and 4 ranks (cells ``2 ranks / 4 ranks``)."""

    def cell(method: str, optimizer: str, key: str, scale: float, digits: int) -> str:
        return " / ".join(
            f"{runs[f'{optimizer}/{w}'][method][key] / scale:.{digits}f}" for w in WORLDS
        )

    lines = [
        "| options | Adam: kept, MB | Adam: peak RSS, MB | SGD momentum: kept, MB "
        "| SGD momentum: peak RSS, MB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for method, label in README_ROWS.items():
        cells = [
            cell(method, opt, key, scale, digits)
            for opt in OPTIMIZERS
            for key, scale, digits in (
                ("live_elements", 0.25e6, 1),
                ("peak_rss_growth_bytes", 1e6, 0),
            )
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    bench = Bench(__file__, __doc__, quick="a smoke run: tiny model, seconds")
    bench.parser.add_argument("--no-save", action="store_true", help="do not write the JSON")
    args = bench.parse()
    dims = next(iter(QUICK_CASES.values())) if args.quick else CASES["mlp5m"]
    worlds = [2] if args.quick else WORLDS
    optimizers = ["adam"] if args.quick else OPTIMIZERS
    runs: dict[str, Any] = {}
    with mock.patch.dict(os.environ, MALLOC):
        for world in worlds:
            for optimizer in optimizers:
                if args.quick:  # one process pair, contenders in turn
                    ranks = spawn(
                        _measure,
                        world,
                        args=(CONTENDERS, optimizer, dims),
                        timeout=300,
                        start_method="spawn",  # MALLOC at start-up: a forked child lacks it
                    )
                else:  # a process group of its own per contender
                    ranks = [{} for _ in range(world)]
                    for method in CONTENDERS:
                        got = spawn(
                            _measure,
                            world,
                            args=([method], optimizer, dims),
                            timeout=600,
                            start_method="spawn",
                        )
                        for mine, theirs in zip(ranks, got):
                            mine.update(theirs)
                runs[f"{optimizer}/{world}"] = {
                    m: {k: max(r[m][k] for r in ranks) for k in ranks[0][m]} for m in CONTENDERS
                }
    result: dict[str, Any] = {
        "runs": runs,
        "machine": {**machine("gloo (loopback)"), "ranks": worlds},
        "settings": {"model": dims, "steps": STEPS, "malloc": MALLOC, "worlds": worlds},
        "note": "per rank, the largest over the ranks; elements are float32 (4 bytes)",
    }
    for key, rows in runs.items():
        optimizer, world = key.split("/")
        params = next(iter(rows.values()))["params"]
        print(f"\n{optimizer}, {world} ranks, {params:,} parameters (float32), per rank:")
        print("\n".join(_table(rows, params)))
    bench.save(result, write=not args.no_save, indent=2)


if __name__ == "__main__":
    main()
