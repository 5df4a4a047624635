"""A replica group restarted by torchrun itself (``--max-restarts``) heals and rejoins.

Two replica groups of ``examples/fsdp_diloco_torchrun.py`` (FSDP2 inside each group of 2
processes, DiLoCo across, a torchft manager per process) around a real lighthouse started
here, each group its own ``torchrun``. Group 1 runs under ``--standalone --max-restarts 1``
and both its workers SIGKILL themselves at their third sync's quorum in torchrun's first
attempt only (``DISTOPTIM_FT_INJECT`` with ``DISTOPTIM_FT_INJECT_ATTEMPT=0``: a named point,
not a clock). torchrun then restarts the group's workers on the same agent store; they must
start their process group there (``init_replica_group``: the dead attempt's gloo keys are
still in that store), reach the lighthouse, heal from the other group and finish with it.
Every process of both groups prints the same model checksum.

Every wait is bounded (``RUN_TIMEOUT``); the test kills what it started, by process group.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from distoptim.ft.lighthouse import Lighthouse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp_diloco_torchrun.py"
STEPS, SYNC_EVERY = 200, 20
RUN_TIMEOUT = 300  # seconds: a bound on both groups' runs (about 20 s alone)
DONE = re.compile(
    r"\[replica (\d) rank (\d)\] done at step (\d+), (\d+) syncs, .*? model checksum ([0-9a-f]{16})"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(replica: int, lighthouse: str, log: Path, restarts: bool) -> subprocess.Popen:
    rdzv = (
        ["--standalone", "--max-restarts", "1"]
        if restarts
        else ["--nnodes", "1", "--master-port", str(_free_port())]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if restarts:  # both workers of this group die at their third sync, in attempt 0 only
        env.update(
            DISTOPTIM_FT_INJECT="after_quorum:contributor@3=kill", DISTOPTIM_FT_INJECT_ATTEMPT="0"
        )
    command = [
        sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", "2",
        str(EXAMPLE), "--lighthouse", lighthouse, "--replica-id", str(replica),
        "--steps", str(STEPS), "--sync-every", str(SYNC_EVERY),
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip


def test_a_group_torchrun_restarts_heals_and_every_process_ends_with_one_model(tmp_path):
    logs = [tmp_path / f"group{g}.log" for g in range(2)]
    with Lighthouse(min_replicas=2, heartbeat_timeout=2, join_timeout=30) as lighthouse:
        groups = [_torchrun(g, lighthouse.address, logs[g], restarts=g == 1) for g in range(2)]
        try:
            codes = [p.wait(timeout=RUN_TIMEOUT) for p in groups]
        finally:
            for p in groups:  # torchrun's agent and its workers: their own session
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
    text = [log.read_text() for log in logs]
    assert codes == [0, 0], (codes, text[1][-3000:], text[0][-3000:])
    # torchrun's first attempt of group 1 lost its workers to the injected SIGKILL
    assert "exitcode: -9" in text[1], text[1][-3000:]
    done = {(int(m[1]), int(m[2])): m for t in text for m in DONE.finditer(t)}
    assert sorted(done) == [(0, 0), (0, 1), (1, 0), (1, 1)], text
    assert {m[3] for m in done.values()} == {str(STEPS)}
    assert len({m[4] for m in done.values()}) == 1, done  # the same syncs on every process
    assert len({m[5] for m in done.values()}) == 1, done  # one model on every process
