"""Fault injection at named points of a torchft round: stop or kill a replica *there*.

Owns the hook the fault-tolerance tests (and anyone reproducing a fault) use to take a replica
down at a precise point of the protocol instead of after a sleep, so a scenario's outcome does
not depend on how loaded the machine is. The points, in the order a round meets them:

=================  ===========================  ================================================
point              role(s)                      where
=================  ===========================  ================================================
``after_quorum``   ``contributor``, ``joiner``  the round's quorum is known, before any collective
``heal_donor``     ``donor``                    a donor copies its state for a healing peer
``heal_joiner``    ``joiner``                   a healing replica is about to load that state
``before_apply``   ``contributor``, ``joiner``  ``should_commit()`` said True, nothing applied yet
``in_flight``      ``contributor``, ``joiner``  a DiLoCo fragment's sync was launched and stays in
                                                flight (``fragment_sync_delay >= 1``)
``finish``         ``contributor``, ``joiner``  inside DiLoCo's ``finish()``, before its syncs
=================  ===========================  ================================================

A *trigger* is written ``POINT[:ROLE][@N][=ACTION]``: at the ``N``-th time (default 1) this
process reaches ``POINT`` in ``ROLE`` (default any), do ``ACTION``: ``stop`` (SIGSTOP this
process: frozen exactly there, for a supervisor to kill or continue), ``kill`` (SIGKILL this
process). Several triggers are separated by commas. They are armed from the environment
variable ``DISTOPTIM_FT_INJECT`` when this module is imported, or by :func:`arm` (a test's
replica function, per slot), which also accepts an ``action`` callable ``action(point, role)``
run instead (e.g. log an event, then stop). torchrun gives a group's restarted workers the
environment of the first ones: with ``DISTOPTIM_FT_INJECT_ATTEMPT=K`` the variable arms its
triggers only in attempt ``K`` (``TORCHELASTIC_RESTART_COUNT``, 0 for the first), so a fault
that brings ``--max-restarts`` into play fires once, not in every attempt.

``stop`` freezes the whole process. In a replica group of several processes, group rank 0's
process also hosts the group's torchft manager server: stopped, it can hold back its other
ranks' answers to the very quorum it just had answered (they then never reach the point, and
raise :class:`~distoptim.ft.replica.GroupManagerUnreachableError`). To stop every process of
such a group at one point, pass an ``action`` that blocks the training thread instead
(``tests/ft/group_workloads.py``).

Cost when nothing is armed: every call site reads the module flag :data:`ARMED` and does
nothing else (``if inject.ARMED: inject.hit(...)``).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "ARMED",
    "ATTEMPT_ENV",
    "ENV",
    "POINTS",
    "ROLES",
    "Trigger",
    "arm",
    "armed_by_environment",
    "disarm",
    "hit",
    "parse",
]

ENV = "DISTOPTIM_FT_INJECT"
POINTS = ("after_quorum", "heal_donor", "heal_joiner", "before_apply", "in_flight", "finish")
ROLES = ("contributor", "donor", "joiner")
_ACTIONS = ("stop", "kill")

ARMED = False
"""Whether any trigger is armed (read by every call site before calling :func:`hit`)."""


@dataclass
class Trigger:
    """Fire ``action`` at the ``nth`` arrival at ``point`` in ``role`` (None: any role)."""

    point: str
    role: str | None
    nth: int
    action: str | Callable[[str, str], None]
    seen: int = 0
    fired: bool = False


_triggers: list[Trigger] = []


def parse(spec: str) -> list[Trigger]:
    """The triggers of ``spec`` (see the module); ValueError naming what is allowed."""
    if not isinstance(spec, str):
        raise TypeError(f"a fault-injection spec must be a str, got {type(spec).__name__}")
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        body, _, action = item.partition("=")
        body, _, nth_text = body.partition("@")
        point, _, role = body.partition(":")
        action = action or "stop"
        if point not in POINTS:
            raise ValueError(f"fault injection: point {point!r} is not one of {POINTS}")
        if role and role not in ROLES:
            raise ValueError(f"fault injection: role {role!r} is not one of {ROLES}")
        if action not in _ACTIONS:
            raise ValueError(f"fault injection: action {action!r} is not one of {_ACTIONS}")
        try:
            nth = int(nth_text) if nth_text else 1
        except ValueError:
            nth = 0
        if nth < 1:
            raise ValueError(f"fault injection: @N must be an integer >= 1, got {item!r}")
        out.append(Trigger(point, role or None, nth, action))
    return out


def arm(spec: str, action: Callable[[str, str], None] | None = None) -> list[Trigger]:
    """Arm the triggers of ``spec`` in this process (added to those armed already).

    ``action(point, role)``, when given, runs instead of each trigger's own action.
    """
    global ARMED
    triggers = parse(spec)
    if action is not None:
        for trigger in triggers:
            trigger.action = action
    _triggers.extend(triggers)
    ARMED = bool(_triggers)
    return triggers


def disarm() -> None:
    """Remove every trigger."""
    global ARMED
    _triggers.clear()
    ARMED = False


def hit(point: str, role: str) -> None:
    """This process reached ``point`` in ``role``: fire the trigger due there, if any."""
    for trigger in _triggers:
        if trigger.fired or trigger.point != point or trigger.role not in (None, role):
            continue
        trigger.seen += 1
        if trigger.seen < trigger.nth:
            continue
        trigger.fired = True
        if callable(trigger.action):
            trigger.action(point, role)
        else:
            sig = signal.SIGSTOP if trigger.action == "stop" else signal.SIGKILL
            os.kill(os.getpid(), sig)


ATTEMPT_ENV = "DISTOPTIM_FT_INJECT_ATTEMPT"


def armed_by_environment(environ: dict[str, str] | None = None) -> str:
    """The spec ``DISTOPTIM_FT_INJECT`` arms in this process ("" if none): the variable's,
    unless ``DISTOPTIM_FT_INJECT_ATTEMPT`` names another torchrun attempt than this one's
    (``TORCHELASTIC_RESTART_COUNT``). ValueError when the attempt is not an integer >= 0."""
    env = os.environ if environ is None else environ
    spec = env.get(ENV, "")
    wanted = env.get(ATTEMPT_ENV, "")
    if not spec or not wanted:
        return spec
    if not wanted.isdigit():
        raise ValueError(f"fault injection: {ATTEMPT_ENV} must be an integer >= 0, got {wanted!r}")
    return spec if int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) == int(wanted) else ""


if armed_by_environment():
    arm(armed_by_environment())
