"""The collective sequence guard: what every reduction round carries so that ranks agree on it.

Owns :class:`DesyncError` (and its subclass :class:`ParameterMismatchError`), the words one
rank contributes to a round (:class:`GuardWords`), their encoding into the round's *trailer*
(:class:`GuardCodec`) and the verdict every rank derives from the decoded table
(:func:`check_round`). No communication happens here: the trailer rides in the last bucket of
the round's own all-reduce (see :mod:`distoptim.comm.bucket`), so the guard adds no collective.

Encoding. A round's trailer has ``group_size * CHUNKS`` elements; group rank ``r`` writes its
words, packed into ``CHUNKS`` bytes (chunks), one byte per element, into slots
``[r * CHUNKS, (r + 1) * CHUNKS)`` and zeros everywhere else. After the SUM all-reduce every
slot holds exactly one rank's chunk -- an all-gather carried by the sum -- so every rank
decodes the same table of every rank's words. Chunks are integers in ``[0, 255]``: exact in
every floating dtype a bucket or its wire can have (bfloat16 represents every integer up to
256), so compression cannot blur them. A trailer whose slots are not such integers is itself
proof that the ranks' collectives did not pair.

Verdict (the same on every rank, because every rank reads the same table):

* ranks disagree on the parameter fingerprint -> :class:`ParameterMismatchError`;
* ranks disagree on the round's kind (``step()``, ``apply_gradients``, ``finish()``,
  ``consolidate_state_dict()``, ...), or, with the sequence check on, on the step counter or
  the number of backward passes since the last ``step()`` -> :class:`DesyncError`, naming
  every rank's words.
  A rank whose pass counter saw no pass although its gradients changed since its last round
  (*uncounted*: its backward reached none of the watched parameters) had at least one pass: it
  agrees with any count >= 1;
* with the sequence check on, ranks disagree on the digest of their optimizers'
  hyperparameters (every param group's learning rate, momentum, betas, weight decay, ...) ->
  :class:`DesyncError` naming which ranks differ: their replicas would drift apart;
* otherwise the round stands. If any rank set ``edited`` (it changed ``.grad`` after backward
  had launched its buckets) or ``replanned`` (its parameter list changed since the plan in
  use), every rank reduces again, each with its current parameter list -- the same on every
  rank, since the fingerprints agree. Two more flags only inform: ``local_edit`` (this rank
  changed ``.grad`` between the end of backward and the round: the edit acted on its local
  gradient) and ``foreign`` (something changed ``.grad`` during backward, after autograd had
  accumulated it -- a ``DistributedDataParallel`` reducer); the verdict names the ranks that set
  them, so every rank can warn alike.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "CHUNKS",
    "DesyncError",
    "GuardCodec",
    "GuardWords",
    "ParameterMismatchError",
    "RoundKind",
    "Verdict",
    "check_round",
    "plan_word",
    "table_lines",
]


class DesyncError(RuntimeError):
    """Ranks of one group stopped following the same sequence of reduction rounds.

    Raised on every rank of the group by the round in which the divergence shows (or, when a
    peer left the group, on the ranks still waiting for it). ``table`` holds every rank's
    :class:`GuardWords` for that round when they were exchanged (empty otherwise).
    """

    def __init__(self, message: str, table: Sequence[GuardWords] = ()) -> None:
        super().__init__(message)
        self.table = list(table)


class ParameterMismatchError(DesyncError):
    """Ranks of one (sub)group disagree on the parameters or the communication options."""


class RoundKind(enum.IntEnum):
    """Which operation a reduction round belongs to (ranks must agree on it)."""

    STEP = 1  # step(): the reduction of .grad
    REPAIR = 2  # the same operation's second round (.grad edited after launch, or a new plan)
    PAIRS = 3  # apply_gradients: the given (grad, var) pairs
    FINISH = 4  # finish(): this rank takes no more steps
    ABANDON = 5  # a round launched in backward, closed by remove_hooks() without step()
    SYNC = 6  # synchronize(): the reduction of .grad, applied by the next step()
    STATE = 7  # consolidate_state_dict() gathering sharded state (a collective)
    SLOTS = 8  # get_slot() / get_slot_names() / variables() gathering sharded state
    CHECKPOINT = 9  # save_sharded() / load_sharded(): DCP's collectives (a per-rank checkpoint)

    def describe(self) -> str:
        return _KIND_TEXT[self]

    @property
    def collective_call(self) -> bool:
        """A call every rank must make that is not a step: a peer elsewhere is a caller's bug."""
        return self in (RoundKind.FINISH, RoundKind.STATE, RoundKind.SLOTS, RoundKind.CHECKPOINT)


