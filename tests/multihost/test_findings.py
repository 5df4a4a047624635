"""What goes wrong without the flags of ``docs/multinode.md``, and how fast it is diagnosed.

Each job is a documented block with what a user typically leaves out taken away again, on
hosts whose hostnames resolve to loopback (the machine the issue was found on) or to a NIC that
reaches nobody (``mgmt``):

* the README's old command (no ``is_host``, no ``--local-addr``, no interface variables): no
  node hosts the rendezvous store, both fail with ``RendezvousConnectionError`` (torch's
  ``read_timeout`` is shortened from 60 s to 5 s here to keep the test short);
* ``is_host=true`` but no ``--local-addr``: ``MASTER_ADDR`` is node 0's hostname, which resolves
  to loopback, or to an address node 1 cannot reach -- before: a hang until the timeout; now
  the pre-flight check's error on every node;
* no ``GLOO_SOCKET_IFNAME`` (loopback fallback) or a wrong one, no ``TP_SOCKET_IFNAME`` with
  the AGN example's ``--transport rpc``, and hostnames that name the wrong NIC: the pre-flight
  check's error, within seconds.

The same README command on hosts whose names resolve to their shared-network address works
(no false alarm). The jobs run in two waves (:func:`outcomes`); each test checks one.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.multihost.doc_commands import JOB_MODULE_MARKS, Job, run_jobs
from tests.multihost.harness import HostRun, Hosts

pytestmark = JOB_MODULE_MARKS

_TIMEOUT = 90.0
_FAST = 10.0  # seconds: the most a pre-flight diagnosis may take here (probes wait 3 s)


def _drop(argv: list[str], flag: str, value: str | None = None) -> None:
    """Remove ``flag`` and its value from ``argv`` (if ``value`` is given, only that pair)."""
    for i in range(len(argv) - 1):
        if argv[i] == flag and (value is None or argv[i + 1] == value):
            del argv[i : i + 2]
            return


def _readme_command(node: int, env: dict[str, str], argv: list[str]) -> None:
    env.clear()
    _drop(argv, "--rdzv-conf", "is_host=true")
    _drop(argv, "--local-addr")
    at = argv.index("--rdzv-endpoint")
    argv[at:at] = ["--rdzv-conf", "read_timeout=5"]


def _no_local_addr(node: int, env: dict[str, str], argv: list[str]) -> None:
    _drop(argv, "--local-addr")


def _gloo_unset_then_wrong(node: int, env: dict[str, str], argv: list[str]) -> None:
    if node == 0:
        del env["GLOO_SOCKET_IFNAME"]
    else:
        env["GLOO_SOCKET_IFNAME"] = "eth9"


def _rpc_without_tp(node: int, env: dict[str, str], argv: list[str]) -> None:
    argv += ["--transport", "rpc"]
    del env["TP_SOCKET_IFNAME"]


def _no_gloo(node: int, env: dict[str, str], argv: list[str]) -> None:
    del env["GLOO_SOCKET_IFNAME"]


def _one_process(edit: Callable[[int, dict[str, str], list[str]], None]):
    """``edit``, and one process per node: what each test provokes happens in every process of
    a node alike (the pre-flight check, the rendezvous, gloo's address), and every process
    costs a torch import (seconds of CPU), so one per node keeps the module short."""

    def both(node: int, env: dict[str, str], argv: list[str]) -> None:
        edit(node, env, argv)
        argv[argv.index("--nproc-per-node") + 1] = "1"

    return both


def _waves() -> list[list[Job]]:
    return [
        [Job("readme", "cross_shard", edit=_readme_command),
         Job("no_local_addr", "cross_shard", edit=_one_process(_no_local_addr)),
         Job("no_local_addr_mgmt", "cross_shard", resolve="mgmt",
             edit=_one_process(_no_local_addr), env={"DISTOPTIM_NETCHECK_TIMEOUT": "3"})],
        [Job("readme_healthy", "cross_shard", resolve="data", edit=_one_process(_readme_command)),
         Job("gloo_ifname", "cross_shard", edit=_one_process(_gloo_unset_then_wrong)),
         Job("no_tp_ifname", "agn", edit=_one_process(_rpc_without_tp)),
         Job("wrong_nic", "cross_shard", resolve="mgmt", edit=_one_process(_no_gloo))],
    ]  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(hosts: Hosts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[HostRun]]:
    return run_jobs(hosts, _waves(), tmp_path_factory.mktemp("findings"), _TIMEOUT)


def _diagnosed(run: HostRun, *needles: str) -> str:
    """The run failed fast with a NetworkConfigError containing ``needles``; its text."""
    assert not run.timed_out and run.returncode not in (0, None), run.describe()
    errors = re.findall(r"NetworkConfigError: (.*?)\n  fix: (.*?)\n", run.stderr, re.S)
    assert errors, run.describe()
    text = "\n  fix: ".join(errors[0])
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text}"
    took = [float(t) for t in re.findall(r"checked in (\d+\.\d) s", run.stderr)]
    assert took and max(took) < _FAST, run.describe()
    assert "epoch" not in run.stdout and "[worker" not in run.stdout, "training started"
    return text


def test_readme_command_fails_at_the_rendezvous(outcomes: dict[str, list[HostRun]]) -> None:
    for run in outcomes["readme"]:
        assert run.returncode not in (0, None), run.describe()
        assert "RendezvousConnectionError" in run.stderr, run.describe()
        assert "The connection to the C10d store has failed" in run.stderr
        assert "NetworkConfigError" not in run.stderr, "no worker starts"


def test_readme_command_works_where_hostnames_resolve_right(
    outcomes: dict[str, list[HostRun]],
) -> None:
    """The same command on hosts whose names resolve to their shared-network address: torchrun
    finds the store's host by name, MASTER_ADDR and gloo's addresses are right, and the
    pre-flight check (with its exchange) passes."""
    runs = outcomes["readme_healthy"]
    assert all(r.returncode == 0 for r in runs), "\n".join(r.describe() for r in runs)
    assert "mean loss over 2 ranks" in "".join(r.stdout for r in runs)
    assert not any("NetworkConfigError" in r.stderr for r in runs)


def test_master_addr_resolving_to_loopback(outcomes: dict[str, list[HostRun]]) -> None:
    runs = outcomes["no_local_addr"]
    h0 = runs[0].host.hostname
    for run in runs:
        _diagnosed(
            run,
            f"MASTER_ADDR='{h0}' resolves to 127.0.1.1 here, a loopback address, in a job "
            "across 2 nodes",
            "--local-addr",
            "is_host=true",
        )


def test_master_addr_unreachable_from_the_other_node(outcomes: dict[str, list[HostRun]]) -> None:
    node0, node1 = outcomes["no_local_addr_mgmt"]
    h0 = node0.host
    _diagnosed(
        node1,
        f"cannot reach the rendezvous store at MASTER_ADDR={h0.hostname}",
        f"'{h0.hostname}' resolves here to {h0.mgmt_addr}",
        "--local-addr",
    )
    _diagnosed(node0, "node(s) 1 did not report to the network check within 3 s")


def test_gloo_interface_unset_or_wrong(outcomes: dict[str, list[HostRun]]) -> None:
    node0, node1 = outcomes["gloo_ifname"]
    _diagnosed(
        node0,
        "gloo would bind to 127.0.1.1, a loopback address",
        f"the hostname '{node0.host.hostname}' resolves to 127.0.1.1",
        f"GLOO_SOCKET_IFNAME=eth0 ({node0.host.addr})",
    )
    _diagnosed(node1, "GLOO_SOCKET_IFNAME=eth9 names 'eth9', which is not an interface")


def test_tensorpipe_interface_unset(outcomes: dict[str, list[HostRun]]) -> None:
    for run in outcomes["no_tp_ifname"]:
        _diagnosed(
            run,
            "TensorPipe (torch.distributed.rpc) would bind to 127.0.1.1, a loopback address",
            f"TP_SOCKET_IFNAME=eth0 ({run.host.addr})",
        )


def test_hostname_naming_the_wrong_nic(outcomes: dict[str, list[HostRun]]) -> None:
    h0, h1 = (r.host for r in outcomes["wrong_nic"])
    for run in outcomes["wrong_nic"]:
        _diagnosed(
            run,
            "the nodes cannot all reach each other",
            f"node 0 (host '{h0.hostname}'): gloo binds to {h0.mgmt_addr} here",
            f"cannot connect to node 1 (host '{h1.hostname}') at {h1.mgmt_addr}",
            f"node 1 (host '{h1.hostname}'): gloo binds to {h1.mgmt_addr} here",
            "GLOO_SOCKET_IFNAME=eth0",
        )
