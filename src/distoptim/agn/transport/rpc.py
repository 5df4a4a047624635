"""The ``"rpc"`` transport: ``torch.distributed.rpc`` (TensorPipe), a static world.

Owns: the RPC names (``"ps:<shard>"``, ``"worker:<task>"``), ``rpc.init_rpc``/``shutdown``, one
RPC entry point that hands every typed request to the shard's ``handle``, and worker probes
(a ping per silent worker; a worker whose process is gone fails it at once).

Every process of the cluster calls ``rpc.init_rpc`` with ``WORLD_SIZE = num_ps + num_worker``;
that is a barrier over all of them, so this transport has no late workers and no shard restart
(use ``"p2p"``). Kept, behind the same interface, for comparison and as a fallback while the
p2p transport proves itself.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed.rpc as rpc

from distoptim.agn.transport.base import Handler, ParameterServerError, Pending, Transport
from distoptim.agn.transport.messages import ErrorReply, Reply, Request
from distoptim.launch import import_dynamo_before_groups

__all__ = ["RpcTransport"]

_HANDLER: Handler | None = None  # the shard this process serves
_SERVING = threading.Event()  # set once it does (serve()); cleared by close()
_START_WAIT = [60.0]  # how long a request that came before serve() waits: the RPC timeout


def _rpc_handle(request: Request) -> Reply:
    """The one RPC entry point (runs on the shard's RPC thread pool).

    ``init_rpc`` is a barrier, but the shard calls :meth:`RpcTransport.serve` only after it
    returns: a worker whose ``init_rpc`` returned first may already ask. Its request waits for
    ``serve()`` (at most the RPC timeout) instead of being told this is no parameter server.
    """
    handler = _HANDLER
    if handler is None and _SERVING.wait(_START_WAIT[0]):
        handler = _HANDLER
    if handler is None:
        return ErrorReply("RuntimeError", "this process is not a parameter server")
    handled = handler.handle(request, live_reply=False)
    handled.sent()
    return handled.reply


def _rpc_ping() -> int:
    import os

    return os.getpid()


def ps_name(shard: int) -> str:
    return f"ps:{shard}"


def worker_name(task: int) -> str:
    return f"worker:{task}"


class _RpcPending(Pending):
    def __init__(self, fut: torch.futures.Future, shard: int, timeout: float) -> None:
        self._fut = fut
        self._shard = shard
        self._timeout = timeout
        self._started = time.monotonic()

    def wait(self) -> Reply:
        try:
            return self._fut.wait()
        except Exception as exc:
            raise ParameterServerError(
                f"parameter server {ps_name(self._shard)!r} did not answer "
                f"({time.monotonic() - self._started:.1f}s, timeout {self._timeout:g}s): {exc}"
            ) from exc


class RpcTransport(Transport):
    """``torch.distributed.rpc`` between ``num_ps`` shards and ``num_worker`` workers.

    ``rank < num_ps`` is shard ``rank`` (``"ps:<rank>"``), the others worker ``rank - num_ps``
    (``"worker:<task>"``). The constructor joins the RPC world (``env://``: ``MASTER_ADDR``/
    ``MASTER_PORT``), a barrier over every process.
    """

    name = "rpc"

    def __init__(self, rank: int, num_ps: int, num_worker: int, timeout: float) -> None:
        self.num_ps = num_ps
        self.num_worker = num_worker
        self.timeout = timeout
        self._me = ps_name(rank) if rank < num_ps else worker_name(rank - num_ps)
        self._closed = False
        _START_WAIT[0] = timeout
        options = rpc.TensorPipeRpcBackendOptions(
            init_method="env://",
            rpc_timeout=timeout,
            num_worker_threads=max(16, num_worker + 8),
        )
        import_dynamo_before_groups()  # rpc's gloo group must not outlive shutdown
        with warnings.catch_warnings():
            # rpc's start-up exchanges device maps over a gloo group the old way; not ours
            warnings.filterwarnings("ignore", message="You are using a Backend")
            rpc.init_rpc(
                self._me,
                rank=rank,
                world_size=num_ps + num_worker,
                rpc_backend_options=options,
            )

    def send(
        self,
        shard: int,
        request: Request,
        timeout: float,
        into: dict[str, torch.Tensor] | None = None,
    ) -> Pending:
        fut = rpc.rpc_async(ps_name(shard), _rpc_handle, args=(request,), timeout=timeout)
        return _RpcPending(fut, shard, timeout)

    def serve(self, handler: Handler) -> None:
        global _HANDLER
        _HANDLER = handler
        _SERVING.set()  # the requests that came first go on

    def gone(self, tasks: Sequence[int]) -> list[int]:
        calls: dict[int, Any] = {
            t: rpc.rpc_async(worker_name(t), _rpc_ping, timeout=self.timeout) for t in tasks
        }
        out = []
        for t, fut in calls.items():
            try:
                fut.wait()
            except Exception:
                out.append(t)
        return out

    def close(self) -> None:
        global _HANDLER
        if self._closed:
            return
        self._closed = True
        try:
            rpc.shutdown(graceful=False)
        finally:
            _HANDLER = None
            _SERVING.clear()
