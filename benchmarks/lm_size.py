"""Benchmark: does the default GPT beat the unigram baseline on Shakespeare within minutes?

One process, one intra-op thread, batch 16, Adam: the workload of ONE worker of
``distoptim compare --dataset shakespeare`` (``distoptim.cli.shakespeare``: 33 training plays,
5 held-out plays; ``distoptim.cli.gpt``; ``distoptim.cli.lm``). Contenders (model size as
layers x width x heads x context, Adam learning rate):

* ``default_lr3e-3``: the default size 2 x 128 x 4 x 64 (414,592 parameters), lr 3e-3;
* ``default_lr1e-3``: the same at lr 1e-3 (the command line's Adam default for the digits);
* ``4layers_lr3e-3``: 4 x 128 x 4 x 64 (811,136 parameters), lr 3e-3 -- why not deeper.

The contenders train interleaved, ``--eval-every`` steps each in turn (shuffled per round),
each with its own seeded model and its own window plan (seed 0, one worker), so a burst of load
from other jobs hits them alike. After each chunk the contender is scored on the fixed
validation subset (256 windows, ``distoptim.cli.lm``) outside the step clock. The anchor is
the unigram baseline: the validation loss of the training text's add-one smoothed character
frequencies, and the entropy of the validation text's own frequencies (the floor of any model
that ignores context). Printed per contender: validation loss (nats, bits/char, ratio to the
unigram loss) at each evaluation, the training time so far, and the median step time.

Run::

    python benchmarks/lm_size.py            # 1,500 steps per contender, ~10-15 min on 2 cores
    python benchmarks/lm_size.py --quick    # 20 steps of the default (smoke run)

Prints a table and writes ``benchmarks/results/lm_size.json``.
"""

from __future__ import annotations

import platform
import random
import statistics
import time

import torch
from _common import Bench, machine

from distoptim.cli.gpt import GPTConfig, build_gpt
from distoptim.cli.lm import (
    WindowPlan,
    evaluate_lm,
    lm_loss,
    unigram_entropy,
    unigram_loss,
    validation_starts,
    windows,
)
from distoptim.cli.shakespeare import load_corpus

BATCH = 16
CONTENDERS = {
    "default_lr3e-3": ((2, 128, 4, 64), 3e-3),
    "default_lr1e-3": ((2, 128, 4, 64), 1e-3),
    "4layers_lr3e-3": ((4, 128, 4, 64), 3e-3),
}


class _Run:
    """One contender: its model, optimizer, batches and what was measured."""

    def __init__(self, name: str, size: tuple[int, ...], lr: float, corpus, steps: int) -> None:
        self.name = name
        self.cfg = GPTConfig(corpus.vocab_size, *size)
        self.model = build_gpt(self.cfg, 0)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        plan = WindowPlan(corpus.train.numel(), self.cfg.context, BATCH, 1, 0)
        self.batches = plan.batch_starts(0, steps / plan.steps_per_epoch)
        self.val_starts = validation_starts(corpus.val.numel(), self.cfg.context)
        self.record = {
            "size": {"layers": size[0], "width": size[1], "heads": size[2], "context": size[3]},
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "lr": lr,
            "step_s": [],
            "evals": [],
        }

    def train(self, corpus, n: int) -> None:
        for _ in range(n):
            starts = next(self.batches)
            began = time.perf_counter()
            x, y = windows(corpus.train, starts, self.cfg.context)
            loss = lm_loss(self.model(x), y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.record["step_s"].append(time.perf_counter() - began)

    def evaluate(self, corpus, baseline: float) -> dict:
        score = evaluate_lm(self.model, corpus.val, self.val_starts, self.cfg.context)
        row = {
            "step": len(self.record["step_s"]),
            "train_s": sum(self.record["step_s"]),
            **score.as_dict(),
            "ratio_to_unigram": score.loss / baseline,
        }
        self.record["evals"].append(row)
        return row


def main() -> None:
    bench = Bench(__file__, __doc__, quick="20 steps of the default only")
    bench.parser.add_argument("--steps", type=int, default=1500)
    bench.parser.add_argument("--eval-every", type=int, default=250)
    bench.parser.add_argument("--seed", type=int, default=0, help="shuffles each round's order")
    args = bench.parse()
    torch.set_num_threads(1)
    contenders = dict(list(CONTENDERS.items())[:1]) if args.quick else CONTENDERS
    steps, every = (20, 10) if args.quick else (args.steps, args.eval_every)
    t0 = time.perf_counter()
    corpus = load_corpus()
    load_s = time.perf_counter() - t0
    baseline = unigram_loss(corpus.train, corpus.val, corpus.vocab_size)
    entropy = unigram_entropy(corpus.val, corpus.vocab_size)
    print(f"corpus: {corpus.describe()} (read in {load_s:.1f} s)")
    print(
        f"unigram: validation loss {baseline:.4f} nats ({baseline / 0.6931471805599453:.3f} "
        f"bits/char); validation entropy {entropy:.4f} nats "
        f"({entropy / 0.6931471805599453:.3f} bits/char)"
    )
    runs = [_Run(name, size, lr, corpus, steps) for name, (size, lr) in contenders.items()]
    rng = random.Random(args.seed)
    order = []
    done = 0
    while done < steps:
        chunk = min(every, steps - done)
        rng.shuffle(runs)
        order.append([r.name for r in runs])
        for run in runs:
            run.train(corpus, chunk)
            row = run.evaluate(corpus, baseline)
            print(
                f"{run.name:<16} step {row['step']:>5}  val {row['loss']:.4f} nats "
                f"{row['bpc']:.3f} bpc  /unigram {row['ratio_to_unigram']:.3f}  "
                f"train {row['train_s']:.0f} s",
                flush=True,
            )
        done += chunk
    print(
        f"\n{'contender':<16} {'params':>9} {'step ms':>8} {'val nats':>9} {'bpc':>6} "
        f"{'/unigram':>8} {'train s':>8}"
    )
    summary = {}
    for run in sorted(runs, key=lambda r: r.name):
        last = run.record["evals"][-1]
        step_ms = 1000 * statistics.median(run.record["step_s"])
        summary[run.name] = {
            "parameters": run.record["parameters"],
            "median_step_ms": step_ms,
            "final": last,
        }
        print(
            f"{run.name:<16} {run.record['parameters']:>9,} {step_ms:>8.1f} "
            f"{last['loss']:>9.4f} {last['bpc']:>6.3f} {last['ratio_to_unigram']:>8.3f} "
            f"{last['train_s']:>8.0f}"
        )
    result = {
        "benchmark": "lm_size",
        "machine": machine(processor=platform.processor(), threads=torch.get_num_threads()),
        "config": {"batch": BATCH, "steps": steps, "eval_every": every, "order": order},
        "corpus": corpus.describe(),
        "unigram": {"val_loss": baseline, "val_entropy": entropy},
        "summary": summary,
        "runs": {r.name: r.record for r in runs},
    }
    bench.save(result)


if __name__ == "__main__":
    main()
