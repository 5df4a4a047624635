"""The harness itself: what a host sees, timeouts, and that nothing is ever left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.multihost import harness
from tests.multihost.harness import Hosts, leftovers, namespaces_unavailable, sweep

pytestmark = pytest.mark.multihost

_REASON = namespaces_unavailable()
if _REASON is not None:
    pytestmark = [pytestmark, pytest.mark.skip(reason=f"needs network namespaces: {_REASON}")]

_PROBE = r"""
import socket, sys
def reach(addr):
    s = socket.socket(); s.settimeout(1.5)
    try:
        s.connect((addr, 9))
    except ConnectionRefusedError:
        return "refused"  # a host answered
    except OSError as exc:
        return type(exc).__name__
    return "open"
print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))
print(" ".join(reach(a) for a in sys.argv[1:]))
"""


def _root_links() -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    return sorted(line.split(":")[1].strip() for line in out.stdout.splitlines())


def test_hosts_see_their_own_name_and_only_the_shared_network() -> None:
    links = _root_links()
    with Hosts(2) as hs:
        h0, h1 = hs.hosts
        targets = [h1.addr, h1.mgmt_addr, "192.0.2.77"]
        runs = hs.start([[sys.executable, "-c", _PROBE, *targets], None], resolve="mgmt").wait()
        (run,) = runs
        assert run.returncode == 0, run.describe()
        name_line, reach_line = run.stdout.splitlines()
        assert name_line == f"h0 {h0.mgmt_addr}"
        # eth0 reaches the other host; its mgmt0 and anything else are unreachable
        assert reach_line.split()[0] == "refused"
        assert "refused" not in reach_line.split()[1:]
        runs = hs.start([None, [sys.executable, "-c", _PROBE]], resolve="loopback").wait()
        assert runs[0].stdout.splitlines()[0] == "h1 127.0.1.1"
        assert _root_links() == links, "nothing is created in the root namespace"
        prefix = hs.prefix
        assert len(leftovers(prefix)) == 3
    assert leftovers(prefix) == []
    assert _root_links() == links


def test_timeout_kills_everything_and_failure_inside_cleans_up() -> None:
    prefix = None
    with pytest.raises(RuntimeError, match="boom"), Hosts(2) as hs:
        prefix = hs.prefix
        (run,) = hs.start([["sleep", "30"]], timeout=1.0).wait()
        # timed out: cut at the deadline, 1 s after start() was called (not after this
        # process's own start, which a loaded machine delays: its seconds may be under 1)
        assert run.timed_out and run.returncode is None
        assert run.seconds < 10  # and killed then, not left to its 30 s
        hs.start([["sleep", "30"], ["sleep", "30"]], timeout=60)  # left running on purpose
        raise RuntimeError("boom")
    assert prefix is not None and leftovers(prefix) == []


_HANG = r"""
import subprocess, sys, threading, time
def parked_in_a_thread():
    threading.Event().wait()
def parent_waits_for_its_child(child):
    child.wait()
threading.Thread(target=parked_in_a_thread, daemon=True).start()
if sys.argv[1:] == ["child"]:
    time.sleep(600)
else:
    parent_waits_for_its_child(subprocess.Popen([sys.executable, __file__, "child"]))
"""


def test_a_command_that_ended_before_wait_past_its_deadline_is_not_timed_out() -> None:
    """Jobs of a wave are waited for one after the other: when an earlier one takes the whole
    timeout, a later one that ended long before is waited for past its deadline."""
    with Hosts(1) as hs:
        running = hs.start([[sys.executable, "-c", "print('done')"]], timeout=1.0)
        while running.running(0):
            time.sleep(0.05)
        time.sleep(1.5)  # past the deadline
        (run,) = running.wait()
    assert run.returncode == 0 and not run.timed_out, run.describe()
    assert run.stdout == "done\n" and run.stacks == ""


def test_a_command_that_times_out_reports_every_process_stacks(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(_HANG)
    with Hosts(1) as hs:
        (run,) = hs.start([[sys.executable, str(script)]], timeout=4.0).wait()
    assert run.timed_out
    text = run.describe()
    assert text.count("--- pid ") >= 2, text  # the parent and its child (py-spy may add more)
    for frame in ("parent_waits_for_its_child", "parked_in_a_thread", "in <module>"):
        assert frame in run.stacks, text
    assert f"{sys.executable} {script} child" in run.stacks, text


def test_sweep_removes_leftovers_of_dead_runs_only() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"dmh{harness._base36(dead.pid)}.1-h0"
    ours = f"dmh{harness._base36(os.getpid())}.99-h0"
    for name in (stale, ours):
        subprocess.run(["ip", "netns", "add", name], check=True)
    folder = Path(tempfile.mkdtemp(prefix=f"dmh{harness._base36(dead.pid)}.1-"))
    try:
        swept = sweep()
        assert stale in swept and ours not in swept
        assert leftovers(stale) == [] and leftovers(ours) == [ours]
        assert not folder.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        for name in (stale, ours):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