_KIND_VALUES = frozenset(k.value for k in RoundKind)
_KIND_TEXT = {
    RoundKind.STEP: "step()",
    RoundKind.REPAIR: "the repeat reduction of a step()",
    RoundKind.PAIRS: "apply_gradients()",
    RoundKind.FINISH: "finish()",
    RoundKind.ABANDON: "remove_hooks() after a backward() without step()",
    RoundKind.SYNC: "synchronize()",
    RoundKind.STATE: "consolidate_state_dict()",
    RoundKind.SLOTS: "get_slot()/get_slot_names()/variables()",
    RoundKind.CHECKPOINT: "save_sharded()/load_sharded()",
}

# (field, bits): the words in trailer order, packed little-endian into CHUNKS bytes per rank
_FIELDS: tuple[tuple[str, int], ...] = (
    ("kind", 8),
    ("step", 40),
    ("passes", 16),
    ("plan", 48),
    ("params", 24),
    ("flags", 8),
    ("hyper", 32),
)
_FLAG_BITS = ("edited", "replanned", "uncounted", "local_edit", "foreign")
_CHUNK_BITS = 8
CHUNKS = sum(bits for _, bits in _FIELDS) // _CHUNK_BITS
"""Trailer elements per rank (one byte of the packed words each)."""
_LAYOUT = tuple(
    (name, bits, sum(b for _, b in _FIELDS[:i]), (1 << bits) - 1)
    for i, (name, bits) in enumerate(_FIELDS)
)


def plan_word(digest: bytes) -> int:
    """The 48-bit plan fingerprint a round carries, from a parameter-list digest."""
    return int.from_bytes(digest[:6], "little")


@dataclass(frozen=True)
class GuardWords:
    """One rank's contribution to a round.

    ``step``: the optimizer's ``iterations``; ``passes``: backward passes since the last
    ``step()`` (both 0 with the sequence check off); ``plan``: 48-bit fingerprint of this
    rank's trainable parameters and options; ``params``: how many there are; ``hyper``: 32-bit
    digest of the optimizer's hyperparameters (0 with the sequence check off); ``edited``: this
    rank changed ``.grad`` after backward had launched its buckets; ``replanned``: its
    parameter list changed since the plan the round used; ``uncounted``: no pass was counted
    (``passes == 0``) but its gradients changed since its last round -- at least one pass that
    the counter did not see; ``local_edit``: ``.grad`` changed between the end of backward and
    this round; ``foreign``: ``.grad`` changed during backward after autograd accumulated it.
    Values too wide for their field saturate (``passes`` at 65535, ...): equal values stay equal.
    """

    kind: RoundKind
    step: int
    passes: int
    plan: int
    params: int
    edited: bool = False
    replanned: bool = False
    hyper: int = 0
    uncounted: bool = False
    local_edit: bool = False
    foreign: bool = False

    @property
    def flags(self) -> int:
        return sum(int(getattr(self, name)) << bit for bit, name in enumerate(_FLAG_BITS))

    def describe(self) -> str:
        passes = f"{self.passes} backward pass{'es' if self.passes != 1 else ''}"
        if self.uncounted:
            passes = "backward passes the counter did not see (gradients changed)"
        return (
            f"{self.kind.describe()} at step {self.step}, {passes} since its last step(), "
            f"{self.params} trainable parameters (plan {self.plan:012x}), "
            f"hyperparameters {self.hyper:08x}"
            + (", .grad edited after launch" if self.edited else "")
            + (", parameter list changed" if self.replanned else "")
        )


