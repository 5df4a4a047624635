"""What a run did: :class:`RunRecord`, built from the workers' progress events and counters.

Owns: the record of one run (status, times, accuracies, communication counters, history) and
how it is made from what the processes return -- the history from their progress events
(:func:`build_history`), the final accuracies from the final parameters, the counters of the
process group (sync) or of the parameter servers (async) -- and the record of a run that did
not finish (:func:`partial_record`).

For the language model (``--model gpt``) ``val_acc``/``train_acc`` are next-character
accuracies, ``val_loss``/``train_loss`` losses in nats per character on the fixed subsets of
:mod:`distoptim.cli.lm` (:meth:`RunRecord.to_dict` adds bits per character and perplexity), and
``samples`` count tokens (the workload's unit).

What is measured: wall time from the moment all workers are ready (process start-up excluded)
until the last one finishes; validation accuracy during training, evaluated by one worker
(sync: rank 0, whose parameters every rank shares; async: the chief, on the center variables
it pulls from the parameter server); final train/validation accuracy of the final parameters
(sync: rank 0's; async: the center after every worker finished). Samples processed at a point
in time: the sum over workers of the samples each had finished by its latest progress report.

Bytes moved at an evaluation (``history[i]["bytes"]``, what "bytes to target" reads):

* ``collective`` family -- measured: the evaluating rank's bytes sent at that step plus every
  other rank's at the same step (each reports a ``mark`` there), so the sum is exact;
* ``server`` family -- estimated: the parameter server counts bytes only in total, so a point
  gets the total's share of the samples processed by then (``bytes_moved · samples /
  samples_total``). Each worker moves a fixed payload every λ of its steps, so the estimate is
  off by at most about one commit per worker. ``bytes_history`` says which.

The chief's evaluation pulls (one pull of the whole center per evaluation) measure, they do not
train: they are left out of ``bytes_moved`` (and recorded in ``stats.evaluation_pull_bytes``),
as sync's evaluation on rank 0 moves nothing either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from distoptim.cli import algorithms
from distoptim.cli.datasets import Dataset
from distoptim.cli.metrics import LOSS, metric_of
from distoptim.cli.model import load_parameters
from distoptim.cli.runconfig import RunConfig
from distoptim.cli.workloads import Workload, as_workload

__all__ = [
    "RunRecord",
    "build_history",
    "finish_record",
    "partial_record",
    "record_collective",
    "record_server",
]


@dataclass
class RunRecord:
    """What one run did; ``status`` is ``ok``, ``failed`` or ``interrupted``.

    ``startup_s``: seconds from handing the run to its processes until the first worker was
    ready (process group or cluster built, model made); ``overhead_s``: everything of the run
    that was not training (``startup_s``, the wait for the last worker's result, the final
    evaluation), measured by the parent.
    """

    config: RunConfig
    status: str = "ok"
    error: str | None = None
    wall_time_s: float | None = None
    startup_s: float | None = None
    overhead_s: float | None = None
    train_acc: float | None = None
    val_acc: float | None = None
    train_loss: float | None = None
    val_loss: float | None = None
    communications: int | None = None
    communication_kind: str = ""
    bytes_moved: int | None = None
    samples: int | None = None
    temporal_efficiency: float | None = None
    temporal_efficiency_reference: str | None = None
    target_acc: float | None = None
    target_loss: float | None = None
    target_reference: str | None = None
    time_to_target_s: float | None = None
    bytes_to_target: int | None = None
    bytes_history: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return algorithms.label(self.config)

    @property
    def metric(self) -> Any:
        """What this run is judged by (:func:`distoptim.cli.metrics.metric_of` its model)."""
        return metric_of(self.config.model)

    @property
    def target(self) -> float | None:
        """The target of "time / bytes to target" in this run's metric."""
        return self.target_loss if self.metric is LOSS else self.target_acc

    @target.setter
    def target(self, value: float | None) -> None:
        if self.metric is LOSS:
            self.target_loss = value
        else:
            self.target_acc = value

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = asdict(self.config)
        d["label"] = self.label
        d["settings"] = algorithms.get(self.config.algo).settings(self.config)
        d["metric"] = self.metric.name
        if self.metric is LOSS:  # the language model: the loss's two other spellings
            for split in ("train", "val"):
                loss = d[f"{split}_loss"]
                finite = loss is not None and math.isfinite(loss)
                d[f"{split}_bpc"] = loss / math.log(2) if finite else None
                d[f"{split}_perplexity"] = math.exp(min(loss, 700.0)) if finite else None
        return d


