"""cli.training: straggler emulation; the private torch state an RPC cluster in a reused process
relies on, pinned."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.rpc as rpc

import distoptim
from distoptim.cli import training
from distoptim.cli.datasets import Dataset
from distoptim.cli.progress import Reporter
from distoptim.cli.runconfig import RunConfig
from distoptim.cli.training import _cpp_log_level_flag, _rpc_in_a_reused_process, train_loop

_SCRIPT = """
import datetime, os, sys
import torch.distributed as dist
from distoptim.cli.training import _rpc_in_a_reused_process
def warn():  # a C++ LOG(WARNING): a store client that cannot connect yet, retried
    try:
        dist.TCPStore("127.0.0.1", 1, is_master=False, timeout=datetime.timedelta(seconds=0.3))
    except Exception:
        pass
with _rpc_in_a_reused_process():
    warn()
print("--- after ---", file=sys.stderr, flush=True)
warn()
"""


def test_rpcs_init_counter_is_reset_for_each_cluster(monkeypatch):
    # init_rpc prefixes its store keys with rpc_prefix_<this counter>: peers must agree
    assert isinstance(rpc._init_counter, int) and hasattr(rpc._init_counter_lock, "acquire")
    monkeypatch.setattr(rpc, "_init_counter", 3)
    with _rpc_in_a_reused_process():
        assert rpc._init_counter == 0


def test_the_cpp_log_level_flag_exists_and_is_restored(monkeypatch):
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    flag = _cpp_log_level_flag()
    assert flag is not None, "torch's libc10 no longer exports FLAGS_caffe2_log_level"
    before = flag.value
    with _rpc_in_a_reused_process():
        assert flag.value == max(before, 2)  # ERROR: warnings off
    assert flag.value == before
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")  # the user's choice wins
    with _rpc_in_a_reused_process():
        assert flag.value == before


def test_the_flag_silences_cpp_warnings_in_a_process_that_loaded_torch_earlier():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    inside, after = proc.stderr.split("--- after ---")
    assert "[W" not in inside and "[W" in after, proc.stderr  # off inside, back on after


class _Clock:
    """A fake ``time`` for the training module: every ``perf_counter()`` call advances 10 ms."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        self.now += 0.01
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_a_straggler_waits_factor_minus_one_times_its_forward_backward_after_each_step(
    monkeypatch,
):
    x, y = torch.rand(40, 4), torch.arange(40) % 2
    data = Dataset("tiny", x, y, x, y, 2)
    cfg = RunConfig("sync", 2, 1, 1, 5, "sgd", 0.1, 0, hidden=(3,), stragglers=((1, 3.0),))
    for rank, expected in ((1, [0.04] * 4), (0, [])):  # 20 samples each: 4 steps of 5
        clock = _Clock()
        monkeypatch.setattr(training, "time", clock)
        model = torch.nn.Linear(4, 2)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = distoptim.LocalSGD(inner, sync_every=2)  # a wrapper: only inner.step() is compute
        steps = train_loop(model, opt, cfg, data, rank, Reporter(None, rank), None, inner)
        assert steps == 4
        # forward + backward (10 ms between two clock reads) + the inner step (10 ms between
        # its pre and post hooks): 20 ms of compute, waited 2 x that after each step
        assert clock.slept == pytest.approx(expected)
        before = clock.now
        inner.step()  # the hooks are gone: they would read the clock
        assert clock.now == before


def _local_sgd_reference(cfg: RunConfig, data: Dataset) -> list[torch.Tensor]:
    """LocalSGD by hand, in one process: each worker its own model and inner optimizer on its
    own shard, every H steps and after the last step every parameter set to the mean over the
    workers (the inner optimizers' state stays local). The global model at the end."""
    from distoptim.cli.algorithms import make_torch_optimizer
    from distoptim.cli.workloads import as_workload

    workload = as_workload(data)
    models = [workload.build_model(cfg) for _ in range(cfg.workers)]
    inners = [make_torch_optimizer(cfg.optimizer, m.parameters(), cfg.lr) for m in models]
    streams = [workload.batches(cfg, rank) for rank in range(cfg.workers)]

    def average() -> None:
        with torch.no_grad():
            for tensors in zip(*(m.parameters() for m in models), strict=True):
                mean = torch.stack(tensors).mean(0)
                for t in tensors:
                    t.copy_(mean)

    total = workload.total_steps(cfg)
    for step in range(1, total + 1):
        for model, inner, stream in zip(models, inners, streams, strict=True):
            x, y = next(stream)
            inner.zero_grad(set_to_none=True)
            workload.loss(model, x, y).backward()
            inner.step()
        if step % cfg.communication_period == 0 or step == total:
            average()
    return [p.detach().clone() for p in models[0].parameters()]


@pytest.mark.timeout(240)
def test_the_diloco_familys_evaluated_model_includes_the_steps_after_the_last_sync():
    from distoptim.cli.datasets import load_dataset
    from distoptim.cli.training import collective_rank
    from distoptim.launch import spawn

    # 45 steps per worker (719 digits each), a sync every 7: the last periodic one at 42
    cfg = RunConfig("localsgd", 2, 7, 1, 16, "adam", 0.001, 0)
    data = load_dataset("digits")
    outs = spawn(collective_rank, 2, (cfg, data, None, None), timeout=180)
    for rank, out in enumerate(outs):
        assert out["steps"] == 45, rank
        assert out["syncs"] == 45 // 7 + 1, rank  # 6 periodic and the last one, on every rank
    reference = _local_sgd_reference(cfg, data)
    for got, want in zip(outs[0]["params"], reference, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
