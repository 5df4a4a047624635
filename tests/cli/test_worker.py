"""cli.worker: the private torch state a cluster in a reused process relies on, pinned."""

from __future__ import annotations

import os
import subprocess
import sys

import torch.distributed.rpc as rpc

from distoptim.cli.worker import _cpp_log_level_flag, _rpc_in_a_reused_process

_SCRIPT = """
import datetime, os, sys
import torch.distributed as dist
from distoptim.cli.worker import _rpc_in_a_reused_process
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
