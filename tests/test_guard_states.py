"""Hypothesis stateful test of the guard's state machine over Memory, Redis and SQLite.

Random interleavings of deliveries, successes, failures, worker crashes, lease expiries and
zombie completions, checked against a model: a completed key never runs again within
keep_for; a failed eager run never blocks its retry; no key is held by two live owners.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from taskonce import Decision, Delivery, Guard, Policy
from taskonce.errors import LeaseLost
from taskonce.stores import Status
from tests.helpers import drop_store, make_store, wait_for

# Long enough that the heartbeat (every LEASE / 3) keeps a running claim alive on a loaded
# machine; a starved heartbeat would rightly let another delivery take the claim over.
LEASE = 1.5
KEYS = ("k0", "k1", "k2")
# A take-over is legitimate only once the dead owner's lease has run out; this much slack
# covers the difference between this process's clock and the store's.
CLOCK_SLACK = 0.05


def machine_for(kind: str) -> type[RuleBasedStateMachine]:
    class GuardMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.tmp = tempfile.TemporaryDirectory()
            self.store = make_store(kind, self.tmp.name)
            self.guard = Guard(self.store, default=Policy(lease=LEASE, keep_for=3600))
            self.runs: dict[str, int] = dict.fromkeys(KEYS, 0)
            self.completed: set[str] = set()
            self.running: dict[str, Any] = {}
            self.crashed: dict[str, Any] = {}
            self.expired: set[str] = set()
            self.zombies: list[Any] = []

        def deliver_one(self, key: str) -> Any:
            return self.guard.begin(Delivery(key, "q", task="charge"), (key,))

        @rule(key=st.sampled_from(KEYS))
        def deliver(self, key: str) -> None:
            ticket = self.deliver_one(key)
            if key in self.completed:
                assert ticket.decision is Decision.SKIP, "a completed key ran again"
            elif key in self.running:
                assert ticket.decision is Decision.DEFER, "two live owners"
            elif key in self.crashed and key not in self.expired:
                dead = self.crashed[key]
                if ticket.decision is Decision.RUN:
                    assert time.monotonic() >= dead.started + LEASE - CLOCK_SLACK, (
                        "taken over before the dead owner's lease ran out"
                    )
                else:
                    assert ticket.decision is Decision.DEFER
            else:
                assert ticket.decision is Decision.RUN, "a free key (retry) was blocked"
            if ticket.decision is Decision.RUN:
                self.runs[key] += 1
                self.running[key] = ticket
                if key in self.crashed:
                    self.zombies.append(self.crashed.pop(key))
                    self.expired.discard(key)

        @precondition(lambda self: self.running)
        @rule(data=st.data())
        def succeed(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.running)))
            self.guard.finish(self.running.pop(key))
            self.completed.add(key)

        @precondition(lambda self: self.running)
        @rule(data=st.data())
        def handler_fails(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.running)))
            self.guard.fail(self.running.pop(key), RuntimeError("boom"))

        @precondition(lambda self: self.running)
        @rule(data=st.data())
        def worker_dies(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.running)))
            ticket = self.running.pop(key)
            self.guard._renewals.stop(ticket)  # a killed process renews nothing
            self.crashed[key] = ticket

        @precondition(lambda self: set(self.crashed) - self.expired)
        @rule(data=st.data())
        def lease_runs_out(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(set(self.crashed) - self.expired)))
            wait_for(
                lambda: (r := self.store.get(f"q:{key}")) is not None and r.lease_remaining == 0,
                timeout=10,
                what="the dead owner's lease to run out",
            )
            self.expired.add(key)

        @precondition(lambda self: self.zombies)
        @rule()
        def zombie_completes(self) -> None:
            zombie = self.zombies.pop()
            try:
                self.guard.finish(zombie)
            except LeaseLost:
                return
            raise AssertionError("a zombie's completion was accepted after a take-over")

        @invariant()
        def store_agrees(self) -> None:
            for key in self.completed:
                record = self.store.get(f"q:{key}")
                assert record is not None and record.status is Status.COMPLETED
            for key, ticket in self.running.items():
                record = self.store.get(f"q:{key}")
                assert record is not None and record.owner == ticket.owner, "owner changed"

        def teardown(self) -> None:
            for ticket in self.running.values():
                self.guard._renewals.stop(ticket)
            self.guard._liveness.stop()  # before its store goes away
            drop_store(self.store)
            self.tmp.cleanup()

    GuardMachine.__name__ = f"GuardMachine_{kind}"
    return GuardMachine


SETTINGS = {
    "memory": settings(
        max_examples=40,
        stateful_step_count=25,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],
    ),
    "redis": settings(max_examples=15, stateful_step_count=20),
    "sqlite": settings(max_examples=15, stateful_step_count=20),
}


@pytest.mark.parametrize("kind", sorted(SETTINGS))
def test_guard_state_machine(kind: str) -> None:
    machine = machine_for(kind)
    machine.TestCase.settings = settings(
        SETTINGS[kind],
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine.TestCase("runTest").runTest()
