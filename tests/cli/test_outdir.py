"""Two commands with the same ``--out``: one gets the folder, the other is told who has it --
never both running and one ``results.json`` silently replacing the other."""

from __future__ import annotations

import os

import pytest

from distoptim.cli import outdir
from distoptim.cli.arguments import UsageError
from tests.cli.helpers import command, plan_of, results, start_command

pytestmark = pytest.mark.timeout(240)


def test_a_claimed_out_folder_is_refused_to_a_second_command_until_released(tmp_path):
    argv = ["compare", "--algos", "sync", "--out", str(tmp_path / "out"), "--overwrite"]
    try:
        plan_of(*argv)  # the first command: it has the folder
        # a second command sees no results.json yet: without the claim it would go ahead
        taken = rf"taken by another distoptim command running now \(pid {os.getpid()}\)"
        with pytest.raises(UsageError, match=taken):
            _second_command(argv)
    finally:
        outdir.release()
    assert plan_of(*argv).out == str(tmp_path / "out")
    outdir.release()


def _second_command(argv: list[str]) -> None:
    """Another command in this process: its claim is a new descriptor, like a new process's."""
    held = dict(outdir._CLAIMS)
    outdir._CLAIMS.clear()  # forget (not release) ours, so that this one really claims
    try:
        plan_of(*argv)
    finally:
        outdir._CLAIMS.update(held)


def test_two_commands_started_together_with_one_out_one_runs_one_is_refused(tmp_path):
    out = tmp_path / "out"
    cmd = command("train", "--algo", "sync", "--workers", "1", "--epochs", "1")
    cmd += ["--progress", "none", "--out", str(out)]
    procs = [start_command([*cmd, "--seed", str(seed)]) for seed in (1, 2)]
    done = [(p, *p.communicate(timeout=220)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in done)
    assert codes == [0, 2], [e[-2000:] for _, _, e in done]
    (winner, _, _), (_, _, said) = sorted(done, key=lambda d: d[0].returncode)
    line = said.strip().splitlines()[-1]
    assert line == (
        f"distoptim train: error: --out {str(out)!r} is taken by another distoptim command "
        f"running now (pid {winner.pid}): it writes its results there; give this one another "
        "folder"
    )
    doc = results(out)
    assert doc["status"] == "complete"
    assert doc["command"][-2:] == ["--seed", "1" if procs[0] is winner else "2"]
