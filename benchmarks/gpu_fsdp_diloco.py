"""Four CUDA devices: DiLoCo across 2 replica groups of 2 FSDP2 processes each, on NCCL.

``examples/fsdp_diloco_torchrun.py --device cuda`` as a user runs it: a lighthouse, and one
``torchrun --nproc-per-node 2`` per replica group, each group on its own two devices
(``CUDA_VISIBLE_DEVICES``). Inside a group FSDP2 shards the model over its two processes
(NCCL); across the groups DiLoCo averages each process's shards with its counterpart's through
its torchft manager (torchft's ``ProcessGroupNCCL``). Every process prints the checksum of the
whole model at the end: all four must be equal, bit for bit. Recorded per process: steps,
syncs, bytes sent across the groups, the full-data loss before and after, the seconds of its
training loop and the ms per step.

NCCL places no two ranks of one communicator on one device, so a real run needs 4 devices
(and torchft); with fewer devices, none, or no torchft it prints why and exits 0, writing
``{"skipped": ...}``. ``--quick`` runs
the same on the CPU (``--device cpu``: gloo in both places, a few steps): the driver, the
example and the check of every rank, without a GPU.

    python benchmarks/gpu_fsdp_diloco.py            # 4 GPUs; benchmarks/gpu.sh runs it
    python benchmarks/gpu_fsdp_diloco.py --quick    # the CPU smoke run

Writes ``benchmarks/results/gpu_fsdp_diloco.json`` (``--out``).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from _common import Bench, machine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fsdp_diloco_torchrun.py"
GROUPS, PER_GROUP = 2, 2
QUICK = {"device": "cpu", "steps": 20, "sync_every": 5, "width": 64}
DONE = re.compile(
    r"\[replica (\d) rank (\d)\] done at step (\d+), (\d+) syncs, (\d+) bytes sent, "
    r"full-data loss (\S+) -> (\S+) in (\S+) s: model checksum ([0-9a-f]{16})"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _why_not(device: str) -> str | None:
    """Why a run on ``device`` cannot happen here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("torchft") is None:
        return (
            "benchmarks/gpu_fsdp_diloco.py: torchft is not installed (pip install "
            '"distoptim[ft]"); nothing measured'
        )
    if device == "cpu":
        return None
    if not torch.cuda.is_available():
        return (
            "benchmarks/gpu_fsdp_diloco.py: no CUDA device (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda}); nothing measured"
        )
    have = torch.cuda.device_count()
    if have < GROUPS * PER_GROUP:
        return (
            f"benchmarks/gpu_fsdp_diloco.py: {GROUPS} groups x {PER_GROUP} processes need "
            f"{GROUPS * PER_GROUP} CUDA devices, one per process (NCCL places no two ranks of "
            f"one communicator on one device); found {have}; nothing measured"
        )
    return None


def _group(replica: int, lighthouse: str, args: Any, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if args.device == "cuda":  # this group's own two devices
        first = replica * PER_GROUP
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(PER_GROUP))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
        "--master-port", str(_free_port()), "--nproc-per-node", str(PER_GROUP), str(EXAMPLE),
        "--lighthouse", lighthouse, "--replica-id", str(replica), "--replicas", str(GROUPS),
        "--steps", str(args.steps), "--sync-every", str(args.sync_every),
        "--width", str(args.width), "--device", args.device,
    ]  # fmt: skip
    with open(log, "w") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,  # torchrun's agent and workers: killed together below
        )  # fmt: skip


def _run(args: Any, workdir: Path) -> dict[str, Any]:
    from distoptim.ft.lighthouse import Lighthouse

    logs = [workdir / f"group{g}.log" for g in range(GROUPS)]
    with Lighthouse(min_replicas=GROUPS, join_timeout=30) as lighthouse:
        groups = [_group(g, lighthouse.address, args, logs[g]) for g in range(GROUPS)]
        try:
            codes = [p.wait(timeout=args.time_limit) for p in groups]
        finally:
            for p in groups:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=30)
    text = [log.read_text() for log in logs]
    ranks = [
        {
            "replica": int(m[1]), "rank": int(m[2]), "steps": int(m[3]), "syncs": int(m[4]),
            "bytes_sent": int(m[5]), "loss_before": float(m[6]), "loss_after": float(m[7]),
            "seconds": float(m[8]), "checksum": m[9],
        }
        for out in text for m in DONE.finditer(out)
    ]  # fmt: skip
    for r in ranks:
        r["step_ms"] = 1000 * r["seconds"] / max(r["steps"], 1)
    return {
        "exit_codes": codes,
        "ranks": sorted(ranks, key=lambda r: (r["replica"], r["rank"])),
        "every_rank_reported": len(ranks) == GROUPS * PER_GROUP,
        "one_model": len(ranks) == GROUPS * PER_GROUP and len({r["checksum"] for r in ranks}) == 1,
        "step_ms_median": statistics.median(r["step_ms"] for r in ranks) if ranks else None,
        "log_tails": [t[-2000:] for t in text] if not all(c == 0 for c in codes) else [],
    }


def main(argv: list[str] | None = None) -> int:
    bench = Bench(
        __file__, __doc__, quick="a smoke run on the CPU (gloo), a few steps", quick_defaults=QUICK
    )
    parser = bench.parser
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument("--width", type=int, default=4096, help="the hidden layer's width")
    parser.add_argument("--time-limit", type=float, default=240.0, help="seconds for the run")
    args = bench.parse(argv)
    why = _why_not(args.device)
    if why is not None:
        print(why)
        bench.save({"skipped": why}, indent=2)
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu-fsdp-diloco-") as workdir:
        result = _run(args, Path(workdir))
    result["machine"] = machine(
        device=args.device, devices=torch.cuda.device_count() if args.device == "cuda" else 0
    )
    result["config"] = {
        "groups": GROUPS, "per_group": PER_GROUP, "steps": args.steps,
        "sync_every": args.sync_every, "width": args.width, "device": args.device,
        "backend": "nccl" if args.device == "cuda" else "gloo",
    }  # fmt: skip
    for r in result["ranks"]:
        print(
            f"replica {r['replica']} rank {r['rank']}: {r['steps']} steps, {r['syncs']} syncs, "
            f"{r['bytes_sent']} bytes sent, loss {r['loss_before']:.4f} -> "
            f"{r['loss_after']:.4f}, {r['step_ms']:.2f} ms/step, checksum {r['checksum']}"
        )
    print(
        f"every rank reported: {result['every_rank_reported']}; one model on every rank: "
        f"{result['one_model']}"
    )
    bench.save(result, indent=2)
    return 0 if result["one_model"] and all(c == 0 for c in result["exit_codes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
