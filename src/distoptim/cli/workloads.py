"""What the workers train and how a run is scored: the workload of a command.

Owns: the :class:`Workload` interface that the training loop, the records and the command line
use -- the model a run builds, the batches each worker reads, the loss it minimizes, how a model
is scored, how much a run processes and in which unit, what is checked before any process
starts -- and its two kinds:

* :class:`Classification`: a :class:`~distoptim.cli.datasets.Dataset` (digits, mnist5k, an
  .npz) and the MLP of :mod:`distoptim.cli.model`. Each epoch every worker reads a disjoint
  shard of the samples (:func:`~distoptim.cli.datasets.shard_indices`) in batches of
  ``--batch-size``, the last batch of the epoch holding the rest of the shard; cross-entropy;
  scored by validation accuracy and loss; whole epochs; amounts in samples.
* :class:`LanguageModel`: Shakespeare's plays (:mod:`distoptim.cli.shakespeare`) and the GPT of
  :mod:`distoptim.cli.gpt`. Each worker reads disjoint shards of ``context + 1``-token windows
  (:class:`~distoptim.cli.lm.WindowPlan`) in batches of ``--batch-size`` windows; next-token
  cross-entropy; scored on the fixed validation subset (:mod:`distoptim.cli.lm`) by loss in
  nats -- bits per character and perplexity follow from it -- and next-character accuracy;
  fractional epochs; amounts in tokens (a batch of B windows is ``B * context`` tokens: the
  positions the loss is taken over). Every algorithm's workers read the same windows for the
  same seed and worker count: the same token budget per worker.

Both are the same for every algorithm: an epoch is the same data for all of them.

:func:`load_workload` picks the kind from ``--dataset``; :func:`as_workload` takes a plain
``Dataset`` where a workload is expected (the MLP on it).
"""

from __future__ import annotations

import abc
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distoptim.cli.datasets import SHAKESPEARE, Dataset, load_dataset, shard_indices, shard_size
from distoptim.cli.metrics import ACCURACY, LOSS, Metric
from distoptim.cli.model import build_model, evaluate
from distoptim.cli.runconfig import RunConfig

__all__ = [
    "Classification",
    "LanguageModel",
    "Workload",
    "as_workload",
    "load_workload",
]

Batch = tuple[torch.Tensor, torch.Tensor]


class Workload(abc.ABC):
    """The data and model of every run of a command (module doc)."""

    name: str
    """The dataset's name (``digits``, ``shakespeare``, the .npz file's name)."""
    model: str
    """The ``--model`` it trains: ``mlp`` or ``gpt``."""
    unit: str
    """What :meth:`amount` counts: ``samples`` or ``tokens``."""
    metric: Metric
    """What its runs are judged by (:mod:`distoptim.cli.metrics`)."""
    baseline: tuple[str, float] | None = None
    """A reference value of the metric any trained model should beat (name, value), or None."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary (sizes, not the data)."""

    @abc.abstractmethod
    def build_model(self, cfg: RunConfig) -> nn.Module:
        """The run's model, initialized from ``cfg.seed`` (same seed, same weights)."""

    @abc.abstractmethod
    def total_steps(self, cfg: RunConfig) -> int:
        """Local steps each worker takes in the run (the same on every worker)."""

    @abc.abstractmethod
    def batches(self, cfg: RunConfig, rank: int) -> Iterator[Batch]:
        """Worker ``rank``'s :meth:`total_steps` batches ``(x, y)``, in order."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The scalar training loss of ``model`` on a batch."""

    @abc.abstractmethod
    def amount(self, x: torch.Tensor) -> int:
        """How much of the data batch ``x`` is, in :attr:`unit`."""

    @abc.abstractmethod
    def total_samples(self, cfg: RunConfig) -> int:
        """What all workers together process in the run, in :attr:`unit`."""

    @abc.abstractmethod
    def evaluate(self, model: nn.Module, split: str = "val") -> tuple[float, float]:
        """``(accuracy, loss)`` of ``model`` on ``split`` (``val`` or ``train``)."""

    @abc.abstractmethod
    def check(self, configs: Sequence[RunConfig]) -> list[str]:
        """Refuse (``ValueError``, one line) what the runs cannot do on this data; return the
        notes to print before the first run."""

    def footer(self) -> list[str]:
        """Lines under the table that belong to the workload."""
        return []


