"""Hosts in network namespaces: a few private "machines" on one switch, for multi-node tests.

Owns: creating the hosts, running one command per host (its own environment, logs, timeout),
killing a host's processes, and always removing everything it made.

The network (nothing is created in the root namespace, so nothing can leak onto the real one)
---------------------------------------------------------------------------------------------
* ``<prefix>-sw``: a namespace holding the switch, a bridge ``br0``.
* ``<prefix>-h<i>`` (host ``i``, hostname ``h<i>``): ``lo`` up; ``eth0`` =
  ``10.213.0.<i+1>/24``, a veth whose other end is a port of the switch (the network the nodes
  share); ``mgmt0`` = ``10.213.1.<i+1>/24``, a veth whose other end stays in the same namespace:
  an interface that exists and binds but reaches nobody (a management NIC, ``docker0``, ...).
  No default route: any other address is unreachable from a host.

Deleting the namespaces deletes every interface. Namespace names are
``dmh<pid in base 36>.<n>-...``; :func:`sweep` deletes those of processes that no longer run
(a run killed before its clean-up), so leftovers never accumulate.

A command on host ``i`` runs as::

    ip netns exec <prefix>-h<i> unshare --uts --mount -- \\
        sh -c 'mount --bind <hosts file> /etc/hosts && hostname h<i> && exec "$@"' sh ARGV...

so it has its own network stack, its own hostname (torchrun decides by hostname whether a node
hosts the c10d rendezvous store, and gloo/TensorPipe pick their address from it) and its own
``/etc/hosts`` (the bind mount lives in the command's private mount namespace). Every Python
process of the command can dump its stacks on ``SIGUSR1`` (``_stacks/sitecustomize.py``): a
command that outlives its timeout is asked for them before it is killed, and they are part of
its :meth:`HostRun.describe` (so a hang says where it hangs). How the
hostnames resolve is chosen per run (``resolve``):

* ``"data"``: every ``h<i>`` resolves to its ``eth0`` address (a well-configured cluster);
* ``"loopback"``: every ``h<i>`` resolves to ``127.0.1.1`` (a container whose name resolves to
  loopback, or Debian's ``127.0.1.1 <hostname>``; the machine this was first tried on);
* ``"mgmt"``: every ``h<i>`` resolves to its ``mgmt0`` address (the hostname names the wrong NIC).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from distoptim.netcheck import ENVIRONMENT

__all__ = [
    "DATA_NET",
    "MGMT_NET",
    "Host",
    "HostRun",
    "Hosts",
    "Running",
    "leftovers",
    "namespaces_unavailable",
    "sweep",
]

DATA_NET = "10.213.0"
MGMT_NET = "10.213.1"
RESOLVE = ("data", "loopback", "mgmt")
_BASE = "dmh"
_NAME = re.compile(rf"^{_BASE}([0-9a-z]+)\.(\d+)-")
_COUNTER = [0]
_Cwd = str | os.PathLike[str] | Sequence[str | os.PathLike[str] | None] | None
# what a command must not inherit from the test process (each run sets its own)
_SCRUB = ENVIRONMENT
_STACKS = Path(__file__).resolve().parent / "_stacks"  # its sitecustomize: stacks on SIGUSR1
_STACKS_WAIT = 5.0  # seconds the processes get to write their stacks
_PYSPY_TIMEOUT = 20.0  # seconds per process for py-spy's native stacks (when installed)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _namespaces() -> list[str]:
    listing = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listing.splitlines() if line.strip()]


def leftovers(prefix: str = _BASE) -> list[str]:
    """Namespaces whose name starts with ``prefix`` (default: any this harness makes)."""
    return [n for n in _namespaces() if n.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_namespace_processes(netns: str) -> None:
    for _ in range(3):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.05)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def _dump_stacks(netns: str, folder: Path) -> str:
    """The Python stacks (every thread) of every live process on ``netns`` that registered a
    stacks file in ``folder`` (``_stacks/sitecustomize.py``), asked for with ``SIGUSR1``; with
    py-spy installed, also each one's native stacks (where a C++ wait hangs)."""
    pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
    asked = [p for p in sorted(pids) if (folder / f"{p}.txt").exists() and _pid_alive(p)]
    names = {p: _cmdline(p) for p in asked}
    for pid in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + _STACKS_WAIT
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:  # until every file is written and stopped growing
        now = {p: (folder / f"{p}.txt").stat().st_size for p in asked}
        if all(now.values()) and now == sizes:
            break
        sizes = now
        time.sleep(0.2)
    parts = []
    pyspy = shutil.which("py-spy")
    for pid in asked:
        text = (folder / f"{pid}.txt").read_text(errors="replace").strip() or "(no answer)"
        parts.append(f"--- pid {pid}: {names[pid]}\n{text}")
        if pyspy is not None:
            try:
                native = subprocess.run(
                    [pyspy, "dump", "--native", "--pid", str(pid)],
                    capture_output=True, text=True, timeout=_PYSPY_TIMEOUT,
                )  # fmt: skip
                parts.append(f"--- pid {pid}, py-spy --native\n{native.stdout}{native.stderr}")
            except subprocess.TimeoutExpired:
                parts.append(f"--- pid {pid}, py-spy --native: no answer in {_PYSPY_TIMEOUT} s")
    if not parts:
        return f"(no Python process left on {netns})"
    return "\n".join(parts)


