"""The soak's verdict: the ledger checked key by key (:func:`judge`), and what the drain does
with the items still missing once the broker holds nothing (:func:`lost_by_broker`)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

#: A key whose last event is one of these was recorded as handled: its row must be there.
HANDLED_EVENTS = frozenset({"completed", "marked", "duplicate_skipped", "concurrent_duplicate"})
#: Events that show the guard saw a fault on a key: a second run of it is explained by them.
EXPLAINING_EVENTS = frozenset(
    {"lease_taken_over", "lease_lost", "released", "store_error", "concurrent_duplicate"}
)


@dataclasses.dataclass
class Verdict:
    """The ledger's answer: keys without their row, keys with more than one, and which of
    those no event or fault explains."""

    lost: list[str]
    doubled: dict[str, dict[str, Any]]
    unexplained: list[str]
    held: bool


def judge(
    expected: list[tuple[str, str]],
    counts: dict[tuple[str, str], int],
    events: dict[tuple[str, str], collections.Counter[str]],
    run_pids: dict[tuple[str, str], set[int]],
    victims: dict[int, str],
    transactional: bool,
) -> Verdict:
    """Check the ledger key by key: ``counts`` of rows per (key, kind), the guard's ``events``
    per (key, kind), the pids that ran each, and the pids a fault hit (``victims``).

    Transactional: exactly one row per expected (key, kind). Otherwise: at least one, and a
    second only where the key's events show the guard met a fault (a takeover, a refused
    write, a release after a failure, a store error, a concurrent duplicate) or a fault hit
    a process that ran it.
    """
    lost = [f"{key}/{kind}" for key, kind in expected if counts.get((key, kind), 0) == 0]
    doubled: dict[str, dict[str, Any]] = {}
    for (key, kind), n in sorted(counts.items()):
        if n <= 1:
            continue
        seen = sorted(name for name in events.get((key, kind), {}) if name in EXPLAINING_EVENTS)
        hit = sorted(
            f"{victims[pid]}:{pid}" for pid in run_pids.get((key, kind), set()) if pid in victims
        )
        doubled[f"{key}/{kind}"] = {
            "rows": n,
            "events": dict(events.get((key, kind), {})),
            "explained_by": seen + hit,
        }
    unexplained = [item for item, info in doubled.items() if not info["explained_by"]]
    held = not lost and (not doubled if transactional else not unexplained)
    return Verdict(lost, doubled, unexplained, held)


@dataclasses.dataclass
class LostSplit:
    """What the drain does with the items still missing once the broker holds nothing."""

    #: (key, kind) the broker or the framework lost: published again with the same id (a
    #: parent; a child only once its guard had claimed it: its retry or redelivery was lost)
    republish: list[tuple[str, str]]
    #: keys whose parent has its row but whose child never reached its guard: taskonce's to
    #: deliver
    waiting: list[str]
    #: of those, the keys whose parent's sends the guard has not published yet
    undispatched: list[str]
    #: why the run fails at once (taskonce lost an item), or None
    failure: str | None = None


def lost_by_broker(
    missing: list[tuple[str, str]],
    message_ids: dict[tuple[str, str], str],
    last: dict[str, str],
    dispatched: set[str],
    claimed: frozenset[str] = frozenset(),
) -> LostSplit:
    """Sort the missing ``(key, kind)`` items, given each one's message id, the last guard
    event of each message id, the keys whose parent's deferred sends were published, and the
    message ids a guard ever claimed.

    An item whose last event says handled (completed, marked, skipped) but that has no row was
    lost by taskonce: a failure. A parent that was not: lost by the broker or the framework,
    published again. A child whose parent is missing too waits for its parent. A child that
    never reached its guard is taskonce's to deliver: it waits (the relay publishes its
    parent's sends while they are pending, ``undispatched``; the receipts publish it again when
    the broker lost it), and the caller fails the run if that never happens. A child its guard
    had claimed (its run failed, or its process died) has its receipt: the framework owed it a
    retry or a redelivery and lost that, as it can lose a parent's: published again like one.
    """
    republish: list[tuple[str, str]] = []
    waiting: list[str] = []
    undispatched: list[str] = []
    for key, kind in missing:
        if last.get(message_ids[(key, kind)]) in HANDLED_EVENTS:
            failure = f"{key}/{kind} was recorded as handled but has no ledger row"
            return LostSplit([], [], [], failure)
        if kind == "parent" or message_ids[(key, kind)] in claimed:
            republish.append((key, kind))
        elif (key, "parent") in missing:
            continue  # its parent runs first, then sends it
        else:
            waiting.append(key)
            if key not in dispatched:
                undispatched.append(key)
    return LostSplit(republish, waiting, undispatched)
