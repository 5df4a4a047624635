"""A script without ``if __name__ == "__main__":`` that starts processes: one line naming the fix.

Every child imports the script again (forkserver and spawn alike); at its top
level the script starts processes again, which Python refuses in a child that is still
starting. ``distoptim.launch``, ``distoptim.agn.spawn`` and the command line must say so in one
line -- not "died during start-up ... pass on_startup_failure='drop'", a fix that would not help.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distoptim.launch import MainGuardError, RankFailedError, run_processes

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
GUARD = 'put the code that starts processes under `if __name__ == "__main__":`'


def _agn_docs_snippet() -> str:
    """The first example of docs/agn.md, exactly as written there."""
    text = (ROOT / "docs" / "agn.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    snippet = next(b for b in blocks if "from distoptim.agn import spawn" in b)
    assert "__main__" not in snippet  # the case at hand: copied as written, no guard
    return snippet


LAUNCH_SCRIPT = """\
import torch.distributed as dist
from distoptim.launch import spawn


def work(rank, world_size):
    dist.barrier()
    return rank


print(spawn(work, 2, timeout=120))
"""

CLI_SCRIPT = """\
import sys
from distoptim.cli.main import main

sys.exit(main(["train", "--algo", "sync", "--workers", "2", "--epochs", "1", "--progress",
               "plain", "--out", sys.argv[1]]))
"""


def _run(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.parametrize("source", [LAUNCH_SCRIPT, _agn_docs_snippet()], ids=["launch", "agn"])
def test_an_unguarded_script_is_told_to_add_the_main_guard(tmp_path, source):
    proc = _run(tmp_path, source)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("distoptim.launch.MainGuardError: "), proc.stderr[-3000:]
    assert GUARD in last and str(tmp_path / "script.py") in last
    assert "on_startup_failure" not in proc.stderr


def test_the_command_line_says_it_in_one_line(tmp_path):
    out = tmp_path / "out"
    proc = _run(tmp_path, CLI_SCRIPT, str(out))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if GUARD in line]
    assert len(said) == 1 and said[0].startswith("distoptim: "), proc.stderr[-3000:]
    # the children left before any side effect: no output folder of their own
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "script.py"]


def _exit_86(x: int) -> int:
    os._exit(86)


def test_a_started_task_that_exits_86_is_not_mistaken_for_a_missing_guard():
    with pytest.raises(RankFailedError, match=r"exit code 86") as info:
        run_processes(_exit_86, [(0,)], timeout=60)
    assert not isinstance(info.value, MainGuardError)
