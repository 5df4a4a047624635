"""One worker of a torchrun replica group: a process group that survives torchrun's restarts.

Owns :func:`init_replica_group`, the ``torch.distributed.init_process_group`` of a worker that
torchrun may restart (``--max-restarts N``). torchrun brings a group's workers back on the
agent's store (``MASTER_ADDR``/``MASTER_PORT``, with ``TORCHELASTIC_USE_AGENT_STORE=True``),
and that store still holds the dead attempt's keys. torch's own default process group files
its gloo rendezvous under the same keys in every attempt, so a restarted worker can read a dead
worker's address and fail (``Gloo connectFullMesh failed ... Connection refused``) or wait for
it. Measured with torch 2.13 on this project's machine, a 2-process torchrun whose rank 1 is
SIGKILLed in its first attempt: the second attempt's ``init_process_group("gloo")`` failed or
hung in 5 of 6 trials (``--standalone``, ``--master-port``, ``--rdzv-backend c10d`` alike).
:func:`init_replica_group` files the process group's keys under the attempt
(``TORCHELASTIC_RESTART_COUNT``), so each attempt meets only its own workers: 3 of 3 then.
torchft's keys on the same store are :func:`~distoptim.ft.replica.make_manager`'s business
(``docs/fault_tolerance.md``).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from distoptim import checks

__all__ = ["init_replica_group"]

_NEEDED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def init_replica_group(
    backend: str = "gloo", timeout: float | datetime.timedelta = 300.0
) -> tuple[int, int]:
    """Initialize this worker's default process group (its replica group's processes) so that
    a torchrun restart of the group cannot meet the dead attempt's workers; returns
    ``(rank, world_size)``.

    Under torchrun's agent store the group is built on ``PrefixStore("attempt_<N>", store)``
    (``N``: ``TORCHELASTIC_RESTART_COUNT``); elsewhere (a store rank 0 hosts, which dies with
    it) it is torch's own ``init_process_group(backend)``. ``timeout``: seconds (or a
    ``timedelta``) for the store and the group's collectives. Raises ``ValueError`` outside
    torchrun (naming the variables it needs) and when a process group exists already.
    """
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    seconds = checks.check_seconds("timeout", timeout)
    missing = [name for name in _NEEDED if name not in os.environ]
    if missing:
        raise ValueError(
            f"init_replica_group: {', '.join(missing)} not set: run this worker under "
            "torchrun (or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)"
        )
    if dist.is_initialized():
        raise ValueError("init_replica_group: a default process group exists already")
    delta = datetime.timedelta(seconds=seconds)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=delta)
        return dist.get_rank(), dist.get_world_size()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=delta
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefixed = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=delta)
    return rank, world
