"""One training run: the same MLP, the same data, one algorithm, N worker processes.

Owns: the training loop every worker runs, how each algorithm's optimizer is built from the
library's public API, starting the processes (locally, or as one rank under ``torchrun``),
and turning what the workers did into a :class:`RunRecord`.

The CLI holds no algorithm logic: every worker runs the same loop ::

    opt.zero_grad(); loss = cross_entropy(model(x), y); loss.backward(); opt.step()

and the algorithms differ only in the optimizer that wraps ``torch.optim``:

=========  ==============================================================================
sync       ``distoptim.CrossShardOptimizer(opt, reduction="mean")``, N gloo ranks
           (``distoptim.launch.spawn``); per-worker batch B -> global batch N*B
agn        ``distoptim.AGNOptimizer(opt, N, custom_getter, communication_period=λ)``
downpour   ``distoptim.DownpourOptimizer(opt, N, custom_getter, communication_period=λ)``
easgd      ``distoptim.ElasticAverageOptimizer(opt, N, custom_getter, communication_period=τ)``
=========  ==============================================================================

the three asynchronous ones on a parameter server cluster (``distoptim.agn.spawn``: one PS
process + N workers). Every worker reads a disjoint 1/N shard of the training set each epoch,
so an epoch is the same number of samples for every algorithm.

What is measured: wall time from the moment all workers are ready (process start-up excluded)
until the last one finishes; validation accuracy during training, evaluated by one worker
(sync: rank 0, whose parameters every rank shares; async: the chief, on the center variables
it pulls from the parameter server); final train/validation accuracy of the final parameters
(sync: rank 0's; async: the center after every worker finished). Samples processed at a point
in time: the sum over workers of the samples each had finished by its latest progress report.

Run under torchrun (multi-node), one process per rank::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        -m distoptim.cli.train --algo sync --epochs 30 --out results/

With an async ``--algo`` the first ``--num-ps`` ranks are parameter-server shards and the rest
are workers (8 processes, ``--num-ps 1``: 7 workers); the chief (the first worker) writes the
outputs.

Outside torchrun ``python -m distoptim.cli.train ...`` is the same as ``distoptim train ...``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from distoptim.cli.datasets import Dataset, shard_indices
from distoptim.cli.model import build_model, evaluate, load_parameters
from distoptim.cli.progress import Reporter
from distoptim.launch import from_bytes, to_bytes

__all__ = [
    "ALGORITHMS",
    "ASYNC_ALGORITHMS",
    "OPTIMIZERS",
    "AlgorithmUnavailableError",
    "RunConfig",
    "RunRecord",
    "async_available",
    "build_history",
    "main",
    "make_torch_optimizer",
    "partial_record",
    "run_local",
    "run_torchrun",
]

ALGORITHMS = ("sync", "agn", "downpour", "easgd")
ASYNC_ALGORITHMS = ("agn", "downpour", "easgd")
_ASYNC_CLASS = {
    "agn": "AGNOptimizer",
    "downpour": "DownpourOptimizer",
    "easgd": "ElasticAverageOptimizer",
}
OPTIMIZERS = ("sgd", "momentum", "adam")
DEFAULT_LR = {"sgd": 0.05, "momentum": 0.01, "adam": 0.001}
"""Per-optimizer learning rate when ``--lr`` is not given (tuned on digits, see README)."""


class AlgorithmUnavailableError(RuntimeError):
    """An algorithm's library module is not importable in this installation."""


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; validated by the command line before any process starts."""

    algo: str
    workers: int
    communication_period: int
    epochs: int
    batch_size: int
    optimizer: str
    lr: float
    seed: int
    num_ps: int = 1
    eval_points: int = 25
    timeout: float = 900.0
    repeat: int = 0

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"algo must be one of {', '.join(ALGORITHMS)}, got {self.algo!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        for name in ("workers", "communication_period", "epochs", "batch_size", "num_ps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if self.eval_points < 1:
            raise ValueError(f"eval_points must be >= 1, got {self.eval_points}")

    @property
    def is_async(self) -> bool:
        return self.algo in ASYNC_ALGORITHMS

    @property
    def label(self) -> str:
        """Short human name: ``sync n=4`` / ``agn λ=10 n=4`` (n: workers; ``#2``: repeat 2)."""
        lam = "" if self.algo == "sync" else f" λ={self.communication_period}"
        rep = f" #{self.repeat + 1}" if self.repeat else ""
        return f"{self.algo}{lam} n={self.workers}{rep}"

    def steps_per_epoch(self, num_train: int) -> int:
        """Local steps each worker takes per epoch (its shard, full batches only)."""
        return (num_train // self.workers) // self.batch_size

    def total_samples(self, num_train: int) -> int:
        """Samples all workers together process in the whole run."""
        return self.epochs * self.steps_per_epoch(num_train) * self.batch_size * self.workers


@dataclass
class RunRecord:
    """What one run did; ``status`` is ``ok``, ``failed`` or ``interrupted``."""

    config: RunConfig
    status: str = "ok"
    error: str | None = None
    wall_time_s: float | None = None
    train_acc: float | None = None
    val_acc: float | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    communications: int | None = None
    communication_kind: str = ""
    bytes_moved: int | None = None
    samples: int | None = None
    temporal_efficiency: float | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = asdict(self.config)
        d["label"] = self.config.label
        return d


def make_torch_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``sgd`` -> SGD; ``momentum`` -> SGD(momentum=0.9); ``adam`` -> Adam."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")


def async_available() -> str | None:
    """None when ``distoptim.agn`` (the parameter-server algorithms) can be used, else why not."""
    if importlib.util.find_spec("distoptim.agn") is None:
        return "the parameter-server package distoptim.agn is not part of this installation"
    try:
        agn = importlib.import_module("distoptim.agn")
        missing = [n for n in ("spawn",) if not hasattr(agn, n)]
        import distoptim

        for cls in _ASYNC_CLASS.values():
            try:
                getattr(distoptim, cls)
            except (AttributeError, ImportError):
                missing.append(f"distoptim.{cls}")
    except Exception as exc:  # a half-built package: say what broke
        return f"distoptim.agn cannot be imported ({type(exc).__name__}: {exc})"
    if missing:
        return f"distoptim.agn lacks {', '.join(missing)}"
    return None


# ---------------------------------------------------------------------------------------------
# the loop every worker runs
# ---------------------------------------------------------------------------------------------
def _batches(cfg: RunConfig, data: Dataset, rank: int) -> Iterator[tuple[torch.Tensor, ...]]:
    n = int(data.x_train.shape[0])
    steps = cfg.steps_per_epoch(n)
    for epoch in range(cfg.epochs):
        idx = shard_indices(n, rank, cfg.workers, epoch, cfg.seed)
        for s in range(steps):
            take = idx[s * cfg.batch_size : (s + 1) * cfg.batch_size]
            yield data.x_train[take], data.y_train[take]


def _train_loop(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    cfg: RunConfig,
    data: Dataset,
    rank: int,
    reporter: Reporter,
    evaluator: Callable[[], tuple[float, float]] | None,
) -> int:
    """Run every local step; report progress; ``evaluator`` (on one worker) scores as it goes.

    Returns the number of local steps taken.
    """
    total = cfg.epochs * cfg.steps_per_epoch(int(data.x_train.shape[0]))
    eval_every = max(1, total // cfg.eval_points)
    tick_every = max(1, total // 50)
    reporter.start()
    if evaluator is not None:
        reporter.evaluation(*evaluator())
    step = 0
    for xb, yb in _batches(cfg, data, rank):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        step += 1
        reporter.step(int(xb.shape[0]), loss.item())
        if step % tick_every == 0 or step == total:
            reporter.tick()
        if evaluator is not None and step % eval_every == 0 and step != total:
            reporter.evaluation(*evaluator())
    reporter.finish()
    return step


def _ignore_sigint() -> None:
    """Local workers leave Ctrl-C to the parent, which stops them all and writes what it has."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _sync_worker(
    rank: int, world_size: int, cfg: RunConfig, data: Dataset, sink: Any, local: bool
) -> dict[str, Any]:
    import torch.distributed as dist

    import distoptim

    if local:
        _ignore_sigint()
    model = build_model(data.num_features, data.num_classes, cfg.seed)  # same init on all ranks
    opt = distoptim.CrossShardOptimizer(
        make_torch_optimizer(cfg.optimizer, model.parameters(), cfg.lr), reduction="mean"
    )
    reporter = Reporter(sink, rank)

    def score() -> tuple[float, float]:
        return evaluate(model, data.x_val, data.y_val)

    dist.barrier()  # the clock starts when every rank is ready
    steps = _train_loop(model, opt, cfg, data, rank, reporter, score if rank == 0 else None)
    stats = opt.comm_stats
    return {
        "events": reporter.events,
        "steps": steps,
        "params": [p.detach().clone() for p in model.parameters()] if rank == 0 else None,
        "collectives": int(stats.collectives),
        "bytes_sent": int(stats.bytes_sent),
    }


def _async_worker(ctx: Any, cfg: RunConfig, data: Dataset, sink: Any, local: bool) -> dict:
    import distoptim

    if local:
        _ignore_sigint()
    model = build_model(data.num_features, data.num_classes, cfg.seed)
    cls = getattr(distoptim, _ASYNC_CLASS[cfg.algo])
    opt = cls(
        make_torch_optimizer(cfg.optimizer, model.parameters(), cfg.lr),
        ctx.num_worker,
        custom_getter=ctx.custom_getter,
        communication_period=cfg.communication_period,
    )
    hook = opt.make_session_run_hook(ctx.is_chief, ctx.task_index)
    hook.begin()
    hook.after_create_session()  # chief seeds the center; the others wait for it and pull
    reporter = Reporter(sink, ctx.task_index)
    evaluator = None
    if ctx.is_chief:
        scratch = build_model(data.num_features, data.num_classes, cfg.seed)

        def evaluator() -> tuple[float, float]:
            load_parameters(scratch, opt.center_variables())
            return evaluate(scratch, data.x_val, data.y_val)

    steps = _train_loop(model, opt, cfg, data, ctx.task_index, reporter, evaluator)
    return {"events": reporter.events, "steps": steps}


# ---------------------------------------------------------------------------------------------
# from worker outputs to a record
# ---------------------------------------------------------------------------------------------
def build_history(events: Sequence[dict[str, Any]]) -> tuple[float | None, list[dict]]:
    """``(t0, points)`` from the workers' progress events.

    ``t0`` is the earliest ``start``; each ``eval`` event becomes a point ``{t, samples,
    val_acc, val_loss, train_loss}`` with ``t`` in seconds since ``t0`` and ``samples`` the
    sum over workers of their latest reported sample count at that time.
    """
    starts = [e["t"] for e in events if e["kind"] == "start"]
    if not starts:
        return None, []
    t0 = min(starts)
    ticks = sorted((e for e in events if e["kind"] in ("tick", "start")), key=lambda e: e["t"])
    evals = sorted((e for e in events if e["kind"] == "eval"), key=lambda e: e["t"])
    latest: dict[int, int] = {}
    loss: dict[int, float] = {}
    points = []
    i = 0
    for ev in evals:
        while i < len(ticks) and ticks[i]["t"] <= ev["t"]:
            latest[ticks[i]["worker"]] = ticks[i]["samples"]
            if ticks[i].get("loss") is not None:
                loss[ticks[i]["worker"]] = ticks[i]["loss"]
            i += 1
        latest[ev["worker"]] = max(latest.get(ev["worker"], 0), ev["samples"])
        points.append(
            {
                "t": ev["t"] - t0,
                "samples": sum(latest.values()),
                "val_acc": ev["acc"],
                "val_loss": ev["loss"],
                "train_loss": sum(loss.values()) / len(loss) if loss else None,
            }
        )
    return t0, points


def _finish_record(
    record: RunRecord,
    data: Dataset,
    events: list[dict[str, Any]],
    final_params: Sequence[torch.Tensor],
) -> None:
    """Fill times, samples, history and final accuracies into ``record``."""
    cfg = record.config
    t0, points = build_history(events)
    ends = [e for e in events if e["kind"] == "finish"]
    model = build_model(data.num_features, data.num_classes, cfg.seed)
    load_parameters(model, final_params)
    record.train_acc, record.train_loss = evaluate(model, data.x_train, data.y_train)
    record.val_acc, record.val_loss = evaluate(model, data.x_val, data.y_val)
    record.samples = sum(e["samples"] for e in ends)
    if t0 is not None and ends:
        record.wall_time_s = max(e["t"] for e in ends) - t0
        losses = [e["loss"] for e in ends if e.get("loss") is not None]
        points.append(
            {
                "t": record.wall_time_s,
                "samples": record.samples,
                "val_acc": record.val_acc,
                "val_loss": record.val_loss,
                "train_loss": sum(losses) / len(losses) if losses else None,
            }
        )
    record.history = points


def partial_record(
    cfg: RunConfig, events: list[dict[str, Any]], status: str, error: str
) -> RunRecord:
    """A record for a run that did not finish: the history its workers had reported so far.

    ``val_acc``/``val_loss`` are the last evaluation before the run stopped; ``wall_time_s``
    and ``samples`` how far it got. Train accuracy stays unknown (no final parameters).
    """
    record = RunRecord(cfg, status=status, error=error)
    t0, record.history = build_history(events)
    if record.history:
        record.val_acc = record.history[-1]["val_acc"]
        record.val_loss = record.history[-1]["val_loss"]
    if t0 is not None:
        latest = [e["t"] for e in events]
        record.wall_time_s = max(latest) - t0
        last: dict[int, int] = {}
        for e in events:
            if "samples" in e:
                last[e["worker"]] = max(last.get(e["worker"], 0), e["samples"])
        record.samples = sum(last.values())
    return record


@contextlib.contextmanager
def _child_env(link_env: str | None) -> Iterator[None]:
    """Environment the worker processes inherit for the duration of one run.

    * ``DISTOPTIM_LINK``: the emulated link, when one is asked for (children read it on their
      first message; nothing else is needed for the transports to honour it);
    * ``TORCH_CPP_LOG_LEVEL=ERROR`` unless the user set it: the RPC agents log a C++ warning
      for every connection a finished worker closes, which would bury the progress display.
    """
    from distoptim.comm.link import ENV_VAR

    wanted = {"TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    if link_env is not None:
        wanted[ENV_VAR] = link_env
    before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_local(
    cfg: RunConfig, data: Dataset, sink: Any = None, link_env: str | None = None
) -> RunRecord:
    """Train once with ``cfg.workers`` local processes; raises what the launcher raises.

    ``sink``: a ``multiprocessing`` queue (spawn context) that receives the workers' progress
    events as they happen, or None. ``link_env``: ``Link(...).to_env()`` to emulate a slower
    network in every child process, or None for the real loopback.
    """
    if cfg.is_async:
        why = async_available()
        if why is not None:
            raise AlgorithmUnavailableError(f"algorithm {cfg.algo!r} is unavailable: {why}")
    record = RunRecord(cfg)
    with _child_env(link_env):
        if cfg.algo == "sync":
            from distoptim.launch import spawn

            outs = spawn(
                _sync_worker, cfg.workers, args=(cfg, data, sink, True), timeout=cfg.timeout
            )
            events, final = _sync_outputs(record, outs)
        else:
            import distoptim.agn

            result = distoptim.agn.spawn(
                _async_worker,
                cfg.workers,
                num_ps=cfg.num_ps,
                args=(cfg, data, sink, True),
                timeout=cfg.timeout,
            )
            events, final = _async_outputs(record, result)
    _finish_record(record, data, events, final)
    return record


def _sync_outputs(record: RunRecord, outs: Sequence[dict[str, Any]]) -> tuple[list, list]:
    """Counters of a sync run into ``record``; returns (all events, rank 0's parameters)."""
    record.communications = outs[0]["collectives"]
    record.communication_kind = "all-reduces"
    record.bytes_moved = sum(o["bytes_sent"] for o in outs)
    record.stats = {
        "collectives_per_rank": [o["collectives"] for o in outs],
        "bytes_sent_per_rank": [o["bytes_sent"] for o in outs],
    }
    return [e for o in outs for e in o["events"]], outs[0]["params"]


def _async_outputs(record: RunRecord, result: Any) -> tuple[list, list]:
    """Counters of a parameter-server run into ``record``; returns (events, final center).

    ``result``: what ``distoptim.agn.spawn`` returns (``worker_results``, ``stats``, ``center``).
    """
    outs = [o for o in result.worker_results if o is not None]
    stats = result.stats
    record.communications = int(sum(stats.commits_per_worker.values()))
    record.communication_kind = "commits"
    record.bytes_moved = int(stats.bytes_in + stats.bytes_out)
    record.stats = _jsonable(stats.as_dict())
    if stats.dead_workers:
        record.error = f"dead workers: {list(stats.dead_workers)}"
    return [e for o in outs for e in o["events"]], list(result.center)


def _sync_worker_gathered(
    rank: int, world_size: int, cfg: RunConfig, data: Dataset, sink: Any
) -> list[dict[str, Any]] | None:
    """Under torchrun: train, then gather every rank's counters and events on rank 0."""
    import torch.distributed as dist

    out = _sync_worker(rank, world_size, cfg, data, sink, False)
    params = out.pop("params")
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, out)
    if rank != 0:
        return None
    gathered[0]["params"] = params
    return gathered


def run_torchrun(
    cfg: RunConfig, data: Dataset, sink: Any = None, link_env: str | None = None
) -> RunRecord | None:
    """This process is one rank of a torchrun job: train; one rank returns the record.

    sync: every rank trains in torchrun's process group (gloo: the model lives on the CPU);
    rank 0 returns the record. Async: the first ``cfg.num_ps`` ranks serve as parameter-server
    shards and the others are workers (``distoptim.agn.Cluster.from_env``); the chief (worker 0)
    returns the record. ``sink``: where the reporting rank's progress events go.
    """
    with _child_env(link_env):
        if cfg.is_async:
            return _torchrun_async(cfg, data, sink)
        from distoptim.launch import torchrun_main

        rank = int(os.environ.get("RANK", "0"))
        outs = torchrun_main(
            _sync_worker_gathered,
            cfg,
            data,
            sink if rank == 0 else None,
            backend="gloo",
            timeout=cfg.timeout,
        )
    if outs is None:
        return None
    record = RunRecord(cfg)
    events, final = _sync_outputs(record, outs)
    _finish_record(record, data, events, final)
    return record


def _torchrun_async(cfg: RunConfig, data: Dataset, sink: Any) -> RunRecord | None:
    """One rank of an async torchrun job; the chief gathers what it needs to report.

    The shards' reports (final center, counters) and the workers' progress events reach the
    chief through torchrun's rendezvous store (``MASTER_ADDR:MASTER_PORT``): each worker puts
    its events there before it leaves the cluster, each shard its report once it stopped
    serving; the chief, after leaving, waits for them (bounded by ``cfg.timeout``).
    """
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from distoptim.agn import Cluster
    from distoptim.agn.cluster import merge_reports

    wait = timedelta(seconds=cfg.timeout)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait
    )
    prefix = f"distoptim-cli/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    cluster = Cluster.from_env(num_ps=cfg.num_ps)
    if cluster.is_ps:
        try:
            report = cluster.serve(timeout=cfg.timeout)
        finally:
            cluster.shutdown()
        store.set(f"{prefix}report/{report.shard}", to_bytes(report))
        return None
    ok = False
    try:
        out = _async_worker(cluster, cfg, data, sink if cluster.is_chief else None, False)
        store.set(f"{prefix}events/{cluster.task_index}", to_bytes(out["events"]))
        ok = True
    finally:
        cluster.shutdown(failed=not ok)
    if not cluster.is_chief:
        return None
    keys = [f"{prefix}report/{s}" for s in range(cfg.num_ps)]
    store.wait(keys, wait)
    reports = [from_bytes(store.get(k)) for k in keys]
    stats, centers, _ = merge_reports(
        reports, cluster.num_worker, max(r.wall_time_s for r in reports)
    )
    finished = sorted({t for r in reports for t in r.finished_workers})
    keys = [f"{prefix}events/{t}" for t in finished]
    store.wait(keys, wait)
    results: list[Any] = [None] * cluster.num_worker
    for t, k in zip(finished, keys):
        results[t] = {"events": from_bytes(store.get(k))}
    result = SimpleNamespace(
        worker_results=results, stats=stats, center=next(iter(centers.values()))
    )
    record = RunRecord(cfg)
    events, final = _async_outputs(record, result)
    _finish_record(record, data, events, final)
    return record


def _jsonable(value: Any) -> Any:
    """Stats as plain JSON types (dict keys become strings, tensors numbers/lists)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# ---------------------------------------------------------------------------------------------
# python -m distoptim.cli.train
# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """``python -m distoptim.cli.train``: one rank of a torchrun job, or ``distoptim train``."""
    from distoptim.cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return cli_main.main(["train", *argv])
    return cli_main.torchrun_train(argv)


if __name__ == "__main__":
    sys.exit(main())