class GuardCodec:
    """Writes this rank's words into a trailer and reads every rank's words back.

    ``group_size``: ranks in the group; ``group_rank``: this rank's index in it; ``ranks``:
    the global rank of each group rank (for messages); ``owner``: the optimizer errors name.
    """

    def __init__(
        self,
        group_size: int,
        group_rank: int,
        ranks: Sequence[int],
        owner: str = "CrossShardOptimizer",
    ) -> None:
        if not 0 <= group_rank < group_size or len(ranks) != group_size:
            raise ValueError(
                f"group_rank {group_rank} and ranks {list(ranks)} do not fit a group of "
                f"{group_size}"
            )
        self.group_size = group_size
        self.group_rank = group_rank
        self.ranks = list(ranks)
        self.owner = owner

    @property
    def size(self) -> int:
        """Trailer elements: ``CHUNKS`` per rank of the group."""
        return self.group_size * CHUNKS

    def write(self, trailer: torch.Tensor, words: GuardWords) -> None:
        """Fill ``trailer``: this rank's chunks in its own slots, zeros everywhere else."""
        packed = 0
        for name, _, shift, mask in _LAYOUT:
            value = int(getattr(words, name))
            if value < 0:
                raise ValueError(f"guard word {name} must be >= 0, got {value}")
            packed |= min(value, mask) << shift
        start = self.group_rank * CHUNKS
        raw = bytearray(self.size)
        raw[start : start + CHUNKS] = packed.to_bytes(CHUNKS, "little")
        trailer.copy_(torch.frombuffer(raw, dtype=torch.uint8))

    def read(self, trailer: torch.Tensor) -> list[GuardWords]:
        """Every rank's words, in group-rank order, from a reduced ``trailer``."""
        values = (trailer.real if trailer.is_complex() else trailer).tolist()
        ints = [int(v) for v in values]
        try:
            if len(ints) != self.size or ints != values:
                raise ValueError("not whole chunks")
            raw = bytes(ints)  # ValueError outside [0, 255]
        except ValueError:
            raise DesyncError(
                f"{self.owner}: the sequence words of this round are not what any rank "
                "sent (not whole chunks): the ranks' collectives did not pair -- some rank "
                "issued a different collective in this position"
            ) from None
        table = []
        for r in range(self.group_size):
            packed = int.from_bytes(raw[r * CHUNKS : (r + 1) * CHUNKS], "little")
            f = {name: (packed >> shift) & mask for name, _, shift, mask in _LAYOUT}
            kind, flags = f["kind"], f["flags"]
            if kind not in _KIND_VALUES or flags >> len(_FLAG_BITS):
                raise DesyncError(
                    f"{self.owner}: rank {self.ranks[r]}'s sequence words are not valid "
                    f"(kind {kind}, flags {flags}): the ranks' collectives did not pair"
                )
            bits = {name: bool(flags >> bit & 1) for bit, name in enumerate(_FLAG_BITS)}
            table.append(
                GuardWords(
                    RoundKind(kind),
                    step=f["step"],
                    passes=f["passes"],
                    plan=f["plan"],
                    params=f["params"],
                    hyper=f["hyper"],
                    **bits,
                )
            )
        return table


@dataclass(frozen=True)
class Verdict:
    """What every rank does after a round that stands: use it, or reduce again."""

    edited: bool  # some rank changed .grad after backward launched its buckets
    replanned: bool  # some rank's parameter list changed since the plan the round used
    table: tuple[GuardWords, ...] = field(default=(), compare=False)  # every rank's words
    local_edits: tuple[int, ...] = ()  # global ranks that edited .grad after backward ended
    foreign: tuple[int, ...] = ()  # global ranks whose .grad changed during backward

    @property
    def repeat(self) -> bool:
        """Every rank reduces again, with its current parameter list."""
        return self.edited or self.replanned


