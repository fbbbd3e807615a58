"""The hand-off soak's children: how long the drain waits for one, and what taskonce's receipts
did for them.

With ``--handoff`` every parent body sends one guarded child, under the id the hand-off derives
from the parent's guard key (``derive_id(parent_key, 0)``). The soak never publishes a child
itself: a child the broker lost is taskonce's to repair. The sending worker's relay looks for the
child's record ``confirm_within`` seconds after the publish and, finding none, publishes it again
under the same id (``sends_redispatched``, reason ``unconfirmed``, naming the parent's key), then
after 2, 4 and 8 × ``confirm_within`` more, and reports ``send_unconfirmed`` (naming the child's
id) if it never shows.

A re-send does not say whether the first copy was lost or only slow (queued behind others, or
delivered to a worker that was killed before it claimed it): both copies carry the same id. The
child's guard tells them apart afterwards: every copy that arrives after the child ran is
skipped (``duplicate_skipped``). A child re-sent ``k`` times that ran once and was skipped fewer
than ``k`` times lost a copy on the way: *repaired by taskonce*. One skipped ``k`` times or more
was merely slow: its re-sends found it already run.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from taskonce.policy import RECEIPT_WINDOW
from taskonce.receipts import TRIES

#: Seconds beyond the receipts' own window (and one relay period per look) before a missing
#: child counts as lost: a look is late by up to a relay period, and a sweep may take seconds
#: on a loaded machine.
SLACK = 15.0


def grace(confirm_within: float, relay_every: float) -> float:
    """Seconds a child may stay missing (its parent has its row, the broker holds nothing)
    before the soak calls it lost: the receipts' last look (15 × ``confirm_within``: the first
    look, then the back-off of 2, 4 and 8 ×) plus a relay period for each look, plus
    :data:`SLACK`. A child the broker lost is normally re-sent after ``confirm_within`` and one
    relay period."""
    return RECEIPT_WINDOW * confirm_within + (TRIES + 1) * relay_every + SLACK


@dataclasses.dataclass
class ChildAccount:
    """What taskonce's receipts did for the run's children."""

    #: parent key -> how many times taskonce published its child again (reason unconfirmed)
    resent: dict[str, int]
    #: keys whose child a re-send repaired: it ran, and fewer copies than re-sends were skipped
    repaired: list[str]
    #: re-sends whose copy found the child already run (the first copy was merely slow)
    found_run: int
    #: keys whose child taskonce reported as ``send_unconfirmed``
    unconfirmed: list[str]
    #: of those, the keys whose child never ran: a failure
    unconfirmed_never_ran: list[str]
    #: keys whose child was re-sent and has more than one ledger row: a failure
    resent_doubled: list[str]

    @property
    def failure(self) -> str | None:
        if self.unconfirmed_never_ran:
            return (
                f"{self.unconfirmed_never_ran[0]}/child: taskonce gave up on it "
                f"(send_unconfirmed) and it never ran ({len(self.unconfirmed_never_ran)} such)"
            )
        if self.resent_doubled:
            return (
                f"{self.resent_doubled[0]}/child: re-sent by taskonce and ran more than once "
                f"({len(self.resent_doubled)} such)"
            )
        return None

    def as_report(self) -> dict[str, Any]:
        return {
            "children_resent": len(self.resent),
            "child_resends": sum(self.resent.values()),
            "children_repaired": len(self.repaired),
            "children_repaired_keys": self.repaired[:100],
            "resends_found_run": self.found_run,
            "send_unconfirmed": len(self.unconfirmed),
            "send_unconfirmed_keys": self.unconfirmed[:100],
            "unconfirmed_never_ran": self.unconfirmed_never_ran[:100],
            "resent_doubled": self.resent_doubled[:100],
        }


def account(
    events: Iterable[Mapping[str, Any]],
    parents: Mapping[str, str],
    children: Mapping[str, str],
    counts: Mapping[tuple[str, str], int],
) -> ChildAccount:
    """Sort out the receipts' work from the guard's ``events``: ``parents`` maps a parent's
    guard key to the soak's key, ``children`` a child's message id to it, ``counts`` the ledger
    rows per ``(key, kind)``."""
    resent: collections.Counter[str] = collections.Counter()
    skipped: collections.Counter[str] = collections.Counter()
    unconfirmed: set[str] = set()
    for event in events:
        name = event.get("event")
        if name == "sends_redispatched" and event.get("reason") == "unconfirmed":
            key = parents.get(str(event.get("key")))
            if key is not None:
                resent[key] += int(event.get("count") or 1)
        elif name == "duplicate_skipped":
            key = children.get(str(event.get("message_id")))
            if key is not None:
                skipped[key] += 1
        elif name == "send_unconfirmed":
            key = children.get(str(event.get("message_id")))
            if key is not None:
                unconfirmed.add(key)
    repaired: list[str] = []
    found_run = 0
    for key, times in sorted(resent.items()):
        if counts.get((key, "child"), 0) < 1:
            continue  # never ran: missing (and a failure of its own)
        if skipped[key] < times:
            repaired.append(key)
        found_run += min(skipped[key], times)
    return ChildAccount(
        resent=dict(sorted(resent.items())),
        repaired=repaired,
        found_run=found_run,
        unconfirmed=sorted(unconfirmed),
        unconfirmed_never_ran=sorted(k for k in unconfirmed if counts.get((k, "child"), 0) < 1),
        resent_doubled=sorted(k for k in resent if counts.get((k, "child"), 0) > 1),
    )
