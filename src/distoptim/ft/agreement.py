"""What the replicas of one torchft round agree on, riding on that round's own all-reduce.

Owns the replica words of a managed round (CrossShardOptimizer's step, DiLoCo's sync) and the
verdict every participant derives from them, the fault-tolerant counterpart of the sequence
guard (:mod:`distoptim.comm.guard`) with one more duty: proving that replicas which committed
and healed hold *bit-for-bit* the same synchronised state.

Words. Each participant of the quorum (index ``r`` among ``P`` participants; a replica that
is healing this round contributes nothing and has no slot) writes :class:`ReplicaWords` --
the operation, its step counter, the 48-bit fingerprint of its parameter list and options, the
parameter count, a 32-bit digest of the hyperparameters everyone must share, and the 64-bit
:func:`~distoptim.comm.checksum.state_checksum` of its synchronised state as the last commit
or heal left it -- packed into :data:`ROW` bytes, one byte per float32 element, into slots
``[r ROW, (r + 1) ROW)`` of a zero tensor. One SUM all-reduce through the manager (launched
with the round's payload, so it adds no round trip) gives every participant the table of every
participant's words; bytes are integers below 256, exact in float32.

Verdict (the same on every participant, since every one reads the same table):

* the operation or the step differs -> :class:`~distoptim.comm.guard.DesyncError` everywhere
  (replicas are not in the same round: a bug, never a fault);
* the parameter fingerprint differs -> the replicas in the minority raise
  :class:`~distoptim.comm.guard.ParameterMismatchError` (a replica group built with another
  model joined: it is refused by name before any commit); the others do not commit this
  round and go on without it;
* the state checksum or the hyperparameter digest differs -> the same, as
  :class:`~distoptim.comm.guard.DesyncError`: the replicas whose state differs from the
  majority's raise, naming themselves and the majority; with no strict majority every
  participant raises. Nothing drifts silently;
* some participant marked its contribution *void* (with a synchronous-quorum manager it
  received a peer's state after it had computed this round's gradient) -> nobody commits this
  round; the next round is whole again.

Only the failure of a collective (a peer died) is not judged here: torchft records it and the
round is not committed; the table is then ignored.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from distoptim.comm.guard import DesyncError, ParameterMismatchError, RoundKind

__all__ = [
    "ROW",
    "AgreementVerdict",
    "ReplicaWords",
    "decode",
    "encode",
    "hparams_digest",
    "judge",
]

# (field, bytes), little-endian, in slot order
_FIELDS: tuple[tuple[str, int], ...] = (
    ("present", 1),  # always 1: tells an empty slot from a written one
    ("kind", 1),
    ("step", 5),
    ("plan", 6),
    ("params", 3),
    ("hparams", 4),
    ("state", 8),
    ("void", 1),
)
ROW = sum(n for _, n in _FIELDS)
"""Bytes (float32 elements) of one participant's slot."""


@dataclass(frozen=True)
class ReplicaWords:
    """One participant's words (see the module docstring)."""

    kind: RoundKind
    step: int
    plan: int
    params: int
    hparams: int
    state: int
    void: bool = False  # this participant's contribution is not valid (see judge)

    def describe(self) -> str:
        return (
            f"{self.kind.describe()} at step {self.step}, {self.params} parameters (plan "
            f"{self.plan:012x}), hyperparameters {self.hparams:08x}, state {self.state:016x}"
            + (", contribution void" if self.void else "")
        )


def encode(words: ReplicaWords, rank: int, participants: int) -> torch.Tensor:
    """A float32 tensor of ``participants * ROW`` zeros with ``words`` in slot ``rank``."""
    raw = bytearray(participants * ROW)
    at = rank * ROW
    for name, size in _FIELDS:
        value = 1 if name == "present" else int(getattr(words, name))
        value = min(max(value, 0), (1 << (8 * size)) - 1)  # saturate: equal stays equal
        raw[at : at + size] = value.to_bytes(size, "little")
        at += size
    return torch.tensor(list(raw), dtype=torch.float32)


