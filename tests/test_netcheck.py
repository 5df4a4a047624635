"""The pre-flight network check on one machine: the address rules, each local check, no false
alarm on a single node, and the entry points that call it. (Across hosts:
``tests/multihost/``.)"""

from __future__ import annotations

import ipaddress
import socket
import time

import pytest
import torch.distributed as dist

from distoptim import netcheck
from distoptim.netcheck import NetworkConfigError, bind_addresses, check_torchrun_network


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in netcheck.ENVIRONMENT:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(netcheck, "_CHECKED", {})


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _job(monkeypatch: pytest.MonkeyPatch, addr: str, port: int, **extra: str) -> None:
    """torchrun's environment for rank 0 of a job on one node, with ``extra`` on top."""
    env = {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    for k, v in {**env, **extra}.items():
        monkeypatch.setenv(k, v)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _non_loopback() -> tuple[str, str] | None:
    for name, address in netcheck._interfaces():
        ip = ipaddress.ip_address(address)
        if ip.version == 4 and not ip.is_loopback and not ip.is_link_local:
            return name, address
    return None


# ---- where gloo and TensorPipe will bind ------------------------------------------------------
def test_bind_addresses_follow_the_interface_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    assert [(b.address, b.interface) for b in bind_addresses("gloo")] == [("127.0.0.1", "lo")] * 2
    assert bind_addresses("gloo")[0].source == "GLOO_SOCKET_IFNAME=lo,lo"
    monkeypatch.setenv("TP_SOCKET_IFNAME", "lo")
    (tp,) = bind_addresses("tensorpipe")
    assert (tp.transport, tp.address, tp.is_loopback) == ("tensorpipe", "127.0.0.1", True)


def test_a_missing_interface_stops_gloo_and_sends_tensorpipe_to_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(NetworkConfigError, match=r"GLOO_SOCKET_IFNAME=nosuch0 names 'nosuch0'"):
        bind_addresses("gloo")
    monkeypatch.setenv("TP_SOCKET_IFNAME", "nosuch0")
    (tp,) = bind_addresses("tensorpipe")
    assert tp.address == "127.0.0.1" and "loopback fallback" in tp.source


def test_without_variables_the_hostname_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    (b,) = bind_addresses("gloo")
    assert b.is_loopback and "the hostname 'localhost' resolves to" in b.source
    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    (b,) = bind_addresses("gloo")
    assert b.address == "127.0.0.1"
    assert "resolves to nothing" in b.source and "falls back to loopback" in b.source


def test_unknown_transport_is_refused() -> None:
    allowed = r"unknown transport 'nccl': allowed values are 'gloo', 'tensorpipe'"
    with pytest.raises(ValueError, match=allowed):
        bind_addresses("nccl")
    with pytest.raises(ValueError, match=allowed):
        check_torchrun_network("t", ("nccl",))
    with pytest.raises(TypeError, match="transport must be one of"):
        bind_addresses(None)


def test_bad_timeouts_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"timeout must be a finite number > 0 \(seconds\)"):
        check_torchrun_network("t", timeout=0)
    monkeypatch.setenv("DISTOPTIM_NETCHECK_TIMEOUT", "abc")
    with pytest.raises(ValueError, match=r"DISTOPTIM_NETCHECK_TIMEOUT='abc' must be a finite"):
        check_torchrun_network("t")


# ---- one node: no false alarm, and the local checks ------------------------------------------
def test_one_node_on_loopback_passes(monkeypatch: pytest.MonkeyPatch, store) -> None:
    _job(monkeypatch, "127.0.0.1", store.port)
    check_torchrun_network("t", ("gloo", "tensorpipe"))  # loopback is fine on one node
    _job(monkeypatch, "localhost", store.port, GROUP_WORLD_SIZE="", LOCAL_WORLD_SIZE="2")
    monkeypatch.setattr(netcheck, "_CHECKED", {})
    check_torchrun_network("t")  # node count from WORLD_SIZE <= LOCAL_WORLD_SIZE


def test_master_addr_that_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    _job(monkeypatch, "no-such-host.invalid", 29400)
    with pytest.raises(NetworkConfigError) as info:
        check_torchrun_network("torchrun_main")
    text = str(info.value)
    assert "torchrun_main on host" in text and "(rank 0, node 0 of 1;" in text
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve on this host" in text
    assert "--local-addr" in text and "why: torchrun sets MASTER_ADDR" in text


def test_store_not_listening_is_found_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _job(monkeypatch, "127.0.0.1", _free_port())
    started = time.monotonic()
    with pytest.raises(NetworkConfigError, match=r"cannot reach the rendezvous store at "):
        check_torchrun_network("t")
    assert time.monotonic() - started < 5  # refused: no retry until a timeout


def test_without_agent_store_only_the_route_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    _job(monkeypatch, "127.0.0.1", _free_port(), TORCHELASTIC_USE_AGENT_STORE="False")
    check_torchrun_network("t")  # rank 0 starts the store later: nothing listens yet, no alarm


def test_missing_gloo_interface_even_on_one_node(monkeypatch: pytest.MonkeyPatch, store) -> None:
    _job(monkeypatch, "127.0.0.1", store.port, GLOO_SOCKET_IFNAME="nosuch0")
    with pytest.raises(NetworkConfigError, match=r"names 'nosuch0', which is not an interface"):
        check_torchrun_network("t")
    check_torchrun_network("t", ())  # NCCL only: gloo's variable does not matter


