"""What `distoptim compare` prints is what the user needs: no line of blanks around the table,
no raw C++ warnings from the worker processes' expected retries."""

from __future__ import annotations

import io
import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from distoptim.cli.pool import Task
from distoptim.cli.progress import ProgressDisplay
from distoptim.cli.report import render_table, summarize
from distoptim.cli.session import _start_pool, _Timing
from tests.cli.helpers import plan_of
from tests.cli.test_report import _rec


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), _Terminal()], ids=["piped", "terminal"])
def test_the_table_has_no_line_of_blanks_around_it(stream):
    render_table(summarize([_rec("sync", 0.9), _rec("diloco", 0.8)]), stream)
    lines = stream.getvalue().splitlines()
    assert lines and not [line for line in lines if not line.strip()], lines[:3]


def _store_wait_that_times_out(context, port: int) -> float:
    """What a parameter-server worker's connection attempt does when the shard is slow: a
    store wait whose window passes (torch logs a C++ warning for it)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        store.wait(["never set"], timedelta(milliseconds=100))
    return time.monotonic() - t0


@pytest.mark.timeout(180)
def test_the_worker_processes_print_no_cpp_warnings(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    plan = plan_of("compare", "--algos", "sync", "-n", "1", "--out", str(tmp_path / "out"))
    display = ProgressDisplay("none")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pool, events = _start_pool(plan, _Timing(1, None), display, None, None)
    try:
        took = pool.run([Task(_store_wait_that_times_out, (store.port,))], timeout=60)
        assert took[0].value >= 0.1  # the wait did time out in the worker process
    finally:
        pool.close()
        events.close()
    err = capfd.readouterr().err
    assert "waitForInput" not in err and "[W" not in err, err
    assert os.environ.get("TORCH_CPP_LOG_LEVEL") is None  # only the workers had it
