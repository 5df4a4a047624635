"""What the replicas of one torchft round agree on, riding on that round's own all-reduce.

Owns the replica words of a managed round (CrossShardOptimizer's step, DiLoCo's sync) and the
verdict every participant derives from them, the fault-tolerant counterpart of the sequence
guard (:mod:`distoptim.comm.guard`) with one more duty: proving that replicas which committed
and healed hold *bit-for-bit* the same synchronised state.

Words. Each member of the quorum's group (index ``r`` among its ``M`` members, healing ones
included: they say so, and their state is not judged) writes :class:`ReplicaWords` --
the operation, its step counter, the 48-bit fingerprint of its parameter list and options, the
parameter count, a 32-bit digest of the hyperparameters everyone must share, and the 64-bit
:func:`~distoptim.comm.checksum.state_checksum` of its synchronised state as the last commit
or heal left it (of the whole state, or of slice ``part`` of ``parts``: see
:mod:`distoptim.sync.replicated` for when a slice is enough) -- packed into :data:`ROW`
bytes, one byte per float32 element, into slots ``[r ROW, (r + 1) ROW)`` of a zero tensor.
One SUM all-reduce over the quorum's group gives every member the table of every member's
words; bytes are integers below 256, exact in float32. It rides with the round's payload
(launched after it, no extra round trip) -- except in the first round of a new membership,
where it goes *before* the payload: a joiner built with another model would otherwise reach
the bucket all-reduces with buckets of other sizes, which gloo answers by aborting every
process.

Verdict (the same on every participant, since every one reads the same table):

* every member it would heal from is in ``finish()`` while a healing member is in ``step()``
  (it joined as the run ends) -> that member raises
  :class:`~distoptim.ft.replica.NoPeersError` ("nothing left to join"); the others' final round
  does not commit and they end as usual;
* the operation or the step differs -> :class:`~distoptim.comm.guard.DesyncError` everywhere
  (replicas are not in the same round: a bug, never a fault);
* the parameter fingerprint differs -> the replicas in the minority raise
  :class:`~distoptim.comm.guard.ParameterMismatchError` (a replica group built with another
  model joined: it is refused by name before any commit; a healing member is judged on this
  alone); the others do not commit this round and go on without it;
* the members checked different slices of the state (``part``/``parts`` differ: they disagree
  on whether the last round was clean, which only a round none of them committed can cause)
  -> nobody commits this round, and the next one checks the whole state;
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
from distoptim.ft.replica import NoPeersError

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
    ("part", 1),
    ("parts", 1),
    ("void", 1),
    ("healing", 1),
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
    healing: bool = False  # this member receives a peer's state at the commit (stale state)
    part: int = 0  # state is the checksum of slice `part` of `parts` of the synchronised state
    parts: int = 1

    def describe(self) -> str:
        return (
            f"{self.kind.describe()} at step {self.step}, {self.params} parameters (plan "
            f"{self.plan:012x}), hyperparameters {self.hparams:08x}, state {self.state:016x}"
            + (f" (slice {self.part} of {self.parts})" if self.parts > 1 else "")
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
        if fields["void"] > 1 or fields["healing"] > 1:
            raise DesyncError(f"{owner}: member {r}'s words are invalid (flags)")
        kind = RoundKind(fields.pop("kind"))
        void, healing = bool(fields.pop("void")), bool(fields.pop("healing"))
        rows.append(ReplicaWords(kind=kind, void=void, healing=healing, **fields))
    return rows


@dataclass(frozen=True)
class AgreementVerdict:
    """The round stands (``ok``), or this replica is fine but the round must not commit."""

    ok: bool
    reason: str = ""


def _lines(table: Sequence[ReplicaWords]) -> str:
    return "\n".join(
        f"  member {r}: {'(healing) ' if w.healing else ''}{w.describe()}"
        for r, w in enumerate(table)
    )


def judge(everyone: Sequence[ReplicaWords], rank: int, owner: str) -> AgreementVerdict:
    """Member ``rank``'s verdict on a decoded table of every member's words (see the module).

    Healing members are judged on their parameter list only (their state is about to be
    replaced). Raises on the replicas that must stop; returns ``ok=False`` (do not commit, go
    on) on the others when some replica is refused.
    """
    judged = [r for r, w in enumerate(everyone) if not w.healing]
    if not judged:
        return AgreementVerdict(False, f"{owner}: every member of this round is healing")
    table = [everyone[r] for r in judged]
    late = [r for r, w in enumerate(everyone) if w.healing and w.kind is not RoundKind.FINISH]
    if late and all(w.kind is RoundKind.FINISH for w in table):
        # the members it would heal from end the run in this round: nothing is left to join
        # (their finish() carries no payload, so neither its size nor its step is a mismatch)
        message = (
            f"{owner}: member(s) {late} joined as the replicas they would heal from finish the "
            f"run (finish() at step {table[0].step}): there is nothing left to join:\n"
            + _lines(everyone)
        )
        if rank in late:
            raise NoPeersError(message)
        return AgreementVerdict(False, message)
    plans = Counter((w.plan, w.params) for w in table).most_common()
    strangers = [
        r for r, w in enumerate(everyone) if w.healing and (w.plan, w.params) != plans[0][0]
    ]
    if strangers and plans[0][1] > len(table) / 2:
        message = (
            f"{owner}: member(s) {strangers} joined with another parameter list or options "
            f"than the replicas they would heal from; refused before contributing:\n"
            + _lines(everyone)
        )
        if rank in strangers:
            raise ParameterMismatchError(message, [])
        return AgreementVerdict(False, message)
    if rank not in judged:  # a healing member takes the others' word for the rest
        return AgreementVerdict(True)
    rank = judged.index(rank)
    if len({(w.kind, w.step) for w in table}) > 1:
        raise DesyncError(
            f"{owner}: the replicas of this round are not at the same operation and step; "
            "nothing was applied:\n" + _lines(everyone),
            [],
        )
    for field, error, what in (
        ("plan", ParameterMismatchError, "parameter list or options"),
        ("hparams", DesyncError, "optimizer hyperparameters"),
        ("state", DesyncError, "synchronised state (a bitwise checksum)"),
    ):
        values = [getattr(w, field) for w in table]
        if field == "state" and len({(w.part, w.parts) for w in table}) > 1:
            return AgreementVerdict(
                False,
                f"{owner}: the members checked different slices of their state (they disagree "
                "on whether the last round was clean): the round is not committed, the next "
                "one checks the whole state:\n" + _lines(everyone),
            )
        if len(set(values)) == 1:
            continue
        counts = Counter(values).most_common()
        majority = counts[0][0] if counts[0][1] > len(values) / 2 else None
        odd = [r for r, v in enumerate(values) if v != majority]
        members = ", ".join(str(judged[r]) for r in odd)
        message = (
            f"{owner}: member{'s' if len(odd) > 1 else ''} {members} of this round "
            f"hold{'' if len(odd) > 1 else 's'} another {what} than "
            + ("the majority" if majority is not None else "each other (no majority)")
            + "; nothing was applied:\n"
            + _lines(everyone)
        )
        if rank in odd:
            raise error(message, [])
        return AgreementVerdict(False, message)
    void = [r for r, w in enumerate(everyone) if w.void]
    if void:
        return AgreementVerdict(
            False,
            f"{owner}: member(s) {void} received a peer's state after computing their "
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
