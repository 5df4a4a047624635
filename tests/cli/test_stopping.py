"""Stopping `distoptim compare` at any phase: SIGINT, SIGTERM and SIGHUP -- a closed terminal
included -- stop it within seconds, kill every process it started, write results.json with
what finished, and exit 128 + the signal. The pool's start-up is a phase like the others."""

from __future__ import annotations

import json
import os
import pty
import selectors
import signal
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path

import pytest

from distoptim.cli.stopping import signals_held

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _command(out: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "distoptim.cli.main", "compare", "--algos", "sync,easgd"]
    return [*cmd, "--workers", "2", "--progress", "plain", "--out", str(out), *extra]


def _env(mark: str) -> dict[str, str]:
    """The command's environment, marked so that its processes can be found after it ended
    (every process it starts inherits the mark, whoever its parent is by then)."""
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "DISTOPTIM_TEST_MARK": mark}


def _marked(mark: str) -> set[int]:
    """Running processes (not zombies) whose environment carries ``mark``."""
    found = set()
    needle = f"DISTOPTIM_TEST_MARK={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.add(int(entry))
        except OSError:
            continue
    return found


def _children_started(pid: int, mark: str, count: int, timeout: float) -> None:
    """Wait (bounded) until ``count`` processes besides ``pid`` carry the mark."""
    deadline = time.monotonic() + timeout
    while len(_marked(mark) - {pid}) < count:
        assert time.monotonic() < deadline, f"{count} child processes did not start"
        time.sleep(0.05)  # polling /proc for the children to appear: no event says so


def _read_until(stream, needle: str, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    seen = ""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} within {timeout}s; got:\n{seen}"
        if sel.select(timeout=left):
            line = stream.readline()
            assert line, f"the command ended before {needle!r}:\n{seen}"
            seen += line
    return seen


def _gone(mark: str, timeout: float) -> bool:
    """Every marked process has ended within ``timeout`` (waiting on pidfds, not polling;
    multiprocessing's resource tracker leaves by itself when the command's end of its pipe
    closes)."""
    deadline = time.monotonic() + timeout
    for pid in _marked(mark):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            sel = selectors.DefaultSelector()
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return False
        finally:
            os.close(fd)
    return True


@pytest.mark.parametrize(
    ("sig", "group", "code"),
    [
        (signal.SIGTERM, False, 143),  # kill, timeout, a job scheduler
        (signal.SIGINT, True, 130),  # a terminal's Ctrl-C: the whole process group
        (signal.SIGHUP, False, 129),  # a closed ssh session
    ],
)
def test_a_signal_while_the_pool_starts_stops_it_and_writes_results(tmp_path, sig, group, code):
    out, mark = tmp_path / "out", uuid.uuid4().hex
    proc = subprocess.Popen(
        _command(out, "--epochs", "100000"),
        env=_env(mark),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _read_until(proc.stderr, "starting 3 worker processes", timeout=120)
        _children_started(proc.pid, mark, 3, timeout=60)  # starting: importing torch
        sent = time.monotonic()
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == code, stderr
    assert took < 20, f"it took {took:.1f} s to stop"
    assert "ready in" not in stderr  # stopped during the start-up, not after it
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "leaked semaphore" not in stderr
    assert _gone(mark, timeout=30), "a process of the command outlived it"
    doc = json.loads((out / "results.json").read_text())
    assert doc["status"] == "interrupted" and doc["runs"] == []
    assert "interrupted" in stderr and f"results: {out / 'results.json'}" in stdout


def _results_after_a_signal_mid_run(doc: dict, said: str) -> None:
    assert doc["status"] == "interrupted"
    assert [r["status"] for r in doc["runs"]] == ["interrupted"]  # easgd never started
    assert doc["runs"][0]["error"] == f"interrupted by {said}"
    assert doc["runs"][0]["history"], "the progress that reached the parent is kept"


def test_sighup_mid_run_keeps_the_results(tmp_path):
    out, mark = tmp_path / "out", uuid.uuid4().hex
    proc = subprocess.Popen(
        _command(out, "--epochs", "100000"),
        env=_env(mark),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _read_until(proc.stderr, "training started", timeout=180)
        proc.send_signal(signal.SIGHUP)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 129, stderr
    assert "Traceback" not in stderr and "leaked semaphore" not in stderr, stderr
    assert _gone(mark, timeout=30), "a process of the command outlived it"
    _results_after_a_signal_mid_run(json.loads((out / "results.json").read_text()), "SIGHUP")
    assert "interrupted" in stdout  # the table marks the row


def _controlling_terminal() -> None:  # in the child, before exec: the pty is its terminal
    import fcntl

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_a_closed_terminal_stops_the_run_and_keeps_the_results(tmp_path):
    # what an ssh session that drops does: the terminal goes away, the kernel sends SIGHUP to
    # the foreground process group (the command and its workers), and every later write to
    # the terminal fails (EIO) -- still the results are written and the exit code is 129
    out, mark = tmp_path / "out", uuid.uuid4().hex
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        _command(out, "--epochs", "100000"),
        env=_env(mark),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
        preexec_fn=_controlling_terminal,
    )
    os.close(slave)
    try:
        reader = os.fdopen(master, "r", errors="replace", closefd=False)
        _read_until(reader, "training started", timeout=180)
        os.close(master)  # the terminal is gone
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 129
    assert _gone(mark, timeout=30), "a process of the command outlived it"
    _results_after_a_signal_mid_run(json.loads((out / "results.json").read_text()), "SIGHUP")


def test_a_signal_while_results_are_written_is_kept_not_lost():
    with signals_held() as held:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGHUP)
    stop = held.interrupt()
    assert isinstance(stop, KeyboardInterrupt) and stop.signum == signal.SIGTERM  # the first