def _delete_namespace(netns: str) -> None:
    _kill_namespace_processes(netns)
    _ip("netns", "del", netns, check=False)


def sweep() -> list[str]:
    """Delete the namespaces (and temporary folders) of harness runs whose process is gone;
    returns the namespaces' names."""
    swept = []
    for name in _namespaces():
        m = _NAME.match(name)
        if m and not _pid_alive(int(m.group(1), 36)):
            _delete_namespace(name)
            swept.append(name)
    for folder in Path(tempfile.gettempdir()).glob(f"{_BASE}*"):
        m = _NAME.match(folder.name)
        if m and folder.is_dir() and not _pid_alive(int(m.group(1), 36)):
            shutil.rmtree(folder, ignore_errors=True)
    return swept


def namespaces_unavailable() -> str | None:
    """Why hosts cannot be created here (``None`` when they can): not root, no ``ip`` or
    ``unshare``, or the kernel refuses a network namespace."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "sh"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed"
    probe = f"{_BASE}{_base36(os.getpid())}.probe-x"
    made = _ip("netns", "add", probe, check=False)
    try:
        if made.returncode != 0:
            return f"'ip netns add' fails here: {made.stderr.strip()}"
        link = _ip(
            "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False
        )
        if link.returncode != 0:
            return f"veth pairs cannot be created here: {link.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One host: its index, hostname, namespace and addresses."""

    index: int
    hostname: str
    netns: str
    addr: str
    mgmt_addr: str


@dataclass
class HostRun:
    """What a host's command did: exit code (``None``: still running when the run's timeout
    came, ``timed_out``, or when the caller said to stop, ``stopped``), logs, seconds;
    ``killed``: its host was killed on purpose (:meth:`Running.kill_host`); ``cpu_seconds``:
    user + system CPU time of the command and the descendants it waited for (torchrun and its
    workers), whatever the machine's load; processes killed with it are not counted;
    ``stacks``: for a command that timed out, the stacks of its processes still alive then."""

    host: Host
    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False
    killed: bool = False
    stopped: bool = False
    cpu_seconds: float = 0.0
    stacks: str = ""

    def describe(self) -> str:
        """The run and its logs, for an assertion message."""
        how = f"exit {self.returncode}"
        how = "timed out" if self.timed_out else "stopped" if self.stopped else how
        text = (
            f"--- {self.host.hostname}: {how} after {self.seconds:.1f} s: {' '.join(self.argv)}\n"
            f"--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"
        )
        if self.stacks:
            text += f"\n--- stacks of its processes at the timeout\n{self.stacks}"
        return text


@dataclass
class _Proc:
    host: Host
    argv: list[str]
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path
    stacks_dir: Path
    started: float
    ended: float | None = None
    killed: bool = False
    cpu: float = 0.0

    def poll(self) -> int | None:
        """The exit code once the command ended (else None); reaps it with its CPU time
        (``Popen.poll`` would reap it without)."""
        if self.popen.returncode is None:
            try:
                pid, status, usage = os.wait4(self.popen.pid, os.WNOHANG)
            except ChildProcessError:  # reaped already
                return self.popen.poll()
            if pid == 0:
                return None
            self.popen.returncode = os.waitstatus_to_exitcode(status)
            self.cpu = usage.ru_utime + usage.ru_stime
        return self.popen.returncode


