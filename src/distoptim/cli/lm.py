"""The language-model workload's training pieces: windows, shards, loss, scores, baseline.

Owns: which ``(context + 1)``-token windows of the training text each worker reads at each
step (:class:`WindowPlan`), the next-token cross-entropy, the fixed validation subset and its
scores (loss in nats, bits per character, perplexity), and the unigram baseline those scores
are read against.

**Windows.** A window is ``context + 1`` consecutive tokens ``w``; the model reads
``x = w[:-1]`` and is scored on predicting ``y = w[1:]`` (every position ``t`` predicts token
``t + 1`` from tokens ``<= t``). In epoch ``e`` the training text of ``N`` tokens is cut into
``W = (N - 1) // context - 1`` windows that start at ``o_e + i * context`` (``i < W``): they
tile the text, each window's last token is the next one's first (it is only a target in one
and only an input in the other), and the offset ``o_e in [0, context)`` is drawn each epoch so
that the cuts move. ``W`` does not depend on the offset, so every epoch has the same number of
steps.

**Shards.** Every worker draws the same permutation of the ``W`` windows (seeded by ``seed``
and ``epoch``, like the offset) and takes every ``world_size``-th starting at its rank:
disjoint shards of ``W // world_size`` windows each, together all but the ``W % world_size``
(< ``world_size``) windows left over, which differ each epoch. A shard is read in batches of
``batch_size`` windows, the last one smaller when the shard is not a multiple:
``ceil((W // world_size) / batch_size)`` steps per epoch, the same on every worker (synchronous
workers must take the same number of steps).

**Epochs** count passes over the training text and may be fractional: a run takes
``max(1, round(epochs * steps_per_epoch))`` steps, through whole epochs and then the first
steps of the next (``epochs = 0.05`` is a smoke run).

**Scores.** The validation subset is :data:`VAL_WINDOWS` (256) windows spread evenly over the
validation text (start ``round(j * (M - context - 1) / 255)`` for ``j = 0..255``, ``M``
validation tokens): the same windows for every run, seed and algorithm with the same context
(256 x 64 = 16,384 scored characters at the default context of 64). The loss is the mean
next-token cross-entropy over every position of every window, in nats; bits per character are
``loss / ln 2``; perplexity is ``exp(loss)``; accuracy is the share of scored positions whose
most likely next character (the argmax of the logits) is the right one.

**Baseline.** The unigram model predicts every character with its frequency in the training
text (add-one smoothed, so a character never seen in training costs a finite amount). Its
validation loss (:func:`unigram_loss`) is what a model that ignores context scores; the
entropy of the validation text's own character frequencies (:func:`unigram_entropy`) is the
best any context-free model could score on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distoptim.checks import check_int, check_real

__all__ = [
    "VAL_WINDOWS",
    "LMScore",
    "WindowPlan",
    "evaluate_lm",
    "lm_loss",
    "unigram_entropy",
    "unigram_loss",
    "validation_starts",
    "windows",
]

VAL_WINDOWS = 256
"""Windows in the fixed validation subset (module doc)."""


@dataclass(frozen=True)
class WindowPlan:
    """How ``world_size`` workers walk ``num_tokens`` training tokens (module doc)."""

    num_tokens: int
    context: int
    batch_size: int
    world_size: int
    seed: int

    def __post_init__(self) -> None:
        check_int("context", self.context, 1)
        check_int("batch_size", self.batch_size, 1)
        check_int("world_size", self.world_size, 1)
        check_int("seed", self.seed, 0)
        check_int("num_tokens", self.num_tokens, 0)
        if self.windows_per_epoch < self.world_size:
            raise ValueError(
                f"{self.num_tokens} training tokens make {max(self.windows_per_epoch, 0)} "
                f"windows of context {self.context}, fewer than the {self.world_size} workers "
                "(allowed: a shorter context or fewer workers)"
            )

    @property
    def windows_per_epoch(self) -> int:
        """``W = (N - 1) // context - 1``: the windows that fit at any offset."""
        return (self.num_tokens - 1) // self.context - 1

    @property
    def windows_per_worker(self) -> int:
        """``W // world_size``: each worker's shard of an epoch."""
        return self.windows_per_epoch // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """``ceil(windows_per_worker / batch_size)``, the same on every worker."""
        return -(-self.windows_per_worker // self.batch_size)

    def total_steps(self, epochs: float) -> int:
        """Steps of a run of ``epochs`` passes (``> 0``, may be fractional):
        ``max(1, round(epochs * steps_per_epoch))``."""
        epochs = check_real("epochs", epochs, 0.0, low_open=True)
        return max(1, round(epochs * self.steps_per_epoch))

    def shard_starts(self, rank: int, epoch: int) -> torch.Tensor:
        """Start positions (int64) of the windows worker ``rank`` reads in ``epoch``, in the
        order it reads them."""
        check_int("rank", rank, 0)
        check_int("epoch", epoch, 0)
        if rank >= self.world_size:
            raise ValueError(f"rank must be < world_size {self.world_size}, got {rank}")
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        offset = int(torch.randint(self.context, (1,), generator=gen))
        perm = torch.randperm(self.windows_per_epoch, generator=gen)
        mine = perm[rank : self.windows_per_worker * self.world_size : self.world_size]
        return offset + mine * self.context

    def batch_starts(self, rank: int, epochs: float) -> Iterator[torch.Tensor]:
        """The window starts of each of worker ``rank``'s :meth:`total_steps` batches."""
        total = self.total_steps(epochs)
        step = 0
        epoch = 0
        while step < total:
            starts = self.shard_starts(rank, epoch)
            for first in range(0, len(starts), self.batch_size):
                if step == total:
                    return
                yield starts[first : first + self.batch_size]
                step += 1
            epoch += 1


def windows(tokens: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, ...]:
    """``(x, y)``, both int64 ``(len(starts), context)``: ``x[b] = tokens[s : s + context]``,
    ``y[b] = tokens[s + 1 : s + context + 1]`` for ``s = starts[b]``."""
    idx = starts.long().unsqueeze(1) + torch.arange(context + 1)
    w = tokens[idx].long()
    return w[:, :-1], w[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats over every position:
    ``-(1 / BT) sum_{b,t} log softmax(logits[b, t])[targets[b, t]]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@dataclass(frozen=True)
class LMScore:
    """A validation score: ``loss`` in nats per character and its two other spellings, and
    ``accuracy``, the share of positions whose most likely next token is the right one (None
    when not measured)."""

    loss: float
    accuracy: float | None = None

    @property
    def bits_per_char(self) -> float:
        """``loss / ln 2``."""
        return self.loss / math.log(2)

    @property
    def perplexity(self) -> float:
        """``exp(loss)``."""
        return math.exp(self.loss)

    def as_dict(self) -> dict[str, float]:
        scores = {"loss": self.loss, "bpc": self.bits_per_char, "perplexity": self.perplexity}
        if self.accuracy is not None:
            scores["accuracy"] = self.accuracy
        return scores


def validation_starts(num_tokens: int, context: int, count: int = VAL_WINDOWS) -> torch.Tensor:
    """The ``count`` starts of the fixed validation subset: evenly spaced from 0 to
    ``num_tokens - context - 1`` (module doc); ``ValueError`` if one window does not fit."""
    check_int("context", context, 1)
    check_int("count", count, 1)
    last = num_tokens - context - 1
    if last < 0:
        raise ValueError(
            f"the validation text has {num_tokens} tokens, fewer than one window of "
            f"context {context} + 1"
        )
    return torch.linspace(0, last, count, dtype=torch.float64).round().long()


@torch.no_grad()
def evaluate_lm(
    model: nn.Module,
    tokens: torch.Tensor,
    starts: torch.Tensor,
    context: int,
    batch_size: int = 64,
) -> LMScore:
    """Mean next-token loss of ``model`` over the windows at ``starts``, and its next-token
    accuracy (argmax of the logits), in one pass in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    total = 0.0
    right = 0
    try:
        for first in range(0, len(starts), batch_size):
            x, y = windows(tokens, starts[first : first + batch_size], context)
            logits = model(x)
            logits = logits.reshape(-1, logits.shape[-1])
            total += F.cross_entropy(logits, y.reshape(-1), reduction="sum").item()
            right += int((logits.argmax(dim=1) == y.reshape(-1)).sum())
    finally:
        model.train(was_training)
    scored = len(starts) * context
    return LMScore(total / scored, right / scored)


def unigram_entropy(tokens: torch.Tensor, vocab_size: int) -> float:
    """``H = -sum_c p_c ln p_c`` in nats, ``p_c`` the frequency of token ``c`` in ``tokens``."""
    p = torch.bincount(tokens.long(), minlength=vocab_size).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy in nats of ``val`` under the add-one smoothed character frequencies of
    ``train``: ``-(1/M) sum_t ln q[val_t]``, ``q_c = (n_c + 1) / (N + vocab_size)``."""
    counts = torch.bincount(train.long(), minlength=vocab_size).double() + 1.0
    log_q = (counts / counts.sum()).log()
    return float(-log_q[val.long()].mean())