def check_round(
    table: Sequence[GuardWords],
    ranks: Sequence[int],
    owner: str = "CrossShardOptimizer",
    explain_hyperparameters: Callable[[], str] | None = None,
) -> Verdict:
    """The round's verdict from every rank's words, or the error every rank raises.

    ``ranks``: the global rank of each row; ``owner``: the optimizer errors name;
    ``explain_hyperparameters()``: what differs, in words, appended to the error when the
    hyperparameter digests differ (every rank calls it there, so it may be a collective).
    Deterministic in ``table``, so every rank of the group reaches the same verdict (or raises
    the same error) without another message.
    """
    first = table[0]
    if any((w.plan, w.params) != (first.plan, first.params) for w in table):
        raise ParameterMismatchError(
            f"{owner}: ranks disagree on the parameter list or the communication "
            "options, so their gradient buckets would not match:\n"
            + table_lines(table, ranks)
            + "\nEvery rank must have the same trainable parameters (shapes, dtypes, "
            "requires_grad, in the same order): a requires_grad_() change or add_param_group() "
            "on some ranks only is a mismatch.",
            table,
        )
    sequence = [(w.kind, w.step) for w in table]
    if any(s != sequence[0] for s in sequence) or not _passes_agree(table):
        raise DesyncError(
            f"{owner}: ranks are out of step -- their reduction rounds do not "
            f"belong together ({_diagnosis(table, ranks)}); no update was applied:\n"
            + table_lines(table, ranks)
            + "\nEvery rank must call step() the same number of times, after the same number "
            "of backward() calls (backward_passes_per_step of them), and every collective call "
            "(finish(); with shard_optimizer_state also consolidate_state_dict(), get_slot(), "
            "get_slot_names(), variables()) on every rank.",
            table,
        )
    if any(w.hyper != first.hyper for w in table):
        groups: dict[int, list[int]] = {}
        for r, w in zip(ranks, table):
            groups.setdefault(w.hyper, []).append(r)
        sides = " / ".join(f"ranks {g}" for g in groups.values())
        raise DesyncError(
            f"{owner}: ranks' optimizers have different hyperparameters ({sides} agree among "
            "themselves) -- a learning rate, momentum, betas, weight decay, eps, ... of some "
            "param group differs, e.g. an LR scheduler stepped on some ranks only (`if rank "
            "== 0: scheduler.step()`); the replicas would drift apart, so no update was "
            "applied:\n"
            + table_lines(table, ranks)
            + "\nEvery rank must run the same optimizer with the same hyperparameters: step "
            "LR schedulers (and change param groups) on every rank."
            + (f"\n{explain_hyperparameters()}" if explain_hyperparameters is not None else ""),
            table,
        )
    return Verdict(
        edited=any(w.edited for w in table),
        replanned=any(w.replanned for w in table),
        table=tuple(table),
        local_edits=tuple(r for r, w in zip(ranks, table) if w.local_edit),
        foreign=tuple(r for r, w in zip(ranks, table) if w.foreign),
    )


def _passes_agree(table: Sequence[GuardWords]) -> bool:
    """Counted passes are equal; an *uncounted* rank (>= 1 pass unseen) agrees with >= 1."""
    known = {w.passes for w in table if not w.uncounted}
    if len(known) > 1:
        return False
    return not (known == {0} and any(w.uncounted for w in table))


def table_lines(table: Sequence[GuardWords], ranks: Sequence[int]) -> str:
    """One line per rank of a round's words, for error messages (``ranks``: global ranks)."""
    return "\n".join(f"  rank {r}: {w.describe()}" for r, w in zip(ranks, table))


def _diagnosis(table: Sequence[GuardWords], ranks: Sequence[int]) -> str:
    kinds = {w.kind for w in table}
    if len(kinds) > 1:
        calls = sorted(k for k in kinds if k.collective_call or k is RoundKind.SYNC)
        if calls:
            call = calls[-1]
            callers = [r for r, w in zip(ranks, table) if w.kind is call]
            others = " / ".join(sorted({w.kind.describe() for w in table if w.kind is not call}))
            said = f"{call.describe()} called on rank(s) {callers} only while the others are in "
            if call is RoundKind.FINISH:
                return (
                    f"{said}{others}: a step() skipped or added, or finish() called on some "
                    "ranks only -- every rank must call it"
                )
            if call is RoundKind.SYNC:
                return f"{said}{others}: every rank must call it, or none"
            return (
                f"{said}{others}: with shard_optimizer_state it gathers the state from every "
                "rank -- every rank must call it (then save on one)"
            )
        return "ranks are in different operations"
    if len({w.step for w in table}) > 1:
        return (
            "step counters differ: a step() skipped or added on some rank, or a checkpoint "
            "loaded on some ranks only"
        )
    return (
        "backward passes since the last step() differ: an extra backward(), or a step() "
        "skipped or added on some rank (with overlap=False, possibly also a backward pass "
        "that reached none of the few parameters the pass counter watches -- a branch of the "
        "model used on some ranks only -- among several passes per step; overlap=True counts "
        "every parameter)"
    )
