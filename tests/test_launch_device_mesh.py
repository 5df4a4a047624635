"""distoptim.launch with DeviceMesh/DTensor: the groups die at teardown (no gloo thread lives on).

DTensor's caches keep every DeviceMesh alive for the life of the process, and a mesh holds its
process groups (``_pg_registry``, torch 2.13), so without :func:`_release_device_meshes` the
groups outlived ``destroy_process_group`` and their gloo threads ran into interpreter shutdown,
where one still releasing a rank's last collective aborted the process now and then
("terminate called without an active exception"). These tests pin the private attribute and
check the outcome: after ``_with_process_group`` returns, no gloo thread is left.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from distoptim.launch import _with_process_group, run_processes, torchrun_env

pytestmark = pytest.mark.timeout(120)


def _gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(n for n in names if "gloo" in n)


def _dtensor_work(rank: int, world_size: int) -> dict:
    """A 2-D mesh (sub-groups on both dimensions) and DTensor ops that fill DTensor's caches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    w = distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, (Replicate(), Shard(0)))
    total = (w @ w.T).redistribute(mesh, (Replicate(), Replicate())).to_local().sum()
    registry = mesh._pg_registry  # the attribute _release_device_meshes clears
    return {
        "total": float(total),
        "registry": isinstance(registry, dict) and len(registry) >= 2,
        "threads_during": len(_gloo_threads()),
    }


def _teardown_then_threads(fn) -> dict:
    out = _with_process_group(fn, "gloo", 60.0, ())
    out["threads_after"] = _gloo_threads()
    out["initialized_after"] = dist.is_initialized()
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")
def test_device_mesh_groups_do_not_outlive_teardown():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    outcomes = run_processes(
        _teardown_then_threads,
        [(_dtensor_work,)] * 2,
        envs=[torchrun_env(r, 2, store.port) for r in range(2)],
        timeout=100,
        num_threads=1,
    )
    expected = float((torch.arange(16.0).reshape(4, 4) @ torch.arange(16.0).reshape(4, 4).T).sum())
    for o in outcomes:
        v = o.value
        assert v["total"] == expected
        assert v["registry"], "DeviceMesh no longer keeps its groups in _pg_registry"
        assert v["threads_during"] > 0, "gloo threads have other names now: the check is blind"
        assert not v["initialized_after"]
        assert v["threads_after"] == [], f"gloo threads left after teardown: {v['threads_after']}"
