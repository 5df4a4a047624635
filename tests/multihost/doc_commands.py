"""The multi-node commands of ``docs/multinode.md``, parsed so the tests run them verbatim.

A command block is a fenced ``bash`` block right after a ``<!-- multihost: NAME -->`` marker.
Inside it, ``# node N`` comment lines start node N's command (a block without them is one
command, for node 0); a trailing backslash continues a line; leading ``VAR=value`` words are the
command's environment. ``HOST<n>`` is replaced by node n's address -- the only substitution.

:func:`run_jobs` runs several blocks at once, each on its own hosts, in waves.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.multihost.harness import HostRun, Hosts, Running

__all__ = [
    "CPU_SECONDS",
    "DOC",
    "EXIT_BARRIER",
    "JOB_MODULE_MARKS",
    "Job",
    "NodeCommand",
    "doc_commands",
    "run_jobs",
    "start_block",
]

DOC = Path(__file__).resolve().parents[2] / "docs" / "multinode.md"
_BLOCK = re.compile(r"<!-- multihost: (\w+) -->\s*```bash\n(.*?)```", re.S)
_NODE = re.compile(r"#\s*node\s+(\d+)")
_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_HOST = re.compile(r"\bHOST(\d+)\b")
_REPO = DOC.parents[1]

CPU_SECONDS: dict[str, float] = {}
"""CPU seconds (user + system) of every job :func:`run_jobs` ran in this session, all nodes
together, by job name (the conftest prints them at the end: the budget, whatever the load)."""

JOB_MODULE_MARKS = [pytest.mark.slow, pytest.mark.multihost, pytest.mark.timeout(600)]
"""The marks of a module whose jobs run in a module fixture (in its first test's setup, hence
the longer pytest timeout)."""


@dataclass(frozen=True)
class NodeCommand:
    """One node's command: its environment assignments and argv, as written in the doc."""

    node: int
    env: dict[str, str]
    argv: list[str]
    text: str

    def on(self, addresses: list[str]) -> tuple[dict[str, str], list[str]]:
        """``(env, argv)`` with ``HOST<n>`` replaced by ``addresses[n]``."""

        def sub(s: str) -> str:
            return _HOST.sub(lambda m: addresses[int(m.group(1))], s)

        return {k: sub(v) for k, v in self.env.items()}, [sub(a) for a in self.argv]


def _command(node: int, text: str) -> NodeCommand:
    words = shlex.split(text)
    env = {}
    while words and _ASSIGN.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return NodeCommand(node, env, words, text)


def doc_commands(path: Path = DOC) -> dict[str, list[NodeCommand]]:
    """Every marked block of ``path``: name -> the commands of nodes 0, 1, ... in order."""
    blocks: dict[str, list[NodeCommand]] = {}
    for name, body in _BLOCK.findall(path.read_text()):
        if name in blocks:
            raise ValueError(f"{path}: block {name!r} appears twice")
        lines = body.replace("\\\n", " ").splitlines()
        commands: list[NodeCommand] = []
        node = 0
        for line in lines:
            line = line.strip()
            if not line:
                continue
            m = _NODE.fullmatch(line)
            if m:
                node = int(m.group(1))
                continue
            if line.startswith("#"):
                continue
            commands.append(_command(node, " ".join(line.split())))
        if [c.node for c in commands] != list(range(len(commands))):
            raise ValueError(f"{path}: block {name!r} must give nodes 0, 1, ... one command each")
        blocks[name] = commands
    return blocks


def start_block(
    hosts: Hosts,
    name: str,
    cwds: Sequence[Path],
    *,
    on: Sequence[int] | None = None,
    resolve: str = "loopback",
    timeout: float = 120.0,
    edit: Callable[[int, dict[str, str], list[str]], None] | None = None,
) -> Running:
    """Start block ``name`` of the doc: node i's command on host ``on[i]`` (default: host i),
    in folder ``cwds[i]``.

    ``edit(node, env, argv)`` may change a copy of a node's command in place -- only the tests
    that provoke a misconfiguration use it, by removing a flag the doc says is needed.
    """
    commands = doc_commands()[name]
    on = list(range(len(commands))) if on is None else list(on)
    if len(on) != len(commands):
        raise ValueError(f"block {name!r} has {len(commands)} commands, {len(on)} hosts given")
    addresses = [hosts[h].addr for h in on]  # HOST<n>: the address of node n's host
    argvs: list[list[str] | None] = [None] * len(hosts)
    envs: list[dict[str, str]] = [{} for _ in range(len(hosts))]
    dirs: list[Path | None] = [None] * len(hosts)
    for c, host, cwd in zip(commands, on, cwds):
        env, argv = c.on(addresses)
        if edit is not None:
            edit(c.node, env, argv)
        argvs[host], envs[host], dirs[host] = argv, env, cwd
    return hosts.start(argvs, env=envs, resolve=resolve, timeout=timeout, cwd=dirs)


