"""The sync header: what every replica must agree on before a sync's payload collectives.

Owns the small fixed-size all-gather (over the replicas'
:class:`~distoptim.comm.channel.Channel`) that precedes every collective of a sync whose size
depends on the fragment (the pseudo-gradient mean, or the second phase of a quantized mean),
and the verdict every replica derives from it. Each replica sends one :class:`Header`,
``HEADER_BYTES`` = 68 bytes, little-endian::

    offset  bytes  field
         0      1  kind      what the replica is doing: 1 = a sync due in step(), 4 = finish()
         1      1  flags     bit 0: this replica's pseudo-gradient of the fragment is finite;
                             bit 1: it is *healing* (torchft: it receives a peer's state at this
                             sync's commit, so it contributes nothing and its state is stale)
         2      2  fragment  the syncing fragment's index (65535: none -- a finish() with
                             nothing left to sync)
         4      4  params    the number of parameters
         8      8  step      the inner step t (``iterations``)
        16      8  plan      64-bit fingerprint of the parameters (order, shapes, dtypes,
                             requires_grad, as they are at this header; which were replaced
                             in the inner optimizer since construction) and the options
                             (H, F, τ, alpha, wire, error feedback, bucket cap, replicas)
        24      8  outer     64-bit fingerprint of the algorithm (DiLoCo, LocalSGD) and of the
                             outer optimizer's type and hyperparameters, group by group
        32      8  inner     the same for the inner optimizer (a scheduler moves it every step;
                             it must move alike on every replica)
        40      8  Σ θ_g     float64, over the fragment's global copy (the whole copy when
        48      8  Σ θ_g²    float64   no fragment syncs); 0 with a torchft manager, whose
                             state word compares the copy bit for bit instead
        56      8  state     with a torchft manager: the bitwise checksum
                             (:func:`~distoptim.comm.checksum.state_checksum`) of slice ``part``
                             of ``parts`` of the same global copy and the outer optimizer's
                             state of its parameters (see :mod:`distoptim.outer.managed`); else 0
        64      2  part      the slice the state word covers (0 when ``parts`` = 1)
        66      2  parts     how many slices the state was cut into (1: the whole state)

(fingerprints: :mod:`distoptim.comm.fingerprint`, :mod:`distoptim.comm.hyperparameters`).
Every replica receives the same table and reaches the same verdict, in this order:

1. a kind that is not 1 or 4 -> :class:`~distoptim.comm.guard.DesyncError` (the replicas'
   collectives did not pair);
2. the parameter count or a fingerprint differs -> every replica sends its description (two
   more collectives: the lengths, then the bytes, only on this path) and raises
   :class:`~distoptim.comm.guard.ParameterMismatchError` naming each difference (``lr: rank 0
   0.7, rank 1 0.5``);
3. kind, step or fragment differ -> ``DesyncError`` ("out of step": a replica whose loop ended
   before this sync and called ``finish()``, an extra or a missing ``step()``, a checkpoint
   loaded on some replicas only). Except in a torchft quorum, whose members all stand at the
   same committed step (a member behind it heals): members in ``step()`` at different inner
   steps are a straggler (frozen or slowed while every round of the others failed too), not
   a desync -- the sync is void and every member behind takes the furthest member's step
   (:attr:`HeaderVerdict.catch_up`);
4. (with a manager) the members checked different slices of the state -> the sync is void
   (not applied: the next sync checks the whole state); their state checksums differ at all,
   or (without a manager) the global copies' sums differ beyond a relative 1e-9 ->
   ``ParameterMismatchError`` (different initial weights or checkpoints; with a manager:
   replicas that committed or healed into different states);
5. otherwise the sync stands, except that if some replica's flag says its pseudo-gradient is
   not finite, every replica refuses it (:meth:`SyncAgreement.check` returns those replicas;
   the caller keeps the global copy and says so).

Healing replicas (flag bit 1; only with a torchft manager) are left out of steps 2--5: their
state is the one a peer is about to replace. They read the verdict's step and fragment from the
others (:class:`HeaderVerdict`) and take part in that sync's collectives with zeros; the mean
divides by the replicas that contribute (:attr:`HeaderVerdict.contributors`).

Why a separate header and not a trailer in the payload (as CrossShardOptimizer's rounds carry
their words): fragments have different sizes, and a gloo collective whose ranks disagree on the
size aborts the process. A fixed-size message first turns every such divergence into an error
on every rank, before any size-dependent collective. Cost per header: ``(n - 1)`` messages of
68 bytes per rank and one latency, and the comparison of the global copy: without a manager
two float64 sums over it; with one, the state word's checksum of a slice of it.
"""

