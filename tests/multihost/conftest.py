"""The hosts of the multi-host tests: made once per session, checked to be gone at the end.

Nine hosts: the jobs of a test module run in waves of up to four at once, each on its own
hosts (two or more per multi-node job, one for a single-machine run). Leftovers of earlier runs that
were killed before their clean-up are swept first; at the end the fixture deletes everything
and fails if a namespace of this run is left. The terminal summary gives the CPU seconds of
every job (the budget of these tests, whatever the machine's load).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multihost.doc_commands import CPU_SECONDS
from tests.multihost.harness import Hosts, leftovers, namespaces_unavailable, sweep

HOSTS = 9


def pytest_itemcollected(item: pytest.Item) -> None:
    """Under pytest-xdist every multi-host test runs on one worker: the hosts are made once per
    session of a worker, and two workers' sweeps would delete each other's namespaces. (Marked as
    each item is collected: xdist reads the marks in its own ``pytest_collection_modifyitems``,
    which can run before a conftest's.)"""
    here = str(__file__).rsplit("/", 1)[0]
    if str(item.path).startswith(here):
        item.add_marker(pytest.mark.xdist_group("multihost"))


@pytest.fixture(scope="session")
def hosts() -> Iterator[Hosts]:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host tests need Linux network namespaces: {reason}")
    sweep()
    made = Hosts(HOSTS)
    try:
        yield made
    finally:
        made.close()
    assert leftovers(made.prefix) == [], "network namespaces left behind"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not CPU_SECONDS:
        return
    jobs = sorted(CPU_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("-", f"multihost jobs: {sum(CPU_SECONDS.values()):.0f} CPU seconds")
    terminalreporter.write_line("  ".join(f"{name} {cpu:.1f}" for name, cpu in jobs))