@dataclass
class Job:
    """A doc block to run as one job: how (``resolve``, ``edit``, ``env``: variables added to
    every node's), and optionally ``during(job, running)``, called once every job of its wave
    started (e.g. to kill a host mid-run). ``serves``: the nodes whose command serves the
    others until it is stopped (a lighthouse): the job is over once every other node's command
    ended, and these are then stopped (``HostRun.stopped``)."""

    name: str
    block: str
    resolve: str = "loopback"
    edit: Callable[[int, dict[str, str], list[str]], None] | None = None
    env: dict[str, str] | None = None
    during: Callable[[Job, Running], None] | None = None
    serves: tuple[int, ...] = ()
    hosts: list[int] | None = None  # node i runs on host hosts[i] (set by run_jobs)
    cwds: list[Path] | None = None  # node i's working folder (set by run_jobs)


EXIT_BARRIER = re.compile(r"Local worker group finished \(WorkerState\.SUCCEEDED\)")
"""What torchrun's agent logs (``LOGLEVEL=INFO``) when its workers succeeded and it starts
waiting in the exit barrier for the other nodes' agents."""


def _only_exit_barriers_left(running: Running) -> bool:
    """A node's torchrun failed or was killed, and every node still running only waits in
    torch's exit barrier for it (which would last 300 s): nothing more will happen."""
    hosts = [p.host.index for p in running.procs]
    still = [h for h in hosts if running.running(h)]
    failed = [h for h in hosts if h not in still and running.returncode(h) != 0]
    return bool(failed) and all(EXIT_BARRIER.search(running.log(h)) for h in still)


def _over(job: Job) -> Callable[[Running], bool]:
    """When the rest of ``job`` need not be waited for: only exit barriers are left, or only
    the nodes that serve the others (``Job.serves``) still run."""
    assert job.hosts is not None
    served = [h for node, h in enumerate(job.hosts) if node not in job.serves]

    def over(running: Running) -> bool:
        if _only_exit_barriers_left(running):
            return True
        return bool(job.serves) and not any(running.running(h) for h in served)

    return over


def run_jobs(
    hosts: Hosts, waves: Sequence[Sequence[Job]], workdir: Path, timeout: float
) -> dict[str, list[HostRun]]:
    """Run each wave's jobs at once on disjoint hosts (in host order), the waves one after the
    other; each node in its own folder under ``workdir`` (with ``examples`` linked to the
    repository's, so the doc's relative paths work). The outcomes by job name.

    Every command gets ``LOGLEVEL=INFO`` (torchrun's own log level), so that a node whose
    workers succeeded while another node failed is seen waiting in torch's exit barrier and
    stopped (``HostRun.stopped``) instead of waited for until the timeout; a job's serving
    nodes (``Job.serves``) are stopped once its other nodes' commands ended."""
    out: dict[str, list[HostRun]] = {}
    for wave in waves:
        started: list[tuple[Job, Running]] = []
        free = 0
        try:
            for job in wave:
                n = len(doc_commands()[job.block])
                job.hosts = list(range(free, free + n))
                free += n
                if free > len(hosts):
                    raise ValueError(f"wave needs {free} hosts, there are {len(hosts)}")
                job.cwds = [workdir / job.name / f"node{i}" for i in range(n)]
                for d in job.cwds:
                    d.mkdir(parents=True, exist_ok=True)
                    if not (d / "examples").exists():
                        os.symlink(_REPO / "examples", d / "examples")
                edit, extra = job.edit, job.env or {}

                def _edit(node: int, env: dict[str, str], argv: list[str], edit=edit, extra=extra):
                    env.update({"LOGLEVEL": "INFO", **extra})
                    if edit is not None:
                        edit(node, env, argv)

                started.append(
                    (job, start_block(hosts, job.block, job.cwds, on=job.hosts,
                                      resolve=job.resolve, timeout=timeout, edit=_edit))
                )  # fmt: skip
            for job, running in started:
                if job.during is not None:
                    job.during(job, running)
            for job, running in started:
                out[job.name] = running.wait(until=_over(job))
                CPU_SECONDS[job.name] = sum(r.cpu_seconds for r in out[job.name])
        finally:
            for _, running in started:
                running.stop()
    return out