from __future__ import annotations

import json
import operator
import struct
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from distoptim.comm.channel import Channel
from distoptim.comm.fingerprint import digest
from distoptim.comm.guard import DesyncError, ParameterMismatchError, RoundKind
from distoptim.comm.hyperparameters import (
    describe_optimizer,
    differences,
    fingerprint,
    group_members,
)
from distoptim.comm.stats import CommStats

__all__ = [
    "HEADER_BYTES",
    "NO_FRAGMENT",
    "Header",
    "HeaderVerdict",
    "NonFiniteSyncError",
    "ReplicaIdentity",
    "SyncAgreement",
]

_LAYOUT = struct.Struct("<BBHIQQQQddQHH")
HEADER_BYTES = _LAYOUT.size
"""Bytes one replica sends to each peer per header."""
NO_FRAGMENT = 0xFFFF
"""The fragment field of a header that precedes no payload (a finish() with nothing to sync)."""
_KINDS = {RoundKind.STEP: "step()", RoundKind.FINISH: "finish()"}
_FINITE = 1
_HEALING = 2
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclass(frozen=True)
class Header:
    """One replica's header (see the module for the layout).

    ``fragment`` is ``None`` when no fragment syncs after it; ``finite`` says whether this
    replica's pseudo-gradient of the fragment is finite (True when it sends none).
    """

    kind: RoundKind
    step: int
    fragment: int | None
    params: int
    plan: int
    outer: int
    inner: int
    finite: bool = True
    healing: bool = False
    state: int = 0
    part: int = 0
    parts: int = 1

    def pack(self, sums: tuple[float, float]) -> bytes:
        fragment = NO_FRAGMENT if self.fragment is None else min(self.fragment, NO_FRAGMENT - 1)
        return _LAYOUT.pack(
            int(self.kind),
            (_FINITE if self.finite else 0) | (_HEALING if self.healing else 0),
            fragment,
            min(self.params, 0xFFFFFFFF),
            self.step,
            self.plan,
            self.outer,
            self.inner,
            *sums,
            self.state,
            self.part,
            self.parts,
        )

    def describe(self) -> str:
        what = _KINDS.get(self.kind, f"an unknown operation (kind {int(self.kind)})")
        if self.fragment is None:
            return f"{what} after step {self.step}, nothing left to sync"
        return f"{what}: the sync of fragment {self.fragment} after step {self.step}"


class NonFiniteSyncError(FloatingPointError):
    """A sync refused on every replica because some replica's pseudo-gradient was not finite.

    Raised on every replica alike, after the refusal: no outer step was taken, the global copy
    is unchanged and every replica's parameters of the fragment were reset to it, so the
    replicas are still in step and training may go on.
    """