# ---------------------------------------------------------------------------------------------
class Classification(Workload):
    """A classification :class:`~distoptim.cli.datasets.Dataset` and the MLP (module doc)."""

    model = "mlp"
    unit = "samples"
    metric = ACCURACY

    def __init__(self, data: Dataset) -> None:
        self.data = data
        self.name = data.name

    @property
    def num_train(self) -> int:
        return int(self.data.x_train.shape[0])

    def describe(self) -> dict[str, Any]:
        return self.data.describe()

    def build_model(self, cfg: RunConfig) -> nn.Module:
        return build_model(self.data.num_features, self.data.num_classes, cfg.seed, cfg.hidden)

    def total_steps(self, cfg: RunConfig) -> int:
        return int(cfg.epochs) * cfg.steps_per_epoch(self.num_train)

    def batches(self, cfg: RunConfig, rank: int) -> Iterator[Batch]:
        for epoch in range(int(cfg.epochs)):
            idx = shard_indices(self.num_train, rank, cfg.workers, epoch, cfg.seed)
            for start in range(0, len(idx), cfg.batch_size):
                take = idx[start : start + cfg.batch_size]
                yield self.data.x_train[take], self.data.y_train[take]

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x), y)

    def amount(self, x: torch.Tensor) -> int:
        return int(x.shape[0])

    def total_samples(self, cfg: RunConfig) -> int:
        return cfg.total_samples(self.num_train)

    def evaluate(self, model: nn.Module, split: str = "val") -> tuple[float, float]:
        if split == "train":
            return evaluate(model, self.data.x_train, self.data.y_train)
        return evaluate(model, self.data.x_val, self.data.y_val)

    def check(self, configs: Sequence[RunConfig]) -> list[str]:
        """Whole epochs; a batch no larger than a shard; a note when the samples left out of
        each epoch (``N mod n``) are 1 % of the data or more."""
        fractional = sorted({c.epochs for c in configs if c.epochs != int(c.epochs)})
        if fractional:
            raise ValueError(
                f"--epochs {fractional[0]:g}: {self.name} trains whole epochs (a number >= 1); "
                "fractional epochs are for --dataset shakespeare"
            )
        n_train = self.num_train
        notes = []
        for n in sorted({c.workers for c in configs}):
            shard = shard_size(n_train, n)
            if shard < 1:
                raise ValueError(
                    f"dataset too small: {n_train} training samples cannot be shared by {n} workers"
                )
            batch = configs[0].batch_size
            if batch > shard:
                raise ValueError(
                    f"--batch-size {batch} is larger than a worker's shard: {n_train} training "
                    f"samples over {n} workers is {shard} each per epoch (use --batch-size <= "
                    f"{shard} or fewer workers)"
                )
            rest = n_train - shard * n
            if rest and rest >= 0.01 * n_train:
                notes.append(
                    f"note: {n_train} training samples over {n} workers: {shard} each per "
                    f"epoch; {rest} ({100 * rest / n_train:.1f}%) are left out each epoch, "
                    "different ones every epoch (equal shards keep sync's ranks in step)"
                )
        return notes