def build_history(events: Sequence[dict[str, Any]]) -> tuple[float | None, list[dict]]:
    """``(t0, points)`` from the workers' progress events.

    ``t0`` is the earliest ``start``; each ``eval`` event becomes a point ``{t, samples,
    val_acc, val_loss, train_loss, bytes}`` with ``t`` in seconds since ``t0``, ``samples`` the
    sum over workers of their latest reported sample count at that time, and ``bytes`` the
    evaluating worker's ``bytes`` plus every other worker's ``mark`` at the same ``step`` (None
    unless every worker reported one; see the module doc).
    """
    starts = [e["t"] for e in events if e["kind"] == "start"]
    if not starts:
        return None, []
    t0 = min(starts)
    ticks = sorted((e for e in events if e["kind"] in ("tick", "start")), key=lambda e: e["t"])
    evals = sorted((e for e in events if e["kind"] == "eval"), key=lambda e: e["t"])
    marks: dict[int, dict[int, int]] = {}  # step -> worker -> bytes sent by then
    for e in events:
        if e["kind"] == "mark" and "bytes" in e:
            marks.setdefault(e["step"], {})[e["worker"]] = e["bytes"]
    workers = {e["worker"] for e in events}
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
        others = marks.get(ev.get("step", -1), {})
        sent = None
        if "bytes" in ev and workers - {ev["worker"]} <= set(others):
            sent = ev["bytes"] + sum(b for w, b in others.items() if w != ev["worker"])
        points.append(
            {
                "t": ev["t"] - t0,
                "samples": sum(latest.values()),
                "val_acc": ev["acc"],
                "val_loss": ev["loss"],
                "train_loss": sum(loss.values()) / len(loss) if loss else None,
                "bytes": sent,
            }
        )
    return t0, points


def finish_record(
    record: RunRecord,
    data: Workload | Dataset,
    events: list[dict[str, Any]],
    final_params: Sequence[torch.Tensor],
) -> float | None:
    """Fill times, samples, history and final scores into ``record``; returns ``t0``
    (``time.time()`` when the first worker was ready), or None without a start event."""
    workload = as_workload(data)
    t0, points = build_history(events)
    ends = [e for e in events if e["kind"] == "finish"]
    model = workload.build_model(record.config)
    load_parameters(model, final_params)
    record.train_acc, record.train_loss = workload.evaluate(model, "train")
    record.val_acc, record.val_loss = workload.evaluate(model, "val")
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
                "bytes": record.bytes_moved,
            }
        )
    record.history = points
    _bytes_history(record)
    return t0


def _bytes_history(record: RunRecord) -> None:
    """Fill the points' ``bytes`` that were not measured with the samples' share (module doc)."""
    total, moved = record.samples, record.bytes_moved
    measured = all(p.get("bytes") is not None for p in record.history)
    record.bytes_history = "measured" if measured else "estimated from samples"
    if measured or moved is None or not total:
        return
    for p in record.history:
        if p.get("bytes") is None:
            p["bytes"] = round(moved * min(p["samples"], total) / total)


def partial_record(
    cfg: RunConfig, events: list[dict[str, Any]], status: str, error: str
) -> RunRecord:
    """A record for a run that did not finish: the history its workers had reported so far.

    ``val_acc``/``val_loss`` are the last evaluation before the run stopped; ``wall_time_s``
    and ``samples`` how far it got. Train accuracy stays unknown (no final parameters).
    """
    record = RunRecord(cfg, status=status, error=error)
    record.communication_kind = algorithms.get(cfg.algo).communication_kind
    t0, record.history = build_history(events)
    if record.history:
        record.val_acc = record.history[-1]["val_acc"]
        record.val_loss = record.history[-1]["val_loss"]
    if t0 is not None:
        record.wall_time_s = max(e["t"] for e in events) - t0
        last: dict[int, int] = {}
        for e in events:
            if "samples" in e:
                last[e["worker"]] = max(last.get(e["worker"], 0), e["samples"])
        record.samples = sum(last.values())
    return record


def record_collective(record: RunRecord, outs: Sequence[dict[str, Any]]) -> tuple[list, list]:
    """Counters of a process-group run into ``record``; returns (all events, rank 0's params).

    ``outs``: what every rank's worker returned (``events``, ``collectives``, ``syncs``,
    ``bytes_sent``; rank 0 also ``params``).
    """
    record.communication_kind = kind = algorithms.get(record.config.algo).communication_kind
    record.communications = outs[0]["syncs" if kind == "syncs" else "collectives"]
    record.bytes_moved = sum(o["bytes_sent"] for o in outs)
    record.stats = {
        "syncs": outs[0]["syncs"],
        "collectives_per_rank": [o["collectives"] for o in outs],
        "bytes_sent_per_rank": [o["bytes_sent"] for o in outs],
    }
    return [e for o in outs for e in o["events"]], outs[0]["params"]


def record_server(
    record: RunRecord,
    stats: Any,
    worker_events: Sequence[list[dict[str, Any]] | None],
    center: Sequence[torch.Tensor],
) -> list[dict[str, Any]]:
    """Counters of a parameter-server run into ``record``; returns every worker's events.

    ``stats``: the merged :class:`distoptim.agn.ClusterStats` of the shards;
    ``worker_events``: each worker's events (None for a worker that returned nothing);
    ``center``: the final center (its size is what one evaluation pull moved).
    """
    events = [e for evs in worker_events if evs is not None for e in evs]
    pulls = sum(1 for e in events if e["kind"] == "eval")  # one pull of the center each
    pull_bytes = pulls * sum(t.numel() * t.element_size() for t in center)
    record.communications = int(sum(stats.commits_per_worker.values()))
    record.communication_kind = "commits"
    record.bytes_moved = int(stats.bytes_in + stats.bytes_out) - pull_bytes
    record.stats = stats.as_dict()  # JSON types already (string keys)
    record.stats["evaluation_pull_bytes"] = pull_bytes
    if stats.dead_workers:
        record.error = f"dead workers: {list(stats.dead_workers)}"
    return events
