"""What the command-line tests share: running the console command, planning from a command line,
reading ``results.json``, and waiting (bounded, on events) for a command's output or processes.

Every wait here has a bound and waits on an event (a line on a pipe, a pidfd), not a clock.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository: its ``src`` is what the commands these tests start import."""


def command(*argv: str) -> list[str]:
    """``python -m distoptim.cli.main ARGV...`` with this interpreter (the console command)."""
    return [sys.executable, "-m", "distoptim.cli.main", *argv]


def console_script() -> str:
    """The installed ``distoptim`` console script (what a fresh install runs)."""
    script = shutil.which("distoptim")
    assert script, "the distoptim console script is missing: pip install -e '.[dev,cli]'"
    return script


def environment(**extra: str) -> dict[str, str]:
    """This process's environment with this repository's ``src`` first on ``PYTHONPATH`` (so
    a command imports the code under test, from a worktree too), plus ``extra``."""
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_command(
    argv: list[str], timeout: float, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """Run ``argv`` (a full command line, e.g. :func:`command`'s) to its end within
    ``timeout`` seconds, its output captured as text; ``env`` defaults to
    :func:`environment`."""
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment() if env is None else env,
        **kwargs,
    )


def start_command(argv: list[str], env: dict[str, str] | None = None, **kwargs: Any):
    """Start ``argv`` with text pipes for stdout and stderr; ``env`` defaults to
    :func:`environment`. The caller ends it (``communicate`` with a timeout, or kill)."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment() if env is None else env,
        **kwargs,
    )


def results(out: Path | str) -> dict[str, Any]:
    """The ``results.json`` a command wrote into the folder ``out``."""
    return json.loads((Path(out) / "results.json").read_text())


def plan_of(*argv: str):
    """The :class:`~distoptim.cli.arguments.Plan` of the command line ``argv`` (parsed and
    checked in this process, as the command does before it starts any process)."""
    from distoptim.cli.arguments import build_parser, make_plan

    return make_plan(build_parser().parse_args(list(argv)))


def read_until(stream, needle: str, timeout: float) -> str:
    """Read ``stream`` (a command's text pipe) line by line until ``needle`` shows up; what was
    read. Fails if ``timeout`` seconds pass first or the command closes the pipe."""
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    seen = ""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} within {timeout}s; got:\n{seen}"
        if sel.select(timeout=left):
            line = stream.readline()
            assert line, f"the command ended before {needle!r}:\n{seen}"
            seen += line
    return seen


def wait_gone(pids: Iterable[int], timeout: float) -> bool:
    """Wait (on pidfds, not by polling) until every pid has exited; False on timeout."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            sel = selectors.DefaultSelector()
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return False
        finally:
            os.close(fd)
    return True
