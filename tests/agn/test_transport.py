"""The p2p transport's pieces in one process: a gloo pair between two threads, shared segments.

No cluster: both ends of one connection live in this process (each thread holds one rank of
a 2-rank ``ProcessGroupGloo`` made from a ``PrefixStore``), so the message path that crosses
machines (buffers on the pair) and the same-machine one (buffers in a shared segment) are both
checked in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distoptim.agn.transport.messages import Commit, Echo, Pull
from distoptim.agn.transport.p2p import _Pipe
from distoptim.agn.transport.shm import CONTROL_BYTES, Segment, layout_offsets
from distoptim.launch import import_dynamo_before_groups

pytestmark = pytest.mark.timeout(60)

# Paid here, at collection, not by the first test that makes a P2PTransport (which imports it):
# seconds of CPU, which on a machine loaded many times over outlasted that test's timeout.
import_dynamo_before_groups()


@pytest.fixture
def pair():
    """Two ends of one connection: (shard end rank 0, worker end rank 1)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ends: dict[int, _Pipe] = {}

    def make(rank: int) -> None:  # a store client each: a blocking wait holds its client
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("t", client), rank, 2, timedelta(seconds=20))
        ends[rank] = _Pipe(pg, 1 - rank, replies=rank == 0)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    yield ends[0], ends[1]
    for end in ends.values():
        end.close()


def _exchange(sender: _Pipe, receiver: _Pipe, message, **recv_kwargs):
    got = {}

    def recv() -> None:
        got["msg"] = receiver.recv(_deadline(), **recv_kwargs)[0]

    t = threading.Thread(target=recv)
    t.start()
    for w in sender.send(message)[0]:
        w.wait(timedelta(seconds=20))
    t.join(20)
    return got["msg"]


def _deadline() -> float:
    import time

    return time.monotonic() + 20


def test_messages_on_the_pair_with_buffers_reused_and_large_metadata(pair):
    shard, worker = pair
    flats = {"float32": torch.arange(6.0), "float64": torch.ones(3, dtype=torch.float64)}
    pool: dict = {}
    got = _exchange(worker, shard, Commit("opt", 1, 4, flats), pool=pool)
    assert isinstance(got, Commit) and got.task == 1 and got.pulled_version == 4
    assert all(torch.equal(got.flats[k], v) for k, v in flats.items())
    first = got.flats["float32"].data_ptr()
    got = _exchange(worker, shard, Commit("opt", 1, 5, flats, {0: {"x": 1.0}}), pool=pool)
    assert got.flats["float32"].data_ptr() == first  # the connection reuses its buffers
    big = {0: {f"k{i}": float(i) for i in range(200)}}  # metadata longer than the header
    got = _exchange(worker, shard, Commit("opt", 2, 0, flats, big))
    assert got.hparams == big
    inbox = {"float32": torch.zeros(6)}
    back = _exchange(shard, worker, Echo({"float32": torch.arange(6.0)}), into=inbox)
    assert back.flats["float32"] is inbox["float32"]  # received where it was asked to go
    assert torch.equal(inbox["float32"], torch.arange(6.0))
    assert isinstance(_exchange(worker, shard, Pull("opt", 1, "AGN", (), 0.0)), Pull)


def test_messages_in_a_shared_segment_copy_nothing_in_place(pair):
    shard, worker = pair
    flats = {"float32": torch.arange(10.0), "float16": torch.ones(5, dtype=torch.float16)}
    offsets, need = layout_offsets([t.numel() * t.element_size() for t in flats.values()])
    assert offsets == [0, 64] and need == 128
    seg = Segment.create(need)
    assert seg is not None
    try:
        other = Segment.attach(seg.path, seg.nbytes, seg.token)
        assert other is not None
        assert Segment.attach(seg.path, seg.nbytes, b"0" * 16) is None  # not the same memory
    finally:
        seg.unlink()
    assert not os.path.exists(seg.path)  # the name is gone, the mappings stay valid
    worker.segment, shard.segment = seg, other
    assert seg.request_base == CONTROL_BYTES and seg.reply_base == CONTROL_BYTES + 128
    got = _exchange(worker, shard, Commit("opt", 0, 0, flats))
    assert all(torch.equal(got.flats[k], v) for k, v in flats.items())
    # a view of the request region: nothing copied on receipt
    assert got.flats["float32"].data_ptr() == other.data.data_ptr() + other.request_base
    # the shard echoes the views it got: they are in the segment, nothing is copied back
    back = _exchange(shard, worker, Echo(got.flats))
    assert back.flats["float16"].data_ptr() == seg.data.data_ptr() + seg.request_base + 64
    assert torch.equal(back.flats["float16"], flats["float16"])
    # a reply that is not in the segment is copied into the reply region
    back = _exchange(shard, worker, Echo({"float32": torch.full((4,), 7.0)}))
    assert back.flats["float32"].data_ptr() == seg.data.data_ptr() + seg.reply_base
    assert torch.equal(back.flats["float32"], torch.full((4,), 7.0))
    # a message larger than a region goes on the pair
    large = {"float32": torch.arange(100.0)}
    got = _exchange(worker, shard, Commit("opt", 0, 0, large))
    assert torch.equal(got.flats["float32"], large["float32"])
    assert other.offset_of(got.flats["float32"]) is None