def test_disabled_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    _job(monkeypatch, "no-such-host.invalid", 1, DISTOPTIM_NETCHECK="0")
    check_torchrun_network("t")


def test_a_later_call_checks_only_new_transports(monkeypatch: pytest.MonkeyPatch) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _job(monkeypatch, "127.0.0.1", store.port)
    check_torchrun_network("t", ("gloo",))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    check_torchrun_network("t", ("gloo",))  # gloo was checked: nothing is checked again
    check_torchrun_network("t", ("tensorpipe",))  # new: checked (one node: loopback is fine)
    del store
    check_torchrun_network("t", ("gloo", "tensorpipe"))  # nothing new: returns at once
    monkeypatch.setattr(netcheck, "_CHECKED", {})  # a fresh process does check the store
    with pytest.raises(NetworkConfigError, match="cannot reach the rendezvous store"):
        check_torchrun_network("t", ())


# ---- several nodes: the local checks ---------------------------------------------------------
def test_loopback_master_across_nodes(monkeypatch: pytest.MonkeyPatch, store) -> None:
    _job(monkeypatch, "127.0.0.1", store.port, GROUP_WORLD_SIZE="2", WORLD_SIZE="4")
    with pytest.raises(NetworkConfigError) as info:
        check_torchrun_network("t")
    text = str(info.value)
    assert "(rank 0, node 0 of 2;" in text
    assert "MASTER_ADDR='127.0.0.1' resolves to 127.0.0.1 here, a loopback address" in text
    assert "in a job across 2 nodes" in text


def test_loopback_bind_across_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    nic = _non_loopback()
    if nic is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, address = nic
    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
    _job(monkeypatch, address, store.port, GROUP_WORLD_SIZE="2", WORLD_SIZE="4")
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    with pytest.raises(NetworkConfigError) as info:
        check_torchrun_network("t", ("gloo", "tensorpipe"))
    text = str(info.value)
    assert "gloo would bind to 127.0.0.1, a loopback address" in text
    assert "fix: set GLOO_SOCKET_IFNAME=<the interface of the network the nodes share> on " in text
    assert f"here GLOO_SOCKET_IFNAME={name} ({address}), the interface towards MASTER_ADDR" in text
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", name)
    monkeypatch.setattr(netcheck, "_CHECKED", {})
    with pytest.raises(NetworkConfigError, match=r"TensorPipe \(torch.distributed.rpc\) would "):
        check_torchrun_network("t", ("gloo", "tensorpipe"))


# ---- the entry points call it before any group exists ----------------------------------------
def test_torchrun_main_checks_before_the_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from distoptim.launch import torchrun_main

    _job(monkeypatch, "no-such-host.invalid", 29400)
    with pytest.raises(NetworkConfigError, match=r"^torchrun_main on host "):
        torchrun_main(lambda rank, world: None, backend="gloo")
    assert not dist.is_initialized()


def test_cluster_from_env_checks_before_rpc(monkeypatch: pytest.MonkeyPatch) -> None:
    from distoptim.agn import Cluster

    _job(monkeypatch, "no-such-host.invalid", 29400)
    with pytest.raises(NetworkConfigError, match=r"^Cluster.from_env on host "):
        Cluster.from_env(num_ps=1)


def test_cli_torchrun_entry_checks_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from distoptim.cli.main import torchrun_train

    _job(monkeypatch, "no-such-host.invalid", 29400, RANK="1")  # rank 1 writes no outputs
    with pytest.raises(NetworkConfigError, match=r"^distoptim.cli.train on host "):
        torchrun_train(["--algo", "sync", "--epochs", "1"])


# ---- several nodes: the exchange ---------------------------------------------------------------
def _node(env: dict[str, str]) -> str:
    """One "node" of a two-node job on this machine: the check's error text."""
    import os

    os.environ.update(env)
    try:
        check_torchrun_network("node", ("gloo",), timeout=60)
    except NetworkConfigError as exc:
        return str(exc)
    return "passed"


@pytest.mark.slow
def test_exchange_finds_two_nodes_advertising_one_address() -> None:
    """Both "nodes" run here, so each advertises an address the other also has: on real
    hosts, the mark of hostnames resolving to an address every host has (docker0, ...)."""
    from distoptim.launch import run_processes

    nic = _non_loopback()
    if nic is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, address = nic
    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False)
    envs = [
        {
            "MASTER_ADDR": address,
            "MASTER_PORT": str(store.port),
            "RANK": str(j),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(j),
            "GROUP_WORLD_SIZE": "2",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "GLOO_SOCKET_IFNAME": name,
        }
        for j in range(2)
    ]
    texts = [o.value for o in run_processes(_node, [(e,) for e in envs], timeout=120)]
    for j, text in enumerate(texts):
        assert f"node {j} of 2" in text, text
        assert "the nodes cannot all reach each other" in text
        assert f"advertises gloo address {address} (GLOO_SOCKET_IFNAME={name}), an address " in text
        assert "of this host too: the nodes would connect to themselves" in text
