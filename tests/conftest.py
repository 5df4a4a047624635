"""The suite's CPU meter: CPU seconds per test, on request, whatever the machine's load.

Off by default. With ``DISTOPTIM_TEST_CPU=PATH`` set, every test's CPU seconds are measured as
the change of ``getrusage(RUSAGE_SELF) + getrusage(RUSAGE_CHILDREN)`` (user + system) over its
setup, call and teardown, so the fixtures it sets up (a module-scoped process group is paid by
the first test that asks for it) and every child process the test waited for (the ranks of a
``distoptim.launch.spawn``) are counted; threads of the test process count as the process. The
figures ride on each test's teardown report (``user_properties``), so under pytest-xdist the
controller sees every worker's tests. The controller keeps ``{nodeid: seconds}`` in PATH as JSON
(rewritten after every test, so a run stopped early keeps its figures) and prints the total and
the 25 largest in the terminal summary.

Wall time is not measured: on a shared machine it says how busy the machine was, not what the
test costs.

It also owns the suite's grouping under pytest-xdist (``--dist loadgroup``): the tests of a module
that share a module-scoped fixture of the suite (a bundle of cases run in one spawn) go to one
worker, so the bundle runs once, not once per worker; different modules spread over the workers.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterator

import pytest

_ENV = "DISTOPTIM_TEST_CPU"
_KEY = "cpu_seconds"
_TOP = 25
_SECONDS: dict[str, float] = {}
_OUT: list[str] = []  # the JSON path, in the process that writes it (not an xdist worker)


def pytest_configure(config: pytest.Config) -> None:
    path = os.environ.get(_ENV)
    if path and not hasattr(config, "workerinput"):
        _OUT[:] = [path]


def _cpu_now() -> float:
    """User + system CPU seconds of this process and all of its waited-for children so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _metering(config: pytest.Config) -> bool:
    return bool(os.environ.get(_ENV))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` asks for a fixture of the suite (not of a plugin) wider than a test.

    (pytest has no public way to ask for a test's fixture definitions: ``_fixtureinfo`` is
    read here only.)"""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    for defs in info.name2fixturedefs.values():
        for fixturedef in defs:
            if fixturedef.scope != "function" and fixturedef.baseid.startswith("tests"):
                return True
    return False


def pytest_itemcollected(item: pytest.Item) -> None:
    """Put the tests of a module that share a module-scoped fixture in one xdist group (named by
    the module); the multi-host tests are left to their conftest (one group of their own).

    At collection of each item, not in ``pytest_collection_modifyitems``: xdist turns the marks
    into groups in its own ``pytest_collection_modifyitems``, which may run before a conftest's."""
    if "tests/multihost/" in item.nodeid or item.get_closest_marker("xdist_group") is not None:
        return
    if _shares_a_module_fixture(item):
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


def _metered_phase(item: pytest.Item) -> Iterator[None]:
    if not _metering(item.config):
        yield
        return
    start = _cpu_now()
    try:
        yield
    finally:
        spent = getattr(item, "_distoptim_cpu", 0.0) + _cpu_now() - start
        item._distoptim_cpu = spent  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _metered_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _metered_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    return (yield from _metered_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Iterator[pytest.TestReport]:
    report = yield
    if _metering(item.config) and report.when == "teardown":
        report.user_properties.append((_KEY, round(getattr(item, "_distoptim_cpu", 0.0), 3)))
    return report


def _write(path: str) -> None:
    with open(path + ".part", "w") as out:
        json.dump(dict(sorted(_SECONDS.items(), key=lambda kv: -kv[1])), out, indent=1)
    os.replace(path + ".part", path)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return
    for key, value in report.user_properties:
        if key == _KEY:
            _SECONDS[report.nodeid] = float(value)
            if _OUT:  # as it goes: a run stopped early keeps what it measured
                _write(_OUT[0])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _OUT or not _SECONDS:
        return
    path = _OUT[0]
    _write(path)
    total = sum(_SECONDS.values())
    terminalreporter.write_sep(
        "-", f"CPU seconds: {total:.0f} over {len(_SECONDS)} tests (written to {path})"
    )
    for nodeid, seconds in sorted(_SECONDS.items(), key=lambda kv: -kv[1])[:_TOP]:
        terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")