def test_a_segment_cannot_be_made_where_there_is_no_room(tmp_path):
    assert Segment.create(64, directory=str(tmp_path / "missing")) is None


# ---- a shard in a thread and a worker, in this process -------------------------------------------
@contextlib.contextmanager
def _shard_and_worker(idle_timeout: float = 60.0, **server_options):
    """A shard served from threads of this process (``ParameterServer(**server_options)``) and
    this process as its worker 0 (a :class:`~distoptim.agn.Cluster`): the real p2p path, shared
    memory included, without starting processes."""
    from distoptim.agn import Cluster, ParameterServer
    from distoptim.agn.store import store_namespace
    from distoptim.agn.transport.p2p import P2PTransport

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    namespace = store_namespace()
    server = ParameterServer(0, 1, 1, **server_options)
    server.incarnation = int(dist.PrefixStore(namespace, store).add("shard/0/incarnation", 1))
    shard = P2PTransport(
        "127.0.0.1", store.port, namespace, num_ps=1, timeout=30, idle_timeout=idle_timeout
    )
    shard.serve(server)
    try:
        worker = Cluster(
            rank=1, world_size=2, num_ps=1, master_addr="127.0.0.1", master_port=store.port
        )
        try:
            yield server, worker
        finally:
            worker.shutdown()
    finally:
        shard.close()


def _agn(worker, model, lam=1, momentum=0.0):
    import distoptim

    opt = distoptim.AGNOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum), 1, None, lam
    )
    hook = opt.make_session_run_hook(worker.is_chief, worker.task_index)
    hook.begin()
    hook.after_create_session()
    return opt


