"""Fault-tolerant replica groups across hosts: a host killed and brought back, the job goes on.

Runs the ``ft`` block of ``docs/multinode.md`` verbatim on four hosts (hostnames resolving to
loopback, the hostile case): torchft's lighthouse on host 0 (``distoptim lighthouse``) and one
replica group of two processes (``examples/ft_torchrun.py``, CrossShardOptimizer with a torchft
manager) on each of hosts 1-3. Once host 3 is training, every process on it is killed; the two
other groups keep committing steps without it (the lighthouse's floor is two groups); host 3's
command is started again, heals from a peer and commits with them; all three finish with the
same model, bit for bit.
"""

from __future__ import annotations

import re

from tests.multihost.doc_commands import DOC, JOB_MODULE_MARKS, doc_commands, start_block
from tests.multihost.harness import HostRun, Hosts

pytestmark = JOB_MODULE_MARKS

_TIMEOUT = 420.0
_DONE = re.compile(r"\[replica (\d)\] done at step (\d+): model checksum ([0-9a-f]{16})")
_STEP = re.compile(r"\[replica (\d)\] step (\d+) commits (\d+) heals (\d+)")


def _steps(text: str) -> list[tuple[int, int, int]]:
    return [(int(s), int(c), int(h)) for _, s, c, h in _STEP.findall(text)]


def test_a_replica_host_killed_and_brought_back(hosts: Hosts, tmp_path_factory) -> None:
    on = [4, 5, 6, 7]  # hosts of their own (the other modules' waves use 0-3)
    cwds = [tmp_path_factory.mktemp(f"ft_node{i}") for i in range(4)]
    repo_examples = DOC.parents[1] / "examples"
    for d in cwds:
        (d / "examples").symlink_to(repo_examples)
    running = start_block(hosts, "ft", cwds, on=on, timeout=_TIMEOUT)
    again = None
    try:
        # host 3 is training: its first progress line, whatever its step (started last on a
        # loaded machine, it may heal into the others' step past 100 and never print "step 100")
        assert running.wait_for(on[3], r"\[replica 2\] step \d+ ", _TIMEOUT), running.log(on[3])
        # ... and so is host 1, whose last step marks where the survivors went on from (host 3's
        # first line can come before host 1's first: seen with processes forked warm)
        assert running.wait_for(on[1], r"\[replica 0\] step \d+ ", _TIMEOUT), running.log(on[1])
        running.kill_host(on[3])
        mark = max(s for s, _, _ in _steps(running.log(on[1])))
        # the survivors go on without it (two groups: the lighthouse's floor)
        assert running.wait_for(on[1], rf"\[replica 0\] step {mark + 200} ", _TIMEOUT)
        node3 = doc_commands()["ft"][3]
        env, argv = node3.on([hosts[h].addr for h in on])
        commands: list[list[str] | None] = [None] * len(hosts)
        envs: list[dict[str, str]] = [{} for _ in range(len(hosts))]
        commands[on[3]], envs[on[3]] = argv, env
        dirs = [None] * len(hosts)
        dirs[on[3]] = cwds[3]
        again = hosts.start(commands, env=envs, resolve="loopback", timeout=_TIMEOUT, cwd=dirs)
        done = again.wait()
        survivors = running.wait(until=lambda r: not r.running(on[1]) and not r.running(on[2]))
    finally:
        running.stop()
        if again is not None:
            again.stop()
    runs: dict[int, HostRun] = {r.host.index: r for r in [*survivors, *done]}
    for h in on[1:]:
        assert runs[h].returncode == 0, runs[h].describe()
    finals = {m[0]: (int(m[1]), m[2]) for r in runs.values() for m in _DONE.findall(r.stdout)}
    assert set(finals) == {"0", "1", "2"}, finals
    assert len({f[1] for f in finals.values()}) == 1, finals  # one model, bit for bit
    assert {f[0] for f in finals.values()} == {4000}
    rejoined = _steps(runs[on[3]].stdout)
    assert rejoined and rejoined[-1][2] >= 1, runs[on[3]].stdout  # it healed from a peer
    assert rejoined[0][0] > 100  # and resumed where the others were, not from scratch
