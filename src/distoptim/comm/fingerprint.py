"""Parameter-list agreement: a cheap check that turns a would-be hang into a clear error.

Bucketed all-reduces pair up only if every rank built the same buckets. If one rank's model has
an extra layer, another dtype or another order, its buckets differ and the collectives would
mismatch (wrong sums, a wait until the timeout, or -- with gloo, when sizes differ -- the
receiving process aborted). Before the first gradient collective every rank therefore
all-gathers a fixed-size digest -- BLAKE2b over the ordered shapes, dtypes and
``requires_grad`` flags plus the communication options -- and the parameter count. The
message has the same size on every rank, so the check itself cannot hang on a mismatch; every
rank sees the same gathered table and all of them raise together. Later changes of the
parameter list are agreed round by round through the sequence words
(:mod:`distoptim.comm.guard`), which carry a 48-bit prefix of the same digest;
:class:`ParameterMismatchError` is defined there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from distoptim.comm.guard import ParameterMismatchError
from distoptim.local_shards import is_dtensor, local_view

__all__ = ["MESSAGE_BYTES", "ParameterMismatchError", "check_agreement", "digest"]

_WORDS = 4  # 32-byte digest as four int64 words
MESSAGE_BYTES = 8 * (1 + _WORDS)
"""Bytes of one rank's message in :func:`check_agreement`: the count and the digest words."""


def digest(params: Sequence[torch.Tensor], options: Mapping[str, object]) -> bytes:
    """32 bytes that differ when the ordered shapes/dtypes/requires_grad or ``options`` do.

    A ``DTensor``'s shape is its global shape and the shape of this process's local piece (what
    the buckets hold): counterparts laid out differently (FSDP2 in one replica group, tensor
    parallelism in another) differ. A plain tensor's digest is unchanged."""
    h = hashlib.blake2b(digest_size=8 * _WORDS)
    for p in params:
        shape = f"{tuple(p.shape)}"
        if is_dtensor(p):
            shape += f"/{tuple(local_view(p).shape)}"
        h.update(f"{shape}|{p.dtype}|{int(p.requires_grad)};".encode())
    h.update(repr(sorted((k, repr(v)) for k, v in options.items())).encode())
    return h.digest()


def check_agreement(
    params: Sequence[torch.Tensor],
    options: Mapping[str, object],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """All-gather ``(count, digest)`` over ``group``; raise :class:`ParameterMismatchError`.

    One collective (:data:`MESSAGE_BYTES` per rank; the caller accounts it). ``device`` is
    where the small message lives (CPU for gloo, the current CUDA device for NCCL).
    """
    words = torch.frombuffer(bytearray(digest(params, options)), dtype=torch.int64)
    mine = torch.cat([torch.tensor([len(params)], dtype=torch.int64), words]).to(device)
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(gathered, mine, group=group)
    table = [t.cpu() for t in gathered]
    if any(not torch.equal(t, table[0]) for t in table[1:]):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
        lines = [
            f"  rank {r}: {int(t[0])} parameters, fingerprint {_hex(t[1:])}"
            for r, t in zip(ranks, table)
        ]
        raise ParameterMismatchError(
            "CrossShardOptimizer: ranks disagree on the parameter list or the communication "
            "options, so their gradient buckets would not match:\n"
            + "\n".join(lines)
            + "\nEvery rank must build the same model and optimizer (same parameters, shapes, "
            "dtypes and requires_grad, in the same order) with the same reduction, "
            "bucket_cap_mb, compression, overlap and backward_passes_per_step."
        )


def _hex(words: torch.Tensor) -> str:
    return words.numpy().tobytes().hex()[:16]
