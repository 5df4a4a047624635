"""The values of the command line's options: an option's text becomes its value, or is refused.

Owns one parser per kind of value (:data:`~distoptim.cli.options.OPTIONS` names them as
``parse=``): each turns the text into the value or raises ``argparse.ArgumentTypeError`` with
one line, in the command line's words, saying what is wrong and what is allowed. The rules
themselves are :mod:`distoptim.checks`' (and the registries': algorithms, wire formats).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from distoptim.checks import check_choice, check_int, check_real
from distoptim.cli import algorithms
from distoptim.cli.algorithms import ALGORITHMS
from distoptim.cli.runconfig import MAX_SEED, delayed_nesterov, easgd_alpha
from distoptim.comm.wire import GRAMMAR, parse_wire

__all__ = [
    "accuracy",
    "algorithm_entries",
    "chaos",
    "choice_list",
    "count",
    "delayed_momentum",
    "hidden",
    "int_in",
    "int_list",
    "moving_rate",
    "number",
    "positive_int",
    "positive_number",
    "seed",
    "straggler",
    "wire",
]


# ---------------------------------------------------------------------------------------------
# values: text -> value, refused in the command line's words (the rules are distoptim.checks')
# ---------------------------------------------------------------------------------------------
def _passes(check: Callable[..., Any], value: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether the :mod:`distoptim.checks` ``check`` accepts ``value`` (its message is not
    the command line's: each parser below says what is wrong in the option's own words)."""
    try:
        check("value", value, *args, **kwargs)
    except (TypeError, ValueError):
        return False
    return True


def _integer(text: str, hint: str = "") -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer{hint}") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if not _passes(check_int, value, 1):
        raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 1")
    return value


def count(text: str) -> int:
    value = _integer(text)
    if not _passes(check_int, value, 0):
        raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 0")
    return value


def int_in(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """An integer in ``[low, high]``; ``why`` (e.g. " (the GPT is small: ...)") ends the
    refusal."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not (_passes(check_int, value, low) and value <= high):
            raise argparse.ArgumentTypeError(
                f"{value} is not allowed: give an integer in [{low}, {high}]{why}"
            )
        return value

    return parse


def int_list(text: str) -> list[int]:
    values = []
    for part in text.split(","):
        value = _integer(part.strip(), " (give one, or a comma list like 2,4,8)")
        if not _passes(check_int, value, 1):
            raise argparse.ArgumentTypeError(f"{value} is not allowed: must be >= 1")
        values.append(value)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
    return values


def hidden(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part.strip()) for part in text.split(","))


def choice_list(choices: Any, what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [p.strip().lower() for p in text.split(",") if p.strip()]
        bad = [n for n in names if not _passes(check_choice, n, choices, fold_case=False)]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, bad)) or repr(text)} "
                f"(choose from {', '.join(choices)}, comma separated)"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
        return names

    return parse


def number(minimum: float, inclusive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = _real(text)
        if not _passes(check_real, value, minimum, low_open=not inclusive):
            raise argparse.ArgumentTypeError(
                f"{text} is not allowed: must be a finite number {'>=' if inclusive else '>'} "
                f"{minimum:g}"
            )
        return value

    return parse


def accuracy(text: str) -> float:
    value = _real(text)
    if not _passes(check_real, value, 0.0, 1.0, low_open=True):
        raise argparse.ArgumentTypeError(
            f"{text} is not allowed: give a validation accuracy in (0, 1], e.g. 0.9"
        )
    return value


def straggler(text: str) -> tuple[int, float]:
    worker, sep, factor = text.partition(":")
    try:
        pair = (int(worker), float(factor))
    except ValueError:
        pair = None
    if (
        not sep
        or pair is None
        or not (_passes(check_int, pair[0], 0) and _passes(check_real, pair[1], 1.0))
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give WORKER:FACTOR, a worker index >= 0 and a factor >= 1 "
            "(e.g. 1:3: worker 1's steps take 3x as long)"
        )
    return pair


def positive_number(text: str) -> float:
    """A finite number > 0 (``--epochs``: fractions are for the language model)."""
    value = _real(text)
    if not _passes(check_real, value, 0.0, low_open=True):
        raise argparse.ArgumentTypeError(f"{text} is not allowed: must be a number > 0")
    return value


def seed(text: str) -> int:
    value = _integer(text)
    if not (_passes(check_int, value, 0) and value <= MAX_SEED):
        raise argparse.ArgumentTypeError(
            f"{value} is not allowed: give an integer in [0, {MAX_SEED}] (2**32 - 1)"
        )
    return value


def chaos(text: str) -> Any:
    """``--chaos``: a fault schedule (:class:`distoptim.ft.local.Chaos`), parsed as text."""
    from distoptim.ft.local import Chaos

    try:
        return Chaos.parse(text.strip())
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def wire(text: str) -> str:
    """A wire format of the registry (``distoptim.comm.wire``), as its canonical name."""
    try:
        return parse_wire(text.strip()).name
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: {GRAMMAR}") from None


def algorithm_entries(text: str) -> list[str]:
    """``--algos``: comma-separated ``NAME`` or ``NAME@WIRE`` (canonical wire names)."""
    entries = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, at, wire = part.partition("@")
        name = name.strip().lower()
        if not _passes(check_choice, name, ALGORITHMS, fold_case=False):
            raise argparse.ArgumentTypeError(
                f"unknown algorithm {name!r} (choose from {', '.join(ALGORITHMS)}, comma "
                "separated; diloco and streaming-diloco also as NAME@WIRE, e.g. diloco@int4)"
            )
        try:
            name, canonical = algorithms.split_entry(name + at + wire.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{part!r}: {exc}") from None
        entries.append(name if canonical is None else f"{name}@{canonical}")
    if not entries:
        raise argparse.ArgumentTypeError(f"no algorithm in {text!r}")
    if len(set(entries)) != len(entries):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a value")
    return entries


def moving_rate(text: str) -> str:
    text = text.strip().lower()
    try:
        easgd_alpha(text, 1, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give 'paper' (0.9/n), 'tf' (0.9/(τ·n)) or a number in (0, 1]"
        ) from None
    return text


def delayed_momentum(text: str) -> str:
    text = text.strip().lower()
    try:
        delayed_nesterov(text, 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give 'n' (the number of workers) or an integer >= 0"
        ) from None
    return text
