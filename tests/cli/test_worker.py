"""cli.worker: the private torch flag behind quiet parameter-server shut-downs, pinned."""

from __future__ import annotations

import os
import subprocess
import sys

from distoptim.cli.worker import _cpp_log_level_flag, _cpp_warnings_off

_SCRIPT = """
import datetime, os, sys
import torch.distributed as dist
from distoptim.cli.worker import _cpp_warnings_off
def warn():  # a C++ LOG(WARNING): a store client that cannot connect yet, retried
    try:
        dist.TCPStore("127.0.0.1", 1, is_master=False, timeout=datetime.timedelta(seconds=0.3))
    except Exception:
        pass
with _cpp_warnings_off():
    warn()
print("--- after ---", file=sys.stderr, flush=True)
warn()
"""


def test_the_cpp_log_level_flag_exists_and_is_restored(monkeypatch):
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    flag = _cpp_log_level_flag()
    assert flag is not None, "torch's libc10 no longer exports FLAGS_caffe2_log_level"
    before = flag.value
    with _cpp_warnings_off():
        assert flag.value == max(before, 2)  # ERROR: warnings off
    assert flag.value == before
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "INFO")  # the user's choice wins
    with _cpp_warnings_off():
        assert flag.value == before


def test_the_flag_silences_cpp_warnings_in_a_process_that_loaded_torch_earlier():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    inside, after = proc.stderr.split("--- after ---")
    assert "[W" not in inside and "[W" in after, proc.stderr  # off inside, back on after