# ---------------------------------------------------------------------------------------------
class LanguageModel(Workload):
    """Shakespeare's plays and the GPT (module doc); ``corpus`` is a
    :class:`~distoptim.cli.shakespeare.Corpus`."""

    name = SHAKESPEARE
    model = "gpt"
    unit = "tokens"
    metric = LOSS

    def __init__(self, corpus: Any) -> None:
        from distoptim.cli.lm import unigram_loss

        self.corpus = corpus
        self.unigram = unigram_loss(corpus.train, corpus.val, corpus.vocab_size)
        self.baseline = ("unigram", self.unigram)
        self._starts: dict[tuple[str, int], torch.Tensor] = {}

    def describe(self) -> dict[str, Any]:
        return {**self.corpus.describe(), "unit": self.unit, "unigram_val_loss": self.unigram}

    def gpt_config(self, cfg: RunConfig) -> Any:
        """The run's :class:`~distoptim.cli.gpt.GPTConfig` (``ValueError`` if it cannot be)."""
        from distoptim.cli.gpt import GPTConfig

        return GPTConfig(self.corpus.vocab_size, cfg.layers, cfg.width, cfg.heads, cfg.context)

    def window_plan(self, cfg: RunConfig) -> Any:
        """How the run's workers walk the training text (:class:`~distoptim.cli.lm.WindowPlan`)."""
        from distoptim.cli.lm import WindowPlan

        n = int(self.corpus.train.numel())
        return WindowPlan(n, cfg.context, cfg.batch_size, cfg.workers, cfg.seed)

    def build_model(self, cfg: RunConfig) -> nn.Module:
        from distoptim.cli.gpt import build_gpt

        return build_gpt(self.gpt_config(cfg), cfg.seed)

    def total_steps(self, cfg: RunConfig) -> int:
        return self.window_plan(cfg).total_steps(cfg.epochs)

    def batches(self, cfg: RunConfig, rank: int) -> Iterator[Batch]:
        from distoptim.cli.lm import windows

        for starts in self.window_plan(cfg).batch_starts(rank, cfg.epochs):
            yield windows(self.corpus.train, starts, cfg.context)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from distoptim.cli.lm import lm_loss

        return lm_loss(model(x), y)

    def amount(self, x: torch.Tensor) -> int:
        return int(x.numel())

    def total_samples(self, cfg: RunConfig) -> int:
        """``workers * windows * context``: each worker's whole epochs, then the first full
        batches of the next (only an epoch's last batch is short)."""
        plan = self.window_plan(cfg)
        steps = plan.total_steps(cfg.epochs)
        whole, rest = divmod(steps, plan.steps_per_epoch)
        per_worker = whole * plan.windows_per_worker + rest * cfg.batch_size
        return cfg.workers * per_worker * cfg.context

    def _scored(self, split: str, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        from distoptim.cli.lm import validation_starts

        tokens = self.corpus.train if split == "train" else self.corpus.val
        key = (split, context)
        if key not in self._starts:
            self._starts[key] = validation_starts(int(tokens.numel()), context)
        return tokens, self._starts[key]

    def evaluate(self, model: nn.Module, split: str = "val") -> tuple[float, float]:
        """``(next-character accuracy, loss in nats)`` on the fixed subset of 256 windows of
        ``split`` (:func:`~distoptim.cli.lm.validation_starts`; for ``train`` the same rule on
        the training text)."""
        from distoptim.cli.lm import evaluate_lm

        context = model.cfg.context
        tokens, starts = self._scored(split, context)
        score = evaluate_lm(model, tokens, starts, context)
        return float(score.accuracy), score.loss

    def check(self, configs: Sequence[RunConfig]) -> list[str]:
        """Each run's model size and window plan can be built, one validation window fits, a
        batch is no larger than a worker's shard, and the model and a training step fit
        (:func:`_check_size`); a note for a run too short for its algorithm to communicate."""
        from distoptim.cli import algorithms
        from distoptim.cli.lm import validation_starts

        notes = []
        for cfg in configs:
            gpt = self.gpt_config(cfg)
            plan = self.window_plan(cfg)
            if cfg.batch_size > plan.windows_per_worker:
                raise ValueError(
                    f"--batch-size {cfg.batch_size} is larger than a worker's shard: "
                    f"{plan.num_tokens} training characters make {plan.windows_per_epoch} "
                    f"windows of --context {cfg.context}, over {cfg.workers} workers "
                    f"{plan.windows_per_worker} each per epoch (use --batch-size <= "
                    f"{plan.windows_per_worker}, a shorter --context or fewer workers)"
                )
            _check_size(gpt, cfg)
            validation_starts(int(self.corpus.val.numel()), cfg.context)
            steps = plan.total_steps(cfg.epochs)
            if algorithms.get(cfg.algo).periodic and steps < cfg.communication_period:
                notes.append(
                    f"note: {algorithms.label(cfg)} takes {steps} step(s) per worker, fewer "
                    f"than λ = {cfg.communication_period}: it never communicates (more "
                    "--epochs, or a smaller -l)"
                )
        return list(dict.fromkeys(notes))

    def footer(self) -> list[str]:
        val = self.corpus.describe()
        return [
            f"val loss: next-character cross-entropy in nats on 256 windows of the "
            f"{len(val['val_plays'])} held-out plays; bits/char = loss / ln 2, perplexity = "
            f"e^loss; the unigram baseline scores {self.unigram:.3f} nats "
            f"({self.unigram / math.log(2):.3f} bits/char)"
        ]


def _check_size(gpt: Any, cfg: RunConfig) -> None:
    """``ValueError`` naming the options if the GPT has more than
    :data:`~distoptim.cli.gpt.MAX_PARAMETERS` parameters, or if its workers' training steps
    would need more memory than this machine has (the estimate of
    :meth:`~distoptim.cli.gpt.GPTConfig.training_floats`, times the workers)."""
    from distoptim.cli.gpt import MAX_PARAMETERS

    sizes = f"--layers {cfg.layers} --width {cfg.width} --heads {cfg.heads} --context {cfg.context}"
    params = gpt.num_parameters()
    if params > MAX_PARAMETERS:
        raise ValueError(
            f"{sizes}: the GPT would have {params / 1e6:,.1f} M parameters, more than the "
            f"{MAX_PARAMETERS / 1e6:g} M this command trains (fewer --layers or a smaller --width)"
        )
    memory = _physical_memory()
    need = 4 * cfg.workers * gpt.training_floats(cfg.batch_size)
    if memory is not None and need > memory:
        raise ValueError(
            f"{sizes} --batch-size {cfg.batch_size} on {cfg.workers} workers: training would "
            f"need about {need / 2**30:,.1f} GiB (estimated: every worker's parameters, their "
            f"optimizer copies and a batch's activations), more than this machine's "
            f"{memory / 2**30:,.1f} GiB (a smaller --batch-size, --context, --width or "
            "--layers, or fewer workers)"
        )


def _physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def load_workload(spec: str) -> Workload:
    """``--dataset``: ``shakespeare`` -> :class:`LanguageModel`; ``digits``, ``mnist5k`` or an
    .npz path -> :class:`Classification` (``DatasetError`` with one line otherwise)."""
    if spec == SHAKESPEARE:
        from distoptim.cli.shakespeare import load_corpus

        return LanguageModel(load_corpus())
    return Classification(load_dataset(spec))


def as_workload(data: Workload | Dataset) -> Workload:
    """``data`` itself, or a plain ``Dataset`` as a :class:`Classification` workload."""
    return data if isinstance(data, Workload) else Classification(data)