class ReplicaIdentity:
    """What a replica's headers say about it: the fingerprints and, on a mismatch, the
    description they summarize.

    ``algorithm`` names the optimizer (``"DiLoCo"``, ``"LocalSGD"``); ``params`` (the
    parameters the optimizer was built over) and ``options`` are fixed at construction, and so
    is which parameters each param group of the inner and outer optimizers holds; their
    hyperparameters are read at every header (schedulers move them). The plan fingerprint
    covers the inner optimizer's parameters *as they are now*: it is recomputed at a header
    whenever a parameter's ``requires_grad`` changed or the inner optimizer holds another
    tensor than the one it was built with (a parameter replaced in its param groups, which the
    fingerprint then marks), so a parameter frozen or replaced on some replicas only is a
    ``ParameterMismatchError`` on every replica at the next sync. The check per header is one
    ``(id, requires_grad)`` pair per parameter, compared with the last ones (:meth:`refresh`);
    the digest runs again only when it changed.
    """

    def __init__(
        self,
        algorithm: str,
        params: Sequence[torch.Tensor],
        options: Mapping[str, Any],
        inner: torch.optim.Optimizer,
        outer: torch.optim.Optimizer,
    ) -> None:
        self.algorithm = algorithm
        self.params = list(params)
        self.options = dict(options)
        self.inner = inner
        self.outer = outer
        self.plan = 0
        self._key: tuple[list[int], list[bool]] | None = None
        self._current = self.params
        self.refresh()
        self._members = {
            id(opt): group_members(opt, self.params) for opt in (self.inner, self.outer)
        }

    def refresh(self) -> None:
        """Recompute the plan fingerprint if ``requires_grad`` or a parameter object changed.

        ``plan`` digests the current parameters' shapes, dtypes and ``requires_grad`` and the
        options (:func:`~distoptim.comm.fingerprint.digest`), plus the positions of parameters
        that are not the tensors the optimizer was built with (only when there are some).
        """
        current = [p for g in self.inner.param_groups for p in g["params"]]
        key = (list(map(id, current)), list(map(_REQUIRES_GRAD, current)))  # C loops: cheap
        if key == self._key:
            return
        self._key, self._current = key, current
        options = dict(self.options)
        replaced = self._replaced()
        if replaced:
            options["replaced parameters"] = replaced
        self.plan = int.from_bytes(digest(current, options)[:8], "little")

    def _replaced(self) -> list[int]:
        """Positions whose tensor is not the one the optimizer was built with."""
        built = self.params
        out = [i for i, (p, q) in enumerate(zip(self._current, built)) if p is not q]
        return out + list(range(min(len(built), len(self._current)), len(self._current)))

    def header(
        self,
        kind: RoundKind,
        step: int,
        fragment: int | None,
        finite: bool,
        healing: bool = False,
        state: tuple[int, int, int] = (0, 1, 0),
    ) -> Header:
        """This replica's header for a sync of ``fragment`` (``None``: no payload follows);
        ``state``: ``(part, parts, checksum)`` of the state word (with a manager)."""
        self.refresh()
        return Header(
            kind,
            step,
            fragment,
            len(self._current),
            self.plan,
            fingerprint(self._outer()),
            fingerprint(self._describe(self.inner)),
            finite,
            healing,
            state[2],
            state[0],
            state[1],
        )

    def _outer(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "optimizer": self._describe(self.outer),
        }

    def _describe(self, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return describe_optimizer(opt, self.params, self._members[id(opt)])

    def describe(self) -> dict[str, Any]:
        """Everything the fingerprints cover, as JSON-able data (sent only on a mismatch)."""
        replaced = set(self._replaced())
        return {
            "algorithm": self.algorithm,
            "parameters": [
                f"{tuple(p.shape)} {p.dtype}{'' if p.requires_grad else ' frozen'}"
                f"{' replaced' if i in replaced else ''}"
                for i, p in enumerate(self._current)
            ],
            "options": self.options,
            "outer optimizer": self._describe(self.outer),
            "inner optimizer": self._describe(self.inner),
        }


def _unpack(row: bytes) -> tuple[Header | None, int, tuple[float, float]]:
    """``(header or None if its kind is unknown, raw kind, (Σ θ_g, Σ θ_g²))``."""
    kind, flags, fragment, params, step, plan, outer, inner, s1, s2, state, part, parts = (
        _LAYOUT.unpack(row)
    )
    if kind not in (RoundKind.STEP, RoundKind.FINISH) or flags > _FINITE | _HEALING:
        return None, kind, (s1, s2)
    header = Header(
        RoundKind(kind),
        step,
        None if fragment == NO_FRAGMENT else fragment,
        params,
        plan,
        outer,
        inner,
        finite=bool(flags & _FINITE),
        healing=bool(flags & _HEALING),
        state=state,
        part=part,
        parts=parts,
    )
    return header, kind, (s1, s2)


@dataclass(frozen=True)
class HeaderVerdict:
    """What every replica takes from a header that stands.

    ``refusing``: the replicas whose pseudo-gradient is not finite (empty: the sync stands);
    ``step`` and ``fragment``: the sync's, as the contributing replicas see it (a healing
    replica adopts them); ``contributors``: replicas whose pseudo-gradient counts.
    """

    refusing: list[str]
    step: int
    fragment: int | None
    contributors: int
    void: str = ""  # not empty: no payload follows and the sync is not applied (why)
    catch_up: bool = False  # void because members stood at different steps: take ``step``


class SyncAgreement:
    """Checks one sync header over ``channel`` (``channel.size >= 2`` replicas).

    ``device``: where the message lives (the current GPU under NCCL, else the CPU); ``owner``
    names the optimizer in errors.
    """

    def __init__(
        self,
        channel: Channel,
        stats: CommStats,
        device: torch.device,
        owner: str,
        odd_one_out: bool = False,
    ) -> None:
        self.stats = stats
        self.device = device
        self.owner = owner
        self.odd_one_out = odd_one_out
        self.rebind(channel)

    def rebind(self, channel: Channel) -> None:
        """Run the next headers over ``channel`` (between syncs)."""
        self.channel = channel

    @property
    def _names(self) -> list[str]:
        return [f"rank {r}" for r in self.channel.ranks]

    def check(
        self,
        header: Header,
        global_copy: Sequence[torch.Tensor],
        describe: Callable[[], Any],
    ) -> HeaderVerdict:
        """All-gather ``header`` and the global copy's sums; raise on any disagreement.

        ``global_copy``: the tensors compared by their float64 sums -- none under a torchft
        manager, whose header's state word compares the same copy bit for bit (the sums would
        only repeat it, weaker, at the cost of two float64 passes over the copy). Returns the
        :class:`HeaderVerdict` (every replica reads the same). ``describe()`` -- this
        replica's parameters, options and optimizers as JSON-able data -- is called only when
        fingerprints differ.
        """
        sums = _sums(global_copy)
        mine = torch.frombuffer(bytearray(header.pack(sums)), dtype=torch.uint8).to(self.device)
        size = self.channel.size
        rows = mine.new_empty(size * HEADER_BYTES)
        self.stats.send((size - 1) * HEADER_BYTES)
        self.channel.all_gather_single(rows, mine).wait()
        if self.channel.failed:  # a torchft round whose peer died: the table is not one
            why = f"the round failed before its header was read ({self.channel.failed})"
            return HeaderVerdict([], header.step, header.fragment, 1, void=why)
        raw = rows.cpu().numpy().tobytes()
        table = [_unpack(raw[i * HEADER_BYTES : (i + 1) * HEADER_BYTES]) for i in range(size)]
        names = self._names
        for name, (h, kind, _) in zip(names, table):
            if h is None:
                raise DesyncError(
                    f"{self.owner}: {name}'s sync header is not valid (kind {kind}): the "
                    "replicas' collectives did not pair -- some replica issued a different "
                    "collective in this position"
                )
        everyone: list[Header] = [h for h, _, _ in table]  # type: ignore[misc]
        judged = [i for i, h in enumerate(everyone) if not h.healing]
        if not judged:
            raise DesyncError(
                f"{self.owner}: every replica of this sync is healing: nobody holds a state to "
                "heal from (a torchft quorum of joiners only)"
            )
        every_name = names
        headers = [everyone[i] for i in judged]
        names = [names[i] for i in judged]
        first = headers[0]
        strangers = [
            i
            for i, h in enumerate(everyone)
            if h.healing and (h.params, h.plan) != (first.params, first.plan)
        ]
        if strangers:  # a replica built with another model or options is joining
            message = (
                f"{self.owner}: {', '.join(every_name[i] for i in strangers)} joined with "
                f"another model or other options ({everyone[strangers[0]].params} parameters, "
                f"plan {everyone[strangers[0]].plan:016x}) than the replicas it would heal "
                f"from ({first.params} parameters, plan {first.plan:016x}); it is refused "
                "before it contributes"
            )
            if self.channel.rank in strangers:
                raise ParameterMismatchError(message, [])
            return HeaderVerdict([], first.step, first.fragment, len(headers), void=message)
        if any(_prints(h) != _prints(first) for h in headers):
            message = self._mismatch(everyone, describe)
            return self._refuse_minority(judged, [_prints(h) for h in headers], headers, message)
        if any(
            (h.kind, h.step, h.fragment) != (first.kind, first.step, first.fragment)
            for h in headers
        ):
            behind = self._stragglers(headers, names)
            if behind is None:
                raise DesyncError(_out_of_step(self.owner, headers, names))
            return behind
        if len({(h.part, h.parts) for h in headers}) > 1:  # see distoptim.outer.managed
            lines = ", ".join(f"{n} slice {h.part}/{h.parts}" for n, h in zip(names, headers))
            why = (
                f"the members checked different slices of their state ({lines}): not applied, "
                "the next sync checks the whole state"
            )
            return HeaderVerdict([], first.step, first.fragment, len(headers), void=why)
        if len({h.state for h in headers}) > 1:
            lines = [f"  {n}: state checksum {h.state:016x}" for n, h in zip(names, headers)]
            message = (
                f"{self.owner}: replicas hold different global copies or outer states at step "
                f"{header.step} although they all committed (or healed into) the same syncs "
                "-- their synchronised state is not bit-for-bit equal:\n" + "\n".join(lines)
            )
            return self._refuse_minority(judged, [h.state for h in headers], headers, message)
        all_sums = torch.tensor([table[i][2] for i in judged], dtype=torch.float64)
        if not all(
            torch.allclose(row, all_sums[0], rtol=1e-9, atol=0.0, equal_nan=True)
            for row in all_sums
        ):
            lines = [
                f"  {name}: sum {float(s[0]):.12g}, sum of squares {float(s[1]):.12g}"
                for name, s in zip(names, all_sums)
            ]
            raise ParameterMismatchError(
                f"{self.owner}: replicas hold different global copies at step {header.step} "
                "(the parameters at construction, or the loaded checkpoints, differ):\n"
                + "\n".join(lines)
                + "\nBuild the model identically on every replica (e.g. torch.manual_seed "
                "before creating it, or broadcast rank 0's parameters) before creating the "
                "optimizer, and resume every replica from the same checkpoint step."
            )
        return HeaderVerdict(
            [name for name, h in zip(names, headers) if not h.finite],
            first.step,
            first.fragment,
            len(headers),
        )

    def _stragglers(self, headers: list[Header], names: list[str]) -> HeaderVerdict | None:
        """Members of a torchft quorum (``odd_one_out``) that sync in ``step()`` at different
        inner steps: a void verdict naming the furthest step, which every member behind it
        takes (``catch_up``); ``None`` where this is not that case (no manager, a
        ``finish()``, or the same step with different fragments), an error.

        They passed the lighthouse's quorum as equals (the same committed step): none of them
        missed a commit, only inner steps -- a member frozen or slowed while every round of
        the others failed too (too few of them left for a quorum). Their global copies are the
        ones the same commits left; the sync is not applied, so the next one, all at one step,
        checks the whole state."""
        if not self.odd_one_out or any(h.kind is not RoundKind.STEP for h in headers):
            return None
        lead = max(headers, key=operator.attrgetter("step"))
        if len({h.step for h in headers}) == 1:
            return None
        late = ", ".join(
            f"{n} at step {h.step}" for n, h in zip(names, headers) if h.step < lead.step
        )
        why = (
            f"{late} behind the furthest member (step {lead.step}) although none missed a "
            "commit: not applied; it takes that step, and the next sync checks the whole state"
        )
        return HeaderVerdict([], lead.step, lead.fragment, len(headers), void=why, catch_up=True)

    def _refuse_minority(
        self, judged: list[int], keys: list[Any], headers: list[Header], message: str
    ) -> HeaderVerdict:
        """The judged replicas disagree (``keys``, one per judged replica; every replica holds
        the same table, so every one decides alike). With ``odd_one_out`` (a torchft quorum,
        whose membership may drop a replica) and a strict majority agreeing, only the others
        raise ``ParameterMismatchError``, naming themselves, before they contribute; the
        majority gets a void verdict (the sync is not applied, the next quorum forms without
        them). Otherwise every replica raises."""
        counts = Counter(keys)
        top, agreeing = counts.most_common(1)[0]
        if not self.odd_one_out or 2 * agreeing <= len(keys):
            raise ParameterMismatchError(message, [])
        odd = [judged[i] for i, k in enumerate(keys) if k != top]
        names = ", ".join(f"rank {self.channel.ranks[i]}" for i in odd)
        if self.channel.rank in odd:
            raise ParameterMismatchError(
                f"{message}\n{names} differ(s) from the {agreeing} replicas that agree and "
                "is refused before it contributes; the others go on without it",
                [],
            )
        ref = headers[keys.index(top)]
        why = f"{names} refused (it differs from the majority)"
        return HeaderVerdict([], ref.step, ref.fragment, agreeing, void=why)

    def _mismatch(self, headers: list[Header], describe: Callable[[], Any]) -> str:
        """Exchange every replica's description (every replica is here: the table is the same
        everywhere); the ``ParameterMismatchError`` message naming the differences."""
        blob = json.dumps(describe(), sort_keys=True).encode()
        size = self.channel.size
        length = torch.tensor([len(blob)], dtype=torch.int64, device=self.device)
        lengths = length.new_empty(size)
        self.stats.send((size - 1) * 8)
        self.channel.all_gather_single(lengths, length).wait()
        longest = int(lengths.max())
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        mine = mine.to(self.device)
        gathered = mine.new_empty(size * longest)
        self.stats.send((size - 1) * longest)
        self.channel.all_gather_single(gathered, mine).wait()
        raw = gathered.cpu().numpy().tobytes()
        descriptions = [
            json.loads(raw[i * longest : i * longest + int(n)])
            for i, n in enumerate(lengths.tolist())
        ]
        lines = differences(descriptions, self._names) or [
            "(the descriptions are equal: a fingerprint collision, or state that changed "
            "between the header and its description)"
        ]
        first = headers[0]
        return (
            f"{self.owner}: replicas disagree on the parameters, the options or the optimizers "
            f"at the sync after step {first.step}; nothing was applied:\n"
            + "\n".join(f"  {line}" for line in lines)
            + "\nEvery replica must build the same model, the same optimizer (DiLoCo or "
            "LocalSGD, with the same options) and the same inner and outer optimizers with "
            "the same hyperparameters -- and change them alike: an LR scheduler (or any "
            "param-group edit) must step on every replica, not on rank 0 only."
        )


def _sums(tensors: Sequence[torch.Tensor]) -> tuple[float, float]:
    """``(Σ θ, Σ θ²)`` over ``tensors`` in float64 (one float64 copy of each tensor)."""
    if not tensors:
        return 0.0, 0.0
    with torch.no_grad():
        parts = []
        for g in tensors:
            d = g.detach().reshape(-1).double()
            parts.append(torch.stack([d.sum(), torch.dot(d, d)]))
        both = torch.stack(parts).sum(0)
    return float(both[0]), float(both[1])


def _prints(h: Header) -> tuple[int, int, int, int]:
    return (h.params, h.plan, h.outer, h.inner)


def _out_of_step(owner: str, headers: list[Header], names: list[str]) -> str:
    kinds = {h.kind for h in headers}
    if len(kinds) > 1:
        finished = [n for n, h in zip(names, headers) if h.kind is RoundKind.FINISH]
        stepping = [n for n, h in zip(names, headers) if h.kind is RoundKind.STEP]
        why = (
            f"{', '.join(finished)} called finish() while {', '.join(stepping)} reached a sync "
            "in step(): a replica's training loop ended early (or another took an extra "
            "step())"
        )
    elif len({h.step for h in headers}) > 1:
        why = (
            "step counters differ: a step() skipped or added on some replica, or a checkpoint "
            "loaded on some replicas only"
        )
    else:
        why = "they sync different fragments: replicas' fragment state differs (a checkpoint?)"
    lines = "\n".join(f"  {n}: {h.describe()}" for n, h in zip(names, headers))
    return (
        f"{owner}: replicas are out of step -- {why}; no update was applied:\n{lines}\n"
        "Every replica must call step() the same number of times and finish() once training "
        "ends, on every replica at the same step."
    )