@dataclass
class Running:
    """Commands started on hosts; :meth:`wait` collects them (kills what outlives the timeout)."""

    hosts: Hosts
    procs: list[_Proc]
    timeout: float
    started: float = field(default_factory=time.monotonic)

    def _proc(self, host: int) -> _Proc:
        for p in self.procs:
            if p.host.index == host:
                return p
        raise ValueError(f"nothing was started on host {host}")

    def log(self, host: int) -> str:
        """Everything the command on host ``host`` wrote so far (stdout then stderr)."""
        p = self._proc(host)
        return p.out.read_text(errors="replace") + p.err.read_text(errors="replace")

    def wait_for(self, host: int, pattern: str, timeout: float) -> bool:
        """Poll the logs of host ``host``'s command until ``pattern`` (a regex) appears; False
        after ``timeout`` or when the command ended without it."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if rx.search(self.log(host)):
                return True
            if self._proc(host).poll() is not None:
                return bool(rx.search(self.log(host)))
            time.sleep(0.1)
        return False

    def kill_host(self, host: int) -> None:
        """SIGKILL every process on host ``host`` (the host dies; its network stays)."""
        self._proc(host).killed = True
        _kill_namespace_processes(self._proc(host).host.netns)

    def returncode(self, host: int) -> int | None:
        """The exit code of the command on host ``host`` (None while it runs)."""
        return self._proc(host).poll()

    def running(self, host: int) -> bool:
        """Whether the command on host ``host`` is still running."""
        return self._proc(host).poll() is None

    def wait(self, until: Callable[[Running], bool] | None = None) -> list[HostRun]:
        """Wait for every command until the run's timeout, or until ``until(self)`` (polled)
        says the rest need not be waited for; kill what still runs; the outcomes in host
        order (``returncode`` None for those: ``timed_out`` or ``stopped``). A command that
        ended before this call (e.g. while an earlier run of the same wave was waited for past
        this one's deadline) is collected, never reported as timed out."""
        deadline = self.started + self.timeout
        while True:  # polls at least once: a command may have ended before wait was called
            for p in self.procs:
                if p.ended is None and p.poll() is not None:
                    p.ended = time.monotonic()
            if all(p.ended is not None for p in self.procs):
                break
            if until is not None and until(self):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        cut = time.monotonic()
        stacks = {}
        if cut >= deadline:  # a hang: where each process of a command still running is
            for p in self.procs:
                if p.ended is None and p.poll() is None:
                    stacks[id(p)] = _dump_stacks(p.host.netns, p.stacks_dir)
        self.stop()
        return [
            HostRun(
                host=p.host,
                argv=p.argv,
                returncode=None if p.ended is None else p.popen.returncode,
                stdout=p.out.read_text(errors="replace"),
                stderr=p.err.read_text(errors="replace"),
                seconds=(p.ended or cut) - p.started,
                timed_out=p.ended is None and cut >= deadline,
                killed=p.killed,
                stopped=p.ended is None and cut < deadline,
                cpu_seconds=p.cpu,
                stacks=stacks.get(id(p), ""),
            )
            for p in self.procs
        ]

    def stop(self) -> None:
        """Kill every process still running on the hosts of this run."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)
            _kill_namespace_processes(p.host.netns)
            deadline = time.monotonic() + 5
            while p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)


class Hosts:
    """``n`` hosts on one private switch (see the module docstring). A context manager:
    everything is removed on exit, whatever happened; :meth:`close` may be called twice."""

    def __init__(self, n: int = 2) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n must be in [1, 200], got {n}")
        _COUNTER[0] += 1
        self.prefix = f"{_BASE}{_base36(os.getpid())}.{_COUNTER[0]}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = [
            Host(i, f"h{i}", f"{self.prefix}-h{i}", f"{DATA_NET}.{i + 1}", f"{MGMT_NET}.{i + 1}")
            for i in range(n)
        ]
        self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self._running: list[Running] = []
        self._made: list[str] = []
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        self._add_netns(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for h in self.hosts:
            self._add_netns(h.netns)
            port = f"p{h.index}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", h.netns)  # fmt: skip
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
            _ip("-n", h.netns, "link", "set", "eth0", "up")
            _ip("-n", h.netns, "link", "add", "mgmt0", "type", "veth", "peer", "name", "mgmt0p")
            _ip("-n", h.netns, "addr", "add", f"{h.mgmt_addr}/24", "dev", "mgmt0")
            _ip("-n", h.netns, "link", "set", "mgmt0", "up")
            _ip("-n", h.netns, "link", "set", "mgmt0p", "up")

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def close(self) -> None:
        """Kill every process on the hosts, delete the namespaces and the temporary files."""
        for r in self._running:
            with contextlib.suppress(Exception):
                r.stop()
        self._running.clear()
        for name in reversed(self._made):
            _delete_namespace(name)
        self._made.clear()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def hosts_file(self, i: int, resolve: str) -> Path:
        """The ``/etc/hosts`` host ``i`` sees under ``resolve`` (its own name first)."""
        if resolve not in RESOLVE:
            raise ValueError(f"resolve must be one of {RESOLVE}, got {resolve!r}")
        order = [self.hosts[i], *(h for h in self.hosts if h.index != i)]
        addr = {
            "data": lambda h: h.addr,
            "loopback": lambda h: "127.0.1.1",
            "mgmt": lambda h: h.mgmt_addr,
        }[resolve]
        lines = ["127.0.0.1 localhost", *(f"{addr(h)} {h.hostname}" for h in order)]
        path = self._tmp / f"hosts-{i}-{resolve}"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(
        self,
        commands: Sequence[Sequence[str] | None],
        *,
        env: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        resolve: str = "data",
        timeout: float = 60.0,
        cwd: _Cwd = None,
    ) -> Running:
        """Start ``commands[i]`` (an argv, or ``None`` for nothing) on host ``i``.

        ``env``: variables added to this process's environment (one mapping for all hosts or
        one per host; torchrun's and the network variables are never inherited). ``cwd``: one
        working directory for all or one per host. Logs go to files; :meth:`Running.wait`
        returns them.
        """
        if len(commands) > len(self.hosts):
            raise ValueError(f"{len(commands)} commands for {len(self.hosts)} hosts")
        envs = [env] * len(commands) if env is None or isinstance(env, Mapping) else list(env)
        cwds = (
            [cwd] * len(commands)
            if cwd is None or isinstance(cwd, (str, os.PathLike))
            else list(cwd)
        )
        procs = []
        run = Running(self, procs, timeout)
        self._running.append(run)
        try:
            for i, argv in enumerate(commands):
                if argv is None:
                    continue
                h = self.hosts[i]
                full = {k: v for k, v in os.environ.items() if k not in _SCRUB}
                full.update({"PYTHONUNBUFFERED": "1", **(envs[i] or {})})
                n = len(procs)
                stacks_dir = self._tmp / f"run{id(run)}-{n}.stacks"
                stacks_dir.mkdir()
                path = [str(_STACKS), *filter(None, [full.get("PYTHONPATH")])]
                full.update(PYTHONPATH=os.pathsep.join(path), DISTOPTIM_STACKS_DIR=str(stacks_dir))
                wrapper = [
                    "ip", "netns", "exec", h.netns, "unshare", "--uts", "--mount", "--", "sh",
                    "-c", 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"',
                    "sh", str(self.hosts_file(i, resolve)), h.hostname, *argv,
                ]  # fmt: skip
                out, err = self._tmp / f"run{id(run)}-{n}.out", self._tmp / f"run{id(run)}-{n}.err"
                with out.open("wb") as fo, err.open("wb") as fe:
                    popen = subprocess.Popen(
                        wrapper, stdout=fo, stderr=fe, env=full, cwd=cwds[i], start_new_session=True
                    )
                procs.append(_Proc(h, list(argv), popen, out, err, stacks_dir, time.monotonic()))
        except BaseException:
            run.stop()
            raise
        return run