def _train(opt, model, steps: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        opt.zero_grad()
        (model(torch.randn(4, 3, generator=g)) - 1).pow(2).mean().backward()
        opt.step()


# ---- a worker dropped for idleness is told so ----------------------------------------------------
def test_a_worker_dropped_after_idle_timeout_is_told_so_not_that_the_shard_died():
    """A shard with a short idle_timeout and a real worker: after a pause longer than
    idle_timeout the worker's next commit says it was dropped for idleness and how to raise
    idle_timeout -- the shard is alive."""
    from distoptim.agn import WorkerDroppedError

    warm = torch.nn.Linear(3, 2)  # torch's first backward and step set up lazily: not in the
    _train(torch.optim.SGD(warm.parameters(), lr=0.1), warm, 1)  # shard's 3 s window below
    with _shard_and_worker(idle_timeout=3) as (server, worker):
        model = torch.nn.Linear(3, 2)
        opt = _agn(worker, model)
        _train(opt, model, 1)
        assert opt.global_step == 1
        # the pause: the shard drops the silent worker (counted dead) while staying alive
        server.wait_for_workers(lambda pending: {}, probe_period_s=0.05, timeout_s=30)
        with pytest.raises(WorkerDroppedError) as info:
            _train(opt, model, 1)
        text = str(info.value)
        assert "dropped worker 0's connection" in text and "idle_timeout=3s" in text
        assert "the shard itself is alive" in text and "idle_timeout=SECONDS" in text
        assert "died" not in text and "is gone" not in text


def test_each_request_after_an_idle_drop_is_told_so_at_once():
    """Twenty drops in a row: each time the shard drops the quiet connection (its own state says
    so: the worker is counted dead), the worker's next request is posted to a pair the shard no
    longer reads and must fail at once with WorkerDroppedError -- not wait out its 30 s timeout
    and say "Timed out" (a send gloo queued on the closed pair is never told that it closed; the
    reply's receive, posted first, is). The worker then reconnects: the shard counts it alive
    again, until it drops that connection too."""
    from distoptim.agn import ParameterServer, WorkerDroppedError
    from distoptim.agn.store import store_namespace
    from distoptim.agn.transport.messages import Ping
    from distoptim.agn.transport.p2p import P2PTransport

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    namespace = store_namespace()
    server = ParameterServer(0, 1, 1)
    server.incarnation = int(dist.PrefixStore(namespace, store).add("shard/0/incarnation", 1))
    shard = P2PTransport("127.0.0.1", store.port, namespace, num_ps=1, timeout=30, idle_timeout=0.2)
    shard.serve(server)
    worker = P2PTransport("127.0.0.1", store.port, namespace, num_ps=1, timeout=30)
    try:
        worker.connect(0, timeout=30)
        for _ in range(20):
            server.wait_for_workers(lambda pending: {}, probe_period_s=0.05, timeout_s=30)
            with pytest.raises(WorkerDroppedError, match=r"idle_timeout=0\.2s"):
                worker.send(0, Ping(), 30).wait()
            worker.reconnect(0, timeout=30)
    finally:
        worker.close()
        shard.close()


# ---- streamed and whole commits, replies in place or copied: the same math -----------------------
def _centers_after_training(**server_options):
    from distoptim.agn.transport.shared_center import SharedCenters

    torch.manual_seed(0)
    with _shard_and_worker(centers=SharedCenters(), **server_options) as (_, worker):
        model = torch.nn.Linear(3, 2)
        start = model.weight.detach().clone()
        opt = _agn(worker, model, lam=2, momentum=0.5)
        _train(opt, model, 6)
        assert opt.global_step == 3 and not torch.equal(model.weight, start)
        told = worker.transport.chunk_bytes(0), worker.transport._channels[0].pipe.released
        return told, opt.center_variables(), [p.detach().clone() for p in model.parameters()]


def test_streamed_and_whole_commits_give_the_same_center_bit_for_bit():
    """8-byte chunks (every commit several chunks, the last one short): streamed commits
    (DISTOPTIM_AGN_STREAM=1) and whole ones with replies read in place (the default) give the
    same center and local parameters, bit for bit, as the server optimizer (momentum SGD) is
    stepped piece by piece either way."""
    streamed = _centers_after_training(chunk_bytes=8, stream=True)
    whole = _centers_after_training(chunk_bytes=8, stream=False)
    assert streamed[0] == (8, 0)  # streamed in 8-byte chunks; replies in the segment
    assert whole[0][0] == 0 and whole[0][1] >= 3  # whole; 3 commit replies read in place
    for a, b in zip(streamed[1] + streamed[2], whole[1] + whole[2]):
        assert torch.equal(a, b)


# ---- replies read in place from the shard's memory -----------------------------------------------
def _until(condition, seconds: float = 20.0) -> bool:
    """Wait (bounded) for a condition another thread makes true."""
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_commit_reply_is_read_in_place_and_the_center_held_until_released():
    """Same machine: the reply to a commit names where the center lies in the shard's memory;
    the worker reads it there (no copy into the connection's segment) and the shard keeps the
    table's read lock -- no commit can change the center -- until the worker releases it."""
    from distoptim.agn import AddUpdate, ParameterServer
    from distoptim.agn.store import store_namespace
    from distoptim.agn.transport.messages import CommitReply, Ping, Seed, TableSpec
    from distoptim.agn.transport.p2p import P2PTransport
    from distoptim.agn.transport.shared_center import SharedCenters

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    namespace = store_namespace()
    server = ParameterServer(0, 1, 1, centers=SharedCenters())
    server.incarnation = int(dist.PrefixStore(namespace, store).add("shard/0/incarnation", 1))
    shard = P2PTransport("127.0.0.1", store.port, namespace, num_ps=1, timeout=30)
    shard.serve(server)
    worker = P2PTransport("127.0.0.1", store.port, namespace, num_ps=1, timeout=30)
    try:
        worker.connect(0, timeout=30)
        assert worker.reserve(0, 4096)  # the segment, and the shard's centers mapped
        spec = TableSpec("test", AddUpdate(), [0], [(6,)], [torch.float32], True, None, {}, [])
        worker.send(0, Seed("t", spec, {"float32": torch.zeros(6)}), 30).wait()
        table = server._tables["t"]
        pending = worker.send(0, Commit("t", 0, 0, {"float32": torch.arange(6.0)}), 30)
        reply = pending.wait()
        assert isinstance(reply, CommitReply) and not reply.refused
        got = reply.flats["float32"]
        assert torch.equal(got, torch.arange(6.0))
        segment = worker._channels[0].pipe.segment
        assert segment is not None and segment.offset_of(got) is None  # not copied there
        assert _until(lambda: table.rw._readers == 1)  # held while the worker reads
        pending.release()
        assert _until(lambda: table.rw._readers == 0)  # ... and let go once it is done
        # a reply not released explicitly is released by the next request
        reply = worker.send(0, Commit("t", 0, 1, {"float32": torch.ones(6)}), 30).wait()
        assert torch.equal(reply.flats["float32"], torch.arange(6.0) + 1)
        assert _until(lambda: table.rw._readers == 1)
        worker.send(0, Ping(), 30).wait()
        assert _until(lambda: table.rw._readers == 0)
    finally:
        worker.close()
        shard.close()


def test_no_shared_segment_with_a_worker_whose_process_the_shard_cannot_watch(monkeypatch):
    """A worker that says hello from another host name (a container or network namespace that
    shares this kernel's /dev/shm could map the segment) gets no segment: its commits' replies
    travel on the pair, so the shard never holds the table's read lock waiting for a worker
    whose death it could only see at the request's timeout. (Seen across network namespaces:
    a worker killed while reading its reply in place held every other worker's commit for
    60 s.) A worker on this host still gets one."""
    from distoptim.agn import AddUpdate, ParameterServer
    from distoptim.agn.store import store_namespace
    from distoptim.agn.transport import p2p
    from distoptim.agn.transport.messages import CommitReply, Seed, TableSpec
    from distoptim.agn.transport.shared_center import SharedCenters

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    namespace = store_namespace()
    server = ParameterServer(0, 1, 1, centers=SharedCenters())
    server.incarnation = int(dist.PrefixStore(namespace, store).add("shard/0/incarnation", 1))
    shard = p2p.P2PTransport("127.0.0.1", store.port, namespace, num_ps=1, timeout=30)
    shard.serve(server)
    here, elsewhere = (p2p.P2PTransport("127.0.0.1", store.port, namespace, num_ps=1, timeout=30)
                       for _ in range(2))  # fmt: skip
    try:
        here.connect(0, timeout=30)
        real = p2p.socket.gethostname
        with monkeypatch.context() as m:  # only its hello names another host
            m.setattr(p2p.socket, "gethostname", lambda: real() + "-elsewhere")
            elsewhere.connect(0, timeout=30)
        assert here.reserve(0, 4096)
        assert not elsewhere.reserve(0, 4096)
        assert elsewhere._channels[0].pipe.segment is None
        spec = TableSpec("t", AddUpdate(), [0], [(6,)], [torch.float32], True, None, {}, [])
        elsewhere.send(0, Seed("t", spec, {"float32": torch.zeros(6)}), 30).wait()
        reply = elsewhere.send(0, Commit("t", 0, 0, {"float32": torch.arange(6.0)}), 30).wait()
        assert isinstance(reply, CommitReply) and torch.equal(
            reply.flats["float32"], torch.arange(6.0)
        )
        table = server._tables["t"]
        assert _until(lambda: table.rw._readers == 0)  # sent on the pair: the lock is let go
    finally:
        here.close()
        elsewhere.close()
        shard.close()


def test_an_rpc_request_that_comes_before_the_shard_serves_waits_for_it(monkeypatch):
    """rpc: init_rpc is a barrier, but the shard calls serve() after it; a worker's first
    request may arrive in between. It waits for serve() (at most the RPC timeout) and gets the
    shard's answer, not "this process is not a parameter server". In this process: the RPC
    entry point is a plain function; the shard is a real ParameterServer."""
    from distoptim.agn.server import ParameterServer
    from distoptim.agn.transport import rpc as rpc_transport
    from distoptim.agn.transport.messages import Ping, Pong

    monkeypatch.setattr(rpc_transport, "_HANDLER", None)
    monkeypatch.setattr(rpc_transport, "_START_WAIT", [60.0])
    rpc_transport._SERVING.clear()
    replies: list = []
    early = threading.Thread(target=lambda: replies.append(rpc_transport._rpc_handle(Ping())))
    early.start()
    early.join(0.5)
    assert early.is_alive(), f"answered before the shard served: {replies}"
    transport = object.__new__(rpc_transport.RpcTransport)  # serve() only: no RPC world here
    try:
        transport.serve(ParameterServer(0, 1, 1))
        early.join(30)
        assert not early.is_alive() and isinstance(replies[0], Pong), replies
    finally:
        rpc_transport._SERVING.clear()
