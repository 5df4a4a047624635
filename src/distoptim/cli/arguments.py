"""Command-line arguments of ``distoptim train`` and ``distoptim compare``, and their checks.

The one place to import them from; each idea lives in its own module:

* :mod:`distoptim.cli.options` -- the options as a declarative table (:data:`OPTIONS`,
  :data:`COMMANDS`) and the parser built from it (:func:`build_parser`);
* :mod:`distoptim.cli.optionvalues` -- how each option's text becomes its value, or is refused;
* :mod:`distoptim.cli.plan` -- the :class:`Plan` built from parsed arguments
  (:func:`make_plan`), with every check across options (:class:`UsageError`).
"""

from __future__ import annotations

from distoptim.cli.options import COMMANDS, OPTIONS, Command, Option, Sweep, build_parser
from distoptim.cli.plan import RESULTS_JSON, Plan, UsageError, make_plan

__all__ = [
    "COMMANDS",
    "OPTIONS",
    "RESULTS_JSON",
    "Command",
    "Option",
    "Plan",
    "Sweep",
    "UsageError",
    "build_parser",
    "make_plan",
]
