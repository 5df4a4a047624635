"""The job as torchrun's environment describes it, and the error the check raises.

Owns: :class:`NetworkConfigError` (what was resolved, where, why, the fix),
:class:`BindAddress`, the transports known (:data:`TRANSPORTS`), the check's constants and
wording, and ``_Job``, the job read from the environment (ranks, nodes, rendezvous).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass

from distoptim.checks import check_seconds

TRANSPORTS = ("gloo", "tensorpipe")
"""The transports whose bind address :func:`bind_addresses` knows."""


_IFNAME_VAR = {"gloo": "GLOO_SOCKET_IFNAME", "tensorpipe": "TP_SOCKET_IFNAME"}
_LABEL = {"gloo": "gloo", "tensorpipe": "TensorPipe (torch.distributed.rpc)"}
_CONNECT_TIMEOUT = 3.0
_STORE_JOIN_TIMEOUT = 10.0
_VERDICT_MARGIN = 5.0
_LOOPBACK = "127.0.0.1"

_WHY_MASTER = (
    "torchrun sets MASTER_ADDR to the --local-addr of the node that got rendezvous rank 0, or to "
    "that node's hostname (socket.getfqdn()) when --local-addr is not given"
)
_WHY_BIND = {
    "gloo": "gloo binds to the first address of each GLOO_SOCKET_IFNAME interface, else to the "
    "first address of this host that the hostname resolves to, else to 127.0.0.1",
    "tensorpipe": "TensorPipe binds to the first address of the TP_SOCKET_IFNAME interface, "
    "else to the first address of this host that the hostname resolves to, else to 127.0.0.1",
}
_FIX_MASTER = (
    "start torchrun on every node with --local-addr <that node's address on the network the "
    "nodes share> (and --rdzv-conf is_host=true on the node whose address is in "
    "--rdzv-endpoint), or make that hostname resolve to that address on every node"
)


class NetworkConfigError(RuntimeError):
    """This host cannot take part in the job as configured.

    ``host``: where it was found; ``problem``: what was resolved and what failed; ``why``: how
    it came to be (may be empty); ``fix``: the flag or variable that fixes it. ``str()`` holds
    them all, one per line, after ``where`` (caller, host, rank, node, seconds the check took).
    """

    def __init__(self, where: str, problem: str, fix: str, why: str = "") -> None:
        self.host = socket.gethostname()
        self.problem = problem
        self.why = why
        self.fix = fix
        lines = [f"{where}:", f"  {problem}"]
        lines += [f"  why: {why}"] if why else []
        lines += [f"  fix: {fix}"]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class BindAddress:
    """An address a transport will bind to here, and why (``source``)."""

    transport: str
    address: str
    interface: str | None
    source: str

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.address.split("%")[0]).is_loopback


# ---------------------------------------------------------------------------------------------
# the job as torchrun describes it
# ---------------------------------------------------------------------------------------------
def _env_seconds(name: str, value: str) -> float:
    """The environment variable ``name``'s ``value`` as seconds > 0, or an error naming it."""
    try:
        return check_seconds(name, float(value))
    except ValueError:
        raise ValueError(
            f"{name}={value!r} must be a finite number of seconds > 0 (or unset)"
        ) from None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else None


@dataclass(frozen=True)
class _Job:
    caller: str
    host: str
    rank: int
    local_rank: int | None
    node: int | None
    nodes: int | None
    multi_node: bool
    master_addr: str
    master_port: int
    agent_store: bool
    key: str
    started: float

    @classmethod
    def from_env(cls, caller: str) -> _Job:
        world, local_world = _env_int("WORLD_SIZE"), _env_int("LOCAL_WORLD_SIZE")
        nodes = _env_int("GROUP_WORLD_SIZE")
        if nodes is None and world is not None and local_world is not None:
            nodes = 1 if world <= local_world else None  # several nodes, count unknown
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(
            caller=caller,
            host=socket.gethostname(),
            rank=_env_int("RANK") or 0,
            local_rank=_env_int("LOCAL_RANK"),
            node=_env_int("GROUP_RANK"),
            nodes=nodes,
            multi_node=nodes != 1,
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            key=f"distoptim.netcheck/{run}/{restart}/",
            started=time.monotonic(),
        )

    def where(self) -> str:
        node = "" if self.node is None else f", node {self.node}"
        node += "" if self.nodes is None or self.node is None else f" of {self.nodes}"
        took = time.monotonic() - self.started
        return (
            f"{self.caller} on host {self.host!r} (rank {self.rank}{node}; checked in {took:.1f} s)"
        )

    def error(self, problem: str, fix: str, why: str = "") -> NetworkConfigError:
        return NetworkConfigError(self.where(), problem, fix, why)

    @property
    def master(self) -> str:
        return f"MASTER_ADDR={self.master_addr}, MASTER_PORT={self.master_port}"
