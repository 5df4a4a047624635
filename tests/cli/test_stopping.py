"""Stopping `distoptim compare` at any phase: SIGINT, SIGTERM and SIGHUP -- a closed terminal
included -- stop it within seconds, kill every process it started, write results.json with
what finished, and exit 128 + the signal. The pool's start-up is a phase like the others."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import termios
import time
import uuid
from pathlib import Path

import pytest

from distoptim.cli.stopping import signals_held
from tests.cli.helpers import command, environment, read_until, results, start_command, wait_gone

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _command(out: Path, *extra: str) -> list[str]:
    cmd = command("compare", "--algos", "sync,easgd", "--workers", "2", "--progress", "plain")
    return [*cmd, "--out", str(out), *extra]


def _env(mark: str) -> dict[str, str]:
    """The command's environment, marked so that its processes can be found after it ended
    (every process it starts inherits the mark, whoever its parent is by then)."""
    return environment(DISTOPTIM_TEST_MARK=mark)


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


def _gone(mark: str, timeout: float) -> bool:
    """Every marked process has ended within ``timeout`` (waiting on pidfds, not polling;
    multiprocessing's resource tracker leaves by itself when the command's end of its pipe
    closes)."""
    return wait_gone(_marked(mark), timeout)


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
    proc = start_command(_command(out, "--epochs", "100000"), _env(mark), start_new_session=True)
    try:
        read_until(proc.stderr, "starting 3 worker processes", timeout=120)
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
    doc = results(out)
    assert doc["status"] == "interrupted" and doc["runs"] == []
    assert "interrupted" in stderr and f"results: {out / 'results.json'}" in stdout


def _results_after_a_signal_mid_run(doc: dict, said: str) -> None:
    assert doc["status"] == "interrupted"
    assert [r["status"] for r in doc["runs"]] == ["interrupted"]  # easgd never started
    assert doc["runs"][0]["error"] == f"interrupted by {said}"
    assert doc["runs"][0]["history"], "the progress that reached the parent is kept"


def test_sighup_mid_run_keeps_the_results(tmp_path):
    out, mark = tmp_path / "out", uuid.uuid4().hex
    proc = start_command(_command(out, "--epochs", "100000"), _env(mark), start_new_session=True)
    try:
        read_until(proc.stderr, "training started", timeout=180)
        proc.send_signal(signal.SIGHUP)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 129, stderr
    assert "Traceback" not in stderr and "leaked semaphore" not in stderr, stderr
    assert _gone(mark, timeout=30), "a process of the command outlived it"
    _results_after_a_signal_mid_run(results(out), "SIGHUP")
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
        read_until(reader, "training started", timeout=180)
        os.close(master)  # the terminal is gone
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 129
    assert _gone(mark, timeout=30), "a process of the command outlived it"
    _results_after_a_signal_mid_run(results(out), "SIGHUP")


def test_a_signal_while_results_are_written_is_kept_not_lost():
    with signals_held() as held:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGHUP)
    stop = held.interrupt()
    assert isinstance(stop, KeyboardInterrupt) and stop.signum == signal.SIGTERM  # the first