def decode(table: torch.Tensor, participants: int, owner: str) -> list[ReplicaWords]:
    """Every participant's words from a reduced table; DesyncError if it is not one."""
    values = table.tolist()
    ints = [int(v) for v in values]
    if len(ints) != participants * ROW or ints != values or not all(0 <= v < 256 for v in ints):
        raise DesyncError(
            f"{owner}: the replicas' words of this round are not what any replica sent: the "
            "replicas' collectives did not pair"
        )
    rows = []
    for r in range(participants):
        raw = bytes(ints[r * ROW : (r + 1) * ROW])
        fields, at = {}, 0
        for name, size in _FIELDS:
            fields[name] = int.from_bytes(raw[at : at + size], "little")
            at += size
        if fields.pop("present") != 1 or fields["kind"] not in {k.value for k in RoundKind}:
            raise DesyncError(
                f"{owner}: participant {r}'s words are missing or invalid: the replicas' "
                "collectives did not pair"
            )
        if fields["void"] > 1:
            raise DesyncError(f"{owner}: participant {r}'s words are invalid (void flag)")
        kind = RoundKind(fields.pop("kind"))
        void = bool(fields.pop("void"))
        rows.append(ReplicaWords(kind=kind, void=void, **fields))
    return rows


@dataclass(frozen=True)
class AgreementVerdict:
    """The round stands (``ok``), or this replica is fine but the round must not commit."""

    ok: bool
    reason: str = ""


def _lines(table: Sequence[ReplicaWords]) -> str:
    return "\n".join(f"  participant {r}: {w.describe()}" for r, w in enumerate(table))


def judge(table: Sequence[ReplicaWords], rank: int, owner: str) -> AgreementVerdict:
    """This participant's verdict on a decoded ``table`` (see the module docstring).

    Raises on the replicas that must stop; returns ``ok=False`` (do not commit, go on) on the
    others when some replica is refused.
    """
    if len({(w.kind, w.step) for w in table}) > 1:
        raise DesyncError(
            f"{owner}: the replicas of this round are not at the same operation and step; "
            "nothing was applied:\n" + _lines(table),
            [],
        )
    for field, error, what in (
        ("plan", ParameterMismatchError, "parameter list or options"),
        ("hparams", DesyncError, "optimizer hyperparameters"),
        ("state", DesyncError, "synchronised state (a bitwise checksum)"),
    ):
        values = [getattr(w, field) for w in table]
        if len(set(values)) == 1:
            continue
        counts = Counter(values).most_common()
        majority = counts[0][0] if counts[0][1] > len(values) / 2 else None
        odd = [r for r, v in enumerate(values) if v != majority]
        message = (
            f"{owner}: replica {'participants ' if len(odd) > 1 else 'participant '}"
            f"{', '.join(map(str, odd))} of this round hold{'' if len(odd) > 1 else 's'} "
            f"another {what} than "
            + ("the majority" if majority is not None else "each other (no majority)")
            + "; nothing was applied:\n"
            + _lines(table)
        )
        if rank in odd:
            raise error(message, [])
        return AgreementVerdict(False, message)
    void = [r for r, w in enumerate(table) if w.void]
    if void:
        return AgreementVerdict(
            False,
            f"{owner}: participant(s) {void} received a peer's state after computing their "
            "gradient (a quorum started in step() healed them): the round is not committed",
        )
    return AgreementVerdict(True)


def hparams_digest(groups: Sequence[dict]) -> int:
    """A 32-bit digest of every param group's hyperparameters (everything but ``params``).

    Tensors count by value; the order of groups and keys is part of it.
    """
    h = 0
    for g in groups:
        items = []
        for key in sorted(k for k in g if k != "params"):
            value = g[key]
            if isinstance(value, torch.Tensor):
                value = tuple(value.detach().cpu().reshape(-1).tolist())
            items.append(f"{key}={value!r}")
        h = zlib.crc32(";".join(items).encode(), h)
    return h
