"""The scaffolding every benchmark script shares: its ``--quick``/``--out`` arguments and its
ending (the load and command line recorded, the JSON written next to ``RESULTS.md``).

A script builds a :class:`Bench` from its ``__file__`` and docstring, adds its own arguments to
``bench.parser``, calls :meth:`Bench.parse` (which records the load average as the run starts)
and ends with :meth:`Bench.save`::

    bench = Bench(__file__, __doc__, quick="a smoke run: tiny model, seconds")
    bench.parser.add_argument("--repeats", type=int, default=60)
    args = bench.parse()
    ...
    bench.save(result)

Where the JSON goes: ``--out`` when given (a file, or a folder to write ``NAME.json`` in);
otherwise ``benchmarks/results/NAME.json``, or ``benchmarks/results/quick/NAME.json`` for a
``--quick`` run, so that a smoke run never replaces the shipped figures. Every saved result
holds ``command`` (the command line as run), ``load_before`` and ``load_after`` (the 1-, 5- and
15-minute load averages when :meth:`Bench.parse` ran and when :meth:`Bench.save` runs) and
``wall_s`` (the seconds between the two).

Not a benchmark: ``tests/test_benchmarks.py`` runs every script in this folder whose name does
not start with ``_``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where the shipped figures live, next to ``RESULTS.md``; quick runs go to ``quick/`` in it."""


def load() -> list[float]:
    """The machine's 1-, 5- and 15-minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def machine(**extra: Any) -> dict[str, Any]:
    """What a result was measured on: cores, platform, Python and torch versions, and
    ``extra`` (a script's backend, threads, device...)."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **extra,
    }


class Bench:
    """One invocation of a benchmark script: its arguments, where its JSON goes, the load and
    time when it started.

    ``quick`` is the help text of ``--quick``; ``name`` names the JSON (default: the script's
    name). ``quick_defaults``, when given, are the defaults
    ``--quick`` changes (arguments given explicitly still win); a script with quick settings
    that are not arguments reads ``args.quick`` itself.
    """

    def __init__(
        self,
        script: str,
        doc: str | None,
        *,
        quick: str,
        quick_defaults: Mapping[str, Any] | None = None,
        raw_help: bool = False,
        name: str | None = None,
    ) -> None:
        self.name = name or Path(script).stem
        self.script = f"benchmarks/{Path(script).name}"
        formatter = argparse.RawTextHelpFormatter if raw_help else argparse.HelpFormatter
        description = (doc or self.name) if raw_help else (doc or self.name).split("\n")[0]
        self.parser = argparse.ArgumentParser(description=description, formatter_class=formatter)
        self.parser.add_argument("--quick", action="store_true", help=quick)
        self.parser.add_argument(
            "--out",
            type=Path,
            default=None,
            help=f"the JSON to write, or a folder to write {self.name}.json in (default "
            f"benchmarks/results/{self.name}.json; with --quick "
            f"benchmarks/results/quick/{self.name}.json, never the shipped figures)",
        )
        self.quick_defaults = dict(quick_defaults or {})
        self.args = argparse.Namespace()
        self.out = RESULTS_DIR / f"{self.name}.json"
        self.out_given = False
        self.command: list[str] = []
        self.load_before: list[float] = []
        self.started = 0.0

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """Parse the command line (``argv``, default ``sys.argv[1:]``), resolve :attr:`out`
        (``args.out`` is set to it too) and record the load and time as the run starts."""
        args = self.parser.parse_args(argv)
        if args.quick and self.quick_defaults:
            self.parser.set_defaults(**self.quick_defaults)
            args = self.parser.parse_args(argv)
        out = args.out
        if out is None:
            out = (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR) / f"{self.name}.json"
        elif out.is_dir() or str(out).endswith(os.sep):
            out = out / f"{self.name}.json"
        self.out_given = args.out is not None
        self.out = args.out = out
        self.args = args
        self.command = ["python", self.script, *(sys.argv[1:] if argv is None else argv)]
        self.load_before = load()
        self.started = time.perf_counter()
        return args

    def save(self, result: dict[str, Any], *, write: bool = True, indent: int = 1) -> Path:
        """The ending: add ``command``, ``load_before``, ``load_after`` and ``wall_s`` to
        ``result``, print the load, and (unless not ``write``) write it as JSON to :attr:`out`
        (its folder made if missing). Returns :attr:`out`."""
        result["command"] = " ".join(self.command)
        result["load_before"] = self.load_before
        result["load_after"] = load()
        result["wall_s"] = time.perf_counter() - self.started
        print(
            f"\nload average before/after: {result['load_before']} / {result['load_after']}; "
            f"wall time {result['wall_s']:.0f} s"
        )
        if write:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(result, indent=indent, default=str) + "\n")
            print(f"wrote {self.out}")
        return self.out
