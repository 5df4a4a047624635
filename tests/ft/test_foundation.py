"""distoptim.ft's foundations: the pinned torchft internals, the lighthouse, the checksum, data."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time

import pytest
import torch

from distoptim import CrossShardOptimizer
from distoptim.comm.checksum import state_checksum
from distoptim.ft import _torchft
from distoptim.ft.data import SlotShards
from distoptim.ft.lighthouse import Lighthouse
from distoptim.ft.replica import LighthouseUnreachableError, make_manager


def _solo_manager(lighthouse: Lighthouse, replica_id: str, **options: object) -> object:
    """A manager of one replica group around ``lighthouse`` (short timeouts, seeded models)."""
    settings: dict = {
        "state_dict": dict,
        "timeout": 5,
        "connect_timeout": 5,
        "quorum_timeout": 10,
        "init_sync": False,
        **options,
    }
    return make_manager(
        lighthouse.address, replica_id=replica_id, load_state_dict=lambda _: None, **settings
    )


def test_torchft_is_the_pinned_release():
    import importlib.metadata

    assert importlib.metadata.version("torchft") == _torchft.TORCHFT_VERSION


def test_pinned_internals_answer_on_a_real_quorum():
    """Manager._pg, its parent's rank/size, Manager._healing and Manager._quorum_future: what
    distoptim reads."""
    with Lighthouse(min_replicas=1, join_timeout=0.2) as lighthouse:
        manager = _solo_manager(lighthouse, "pin0")
        try:
            manager.start_quorum()
            future = _torchft.quorum_future(manager)
            assert isinstance(future, concurrent.futures.Future)
            future.result(timeout=10)  # the quorum wait_quorum() waits for
            manager.wait_quorum()
            assert future.done()
            assert _torchft.quorum_rank_and_size(manager) == (0, 1)
            assert _torchft.is_healing(manager) is False
            assert _torchft.uses_async_quorum(manager) is True
            group = _torchft.quorum_group(manager)
            t = torch.ones(3)
            work = group.allreduce([t], torch.distributed.AllreduceOptions())
            work.wait()
            assert t.tolist() == [1.0, 1.0, 1.0]
            assert manager.should_commit() is True
            assert manager.current_step() == 1
        finally:
            manager.shutdown(wait=False)


def test_a_closed_quorum_group_is_replaced_by_the_next_quorum():
    """close_quorum_group: the wrapper lets go of its process group (``_pg``), which is freed
    on another thread; the round fails; the next quorum (a new id after the failed commit)
    configures a new group, whose collectives work."""
    with Lighthouse(min_replicas=1, join_timeout=0.2) as lighthouse:
        manager = _solo_manager(lighthouse, "close0")
        try:
            manager.start_quorum()
            manager.wait_quorum()
            first = _torchft.quorum_id(manager)
            wrapper = _torchft.quorum_group(manager)
            assert wrapper._pg is not None
            manager.report_error(RuntimeError("a peer died inside a collective"))
            _torchft.close_quorum_group(manager)
            assert wrapper._pg is None  # let go of (the next quorum makes a new one)
            assert manager.should_commit() is False
            manager.start_quorum()
            manager.wait_quorum()
            assert _torchft.quorum_id(manager) != first  # a failed commit: a new quorum
            assert wrapper._pg is not None
            t = torch.ones(3)
            wrapper.allreduce([t], torch.distributed.AllreduceOptions()).wait()
            assert t.tolist() == [1.0, 1.0, 1.0]
            assert manager.should_commit() is True
        finally:
            manager.shutdown(wait=False)


@pytest.mark.parametrize("use_async_quorum", [True, False])
def test_a_donors_state_is_not_read_while_forward_and_backward_run(use_async_quorum):
    """CrossShard's zero_grad() starts the quorum early; the state a donor's quorum thread reads
    for a healing peer (the user's state_dict functions: an FSDP2 module's reshards it) must
    wait until step() waits for the quorum itself. The reader here calls what torchft's quorum
    thread calls; the forward pass waits (1 s at most) for it to finish, which it does at once
    on a round that does not hold the reads. A synchronous-quorum manager reads inside
    start_quorum(): nothing is held, nothing deadlocks."""
    order: list[str] = []
    read = threading.Event()

    def state() -> dict:
        order.append("read")
        read.set()
        return {}

    with Lighthouse(min_replicas=1, join_timeout=0.2) as lighthouse:
        manager = _solo_manager(
            lighthouse, "hold0", state_dict=state, timeout=10, use_async_quorum=use_async_quorum
        )
        try:
            model = torch.nn.Linear(4, 2)
            opt = CrossShardOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), manager=manager)

            def forward_pre_hook(*_: object) -> None:
                if not read.wait(1.0):
                    order.append("held")

            model.register_forward_pre_hook(forward_pre_hook)
            for _ in range(2):
                order.clear()
                read.clear()
                opt.zero_grad()
                reader = threading.Thread(target=manager._manager_state_dict)  # torchft's read
                reader.start()
                model(torch.randn(3, 4)).sum().backward()
                order.append("backward")
                opt.step()
                reader.join(10)
                assert not reader.is_alive()
                if use_async_quorum:
                    assert order == ["held", "backward", "read"]
                else:
                    assert order == ["read", "backward"]
            assert opt.iterations == 2
        finally:
            manager.shutdown(wait=False)


def test_unreachable_lighthouse_names_the_address_within_the_connect_timeout():
    start = time.monotonic()
    with pytest.raises(LighthouseUnreachableError, match=r"http://127\.0\.0\.1:9 within"):
        make_manager(
            "http://127.0.0.1:9",
            replica_id="r0",
            state_dict=dict,
            load_state_dict=lambda _: None,
            connect_timeout=1,
        )
    assert time.monotonic() - start < 10


def test_make_manager_names_the_backends_it_takes():
    with pytest.raises(
        ValueError, match=r"unknown backend 'mpi': allowed values are 'gloo', 'nccl'"
    ):
        make_manager(
            "http://127.0.0.1:9", replica_id="r0", state_dict=dict,
            load_state_dict=lambda _: None, backend="mpi",
        )  # fmt: skip


def test_what_a_managed_cross_shard_refuses_is_named_before_anything_changes():
    """Weight-update sharding, the TF path and synchronize() under a manager: ValueError with
    the reason and what to use instead; the refused construction touches nothing."""
    with Lighthouse(min_replicas=1, join_timeout=0.2) as lighthouse:
        manager = _solo_manager(lighthouse, "refuse0")
        try:
            model = torch.nn.Linear(4, 2)
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            before = (set(vars(inner)), repr(inner.state_dict()))
            with pytest.raises(
                ValueError, match=r"shard_optimizer_state=True\) is refused: .*FSDP2"
            ):
                CrossShardOptimizer(inner, manager=manager, shard_optimizer_state=True)
            assert (set(vars(inner)), repr(inner.state_dict())) == before
            opt = CrossShardOptimizer(inner, manager=manager)
            model(torch.randn(3, 4)).sum().backward()
            pairs = [(p.grad.clone(), p) for p in model.parameters()]
            with pytest.raises(ValueError, match=r"TF path .* is refused: .*loss\.backward\(\)"):
                opt.apply_gradients(pairs)
            with pytest.raises(ValueError, match=r"synchronize\(\) is refused: .*max_grad_norm="):
                opt.synchronize()
            opt.step()  # the refusals left the optimizer usable
            assert opt.iterations == 1
        finally:
            manager.shutdown(wait=False)


def test_lighthouse_checks_and_address():
    with pytest.raises(ValueError, match=r"min_replicas must be an int >= 1"):
        Lighthouse(min_replicas=0)
    with pytest.raises(ValueError, match=r"heartbeat_timeout must be a finite number > 0"):
        Lighthouse(heartbeat_timeout=0)
    with Lighthouse(min_replicas=2) as lighthouse:
        assert lighthouse.address == f"http://127.0.0.1:{lighthouse.port}"
        assert lighthouse.port > 0


def test_lighthouse_command_announces_its_address_and_stops_on_sigterm():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distoptim.cli.main",
            "lighthouse",
            "--port",
            "0",
            "--host",
            "127.0.0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "distoptim lighthouse: http://127.0.0.1:" in line, line
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_checksum_is_bitwise():
    a = [torch.randn(30, 7), torch.randn(5, dtype=torch.float64), torch.tensor(2.5)]
    b = [t.clone() for t in a]
    assert state_checksum(a) == state_checksum(b)
    b[0][3, 4] = torch.nextafter(b[0][3, 4], torch.tensor(float("inf")))
    assert state_checksum(a) != state_checksum(b)
    assert state_checksum([torch.tensor([0.0])]) != state_checksum([torch.tensor([-0.0])])
    assert state_checksum([torch.tensor([1.0, 2.0])]) != state_checksum([torch.tensor([2.0, 1.0])])
    # dtype and shape are part of the state, not only the bytes
    x = torch.zeros(4)
    assert state_checksum([x]) != state_checksum([x.view(2, 2)])
    assert state_checksum([x]) != state_checksum([x.view(torch.int32)])
    bf = torch.randn(9).to(torch.bfloat16)
    assert state_checksum([bf]) == state_checksum([bf.clone()])
    assert state_checksum([torch.randn(8)[::2]]) != 0  # non-contiguous reads as its values


def test_slot_shards_partition_each_epoch_and_follow_the_step():
    slots = [SlotShards(103, 3, r, 4, seed=7) for r in range(3)]
    per_epoch = slots[0].batches_per_epoch
    assert per_epoch == 103 // 3 // 4
    for epoch in range(2):
        steps = range(epoch * per_epoch, (epoch + 1) * per_epoch)
        seen = torch.cat([s.batch(t) for s in slots for t in steps]).tolist()
        assert len(seen) == len(set(seen)) == 3 * per_epoch * 4
    # a pure function of the step: a fresh object (a restarted replica) gives the same batch
    assert torch.equal(SlotShards(103, 3, 1, 4, seed=7).batch(11), slots[1].batch(11))
    assert not torch.equal(slots[1].batch(0), slots[1].batch(per_epoch))  # reshuffled
    with pytest.raises(ValueError, match=r"slot must be in \[0, num_slots=3\)"):
        SlotShards(103, 3, 3, 4)
    with pytest.raises(ValueError, match=r"fewer than one batch"):
        SlotShards(10, 4, 0, 4)


def test_init_replica_group_outside_torchrun_names_what_it_needs(monkeypatch):
    from distoptim.ft import init_replica_group

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE not set"):
        init_replica_group()
    with pytest.raises(ValueError, match=r"timeout"):
        init_replica_group(timeout=0)


def test_init_replica_group_files_its_keys_under_the_attempt(monkeypatch):
    """Under torchrun's agent store, attempt N's process group files its rendezvous under
    ``attempt_N``: a restarted attempt cannot read the dead one's worker addresses (the whole
    restart: tests/ft/test_torchrun_restart.py)."""
    import torch.distributed as dist

    from distoptim.ft import init_replica_group

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0",
           "WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "1"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        assert init_replica_group(timeout=30) == (0, 1)
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
        # every key of its gloo rendezvous is filed under the attempt (a dead attempt's,
        # unprefixed or under attempt_0, is never read)
        assert store.list_keys() and all(k.startswith("attempt_1/") for k in store.list_keys())
        with pytest.raises(ValueError, match=r"a default process group exists already"):
            init_replica_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
