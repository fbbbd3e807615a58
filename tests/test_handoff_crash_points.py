"""The proof of the hand-off: a worker may die at *every* store call and every publish.

A simulated broker delivers a parent message whose guarded handler sends ``K`` children; the
children are guarded deliveries too. A store wrapper and the publisher count every call of the
whole sequence (claim, get, complete/mark, the transaction's commit, each publish, the
dispatched write, the redeliveries' calls, the children's calls) and die at the n-th one —
either before the call reaches the store/broker or after it landed, before its answer. A
:class:`Crash` is a ``BaseException``, so nothing after it in that worker runs; the broker
redelivers the unacknowledged message until the system is quiet. Then the invariant is checked:

* the parent's effect happened once — in transactional mode exactly once (its row commits with
  the mark); otherwise once per run whose outcome was recorded, plus at most one more when the
  crash fell between the handler and the record (that run's effect is done, its record is not:
  the at-least-once window that only transactional mode closes);
* every child was published at least once and ran exactly once, behind its own guard;
* nothing a failed run sent was ever published, and no sends are left pending.

Enumerated for eager and lazy, on every store; crashes at two points of one sequence are
enumerated on the memory store (fast, with a fake clock).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

import taskonce
from taskonce import handoff
from taskonce.errors import InProgressElsewhere
from taskonce.guard import Delivery
from taskonce.stores.base import Completion, Marking, Store
from taskonce.stores.transactional import TransactionalStore
from tests.helpers import STORE_KINDS, drop_store, make_store

K = 3  # children per parent
LEASE = 0.25  # short: a dead worker's claim and dispatch lease run out quickly (store clock)


class Crash(BaseException):
    """The worker process dies here."""


class FakeClock:
    """The memory store's clock: waiting for a lease costs nothing."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Killer:
    """Counts the calls of a sequence and dies at the chosen ones (``before`` the call takes
    effect, or ``after`` it landed but before the caller hears back)."""

    def __init__(self, points: Sequence[tuple[int, str]]) -> None:
        self.points = dict(points)
        self.calls = 0
        #: (n, operation, key, "before"/"after"/"ok")
        self.log: list[tuple[int, str, str, str]] = []

    def call(self, operation: str, key: str, fn: Callable[[], Any]) -> Any:
        self.calls += 1
        n = self.calls
        phase = self.points.get(n)
        if phase == "before":
            self.log.append((n, operation, key, "before"))
            raise Crash(f"died before {operation} {key} (call {n})")
        answer = fn()
        if phase == "after":
            self.log.append((n, operation, key, "after"))
            raise Crash(f"died after {operation} {key} (call {n})")
        self.log.append((n, operation, key, "ok"))
        return answer

    def unrecorded(self, key: str, transactional: bool) -> int:
        """Crashes that hit ``key``'s record write before it took effect: that run's handler
        had run, its outcome was not recorded, so the message runs again."""
        lost = 0
        for _, operation, logged, phase in self.log:
            if logged != key or phase == "ok":
                continue
            if transactional:
                # a crash before the commit rolls the mark back with the handler's rows
                lost += operation in ("complete_in", "mark_in") or (
                    operation == "commit" and phase == "before"
                )
            else:
                lost += operation in ("complete", "mark") and phase == "before"
        return lost


def _killable(name: str, operation: str) -> Callable[..., Any]:
    """The inner store's primitive ``name``, called through the :class:`Killer` as
    ``operation``."""

    def primitive(self: KillableStore, first: Any, *args: Any) -> Any:
        inner = getattr(self.inner, name)
        key = getattr(first, "key", first)  # a Completion or Marking carries its key
        return self.killer.call(operation, key, lambda: inner(first, *args))

    return primitive


def _passed(name: str) -> Callable[..., Any]:
    """The inner store's primitive ``name``, called as it is (not part of the sequence)."""

    def primitive(self: KillableStore, *args: Any) -> Any:
        return getattr(self.inner, name)(*args)

    return primitive


class KillableStore(Store):
    """Delegates to a real store's primitives (the public methods are the base's, as on every
    store); every call of a record goes through the :class:`Killer`. Renew, liveness and the
    receipts are left out: their timing is not part of the sequence (receipts are looked for
    long after the crash points this test kills at)."""

    def __init__(self, inner: Store, killer: Killer) -> None:
        self.inner = inner
        self.killer = killer

    _claim = _killable("_claim", "claim")
    _take_over = _killable("_take_over", "take_over")
    _quarantine = _killable("_quarantine", "quarantine")
    _complete = _killable("_complete", "complete")
    _release = _killable("_release", "release")
    _forget = _killable("_forget", "release")
    _mark = _killable("_mark", "mark")
    _get = _killable("_get", "get")
    _take_sends = _killable("_take_sends", "take_sends")
    _dispatched = _killable("_dispatched", "dispatched")
    _renew = _passed("_renew")
    _beat = _passed("_beat")
    _seen = _passed("_seen")
    _take_receipts = _passed("_take_receipts")
    _settle_receipts = _passed("_settle_receipts")
    _live_keys = _passed("_live_keys")
    _due_for_relay = _passed("_due_for_relay")
    _purge = _passed("_purge")
    _records = _passed("_records")
    _expired = _passed("_expired")
    _close = _passed("_close")


class KillableSQLStore(KillableStore, TransactionalStore):
    """The same for an SQL store in transactional mode: the commit is a call of the sequence."""

    def check_shared(self, bind: Any, in_transaction: bool = False) -> None:
        inner: Any = self.inner
        inner.check_shared(bind, in_transaction)

    _record_sends_in = _passed("_record_sends_in")

    def open_session(self) -> Any:
        session = self.inner.open_session()  # type: ignore[attr-defined]
        commit = session.commit
        # the key whose mark this transaction carries (set by complete_in/mark_in)
        session.info["key"] = ""
        session.commit = lambda: self.killer.call("commit", session.info["key"], commit)
        return session

    def _complete_in(self, session: Any, done: Completion) -> bool:
        session.info["key"] = done.key
        inner: Any = self.inner
        return self.killer.call(  # type: ignore[no-any-return]
            "complete_in", done.key, lambda: inner._complete_in(session, done)
        )

    def _mark_in(self, session: Any, mark: Marking) -> bool:
        session.info["key"] = mark.key
        inner: Any = self.inner
        return self.killer.call(  # type: ignore[no-any-return]
            "mark_in", mark.key, lambda: inner._mark_in(session, mark)
        )


@dataclasses.dataclass
class Message:
    id: str
    queue: str
    args: tuple[Any, ...]
    attempt: int = 0


@dataclasses.dataclass
class World:
    """One simulated system: a broker, a guard on a killable store, the handlers' effects."""

    kind: str
    mode: str
    transactional: bool
    failures: int  # the parent raises on its first ``failures`` runs
    permanent: bool  # the parent always raises, and a failure is not retried
    store: Store
    killer: Killer
    clock: FakeClock | None
    queue: collections.deque[Message] = dataclasses.field(default_factory=collections.deque)
    published: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    child_runs: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    parent_runs: int = 0
    parent_effects: int = 0
    sent_by_failed_runs: set[str] = dataclasses.field(default_factory=set)
    table: sa.Table | None = None
    scenario: int = 0
    early: list[str] = dataclasses.field(default_factory=list)  # published before the record

    @property
    def parent_key(self) -> str:
        return f"orders:p{self.scenario}"

    def guard(self) -> taskonce.Guard:
        policy = taskonce.Policy(
            mode=self.mode,  # type: ignore[arg-type]
            lease=LEASE,
            keep_for=3600,
            transactional=self.transactional,
        )
        guard = taskonce.Guard(self.store, default=policy, dispatch_lease=LEASE)
        guard.register_publisher("python", self.publish)
        return guard

    def publish(self, send: handoff.Send) -> None:
        # Published only after the parent's outcome is recorded (committed, in transactional
        # mode): a run that dies before its record can never have sent anything.
        # (Noted, not asserted here: the guard treats a publisher's exception as a failed
        # publish.)
        record = self.store.inner.get(self.parent_key)  # type: ignore[attr-defined]
        if record is None or record.status is not taskonce.Status.COMPLETED:
            self.early.append(send.id)

        def put() -> None:
            self.published[send.id] += 1
            self.queue.append(Message(send.id, "children", tuple(send.body["args"])))

        self.killer.call("publish", send.id, put)

    # -- handlers ----------------------------------------------------------------------------

    def parent(self, order: int) -> int:
        self.parent_runs += 1
        capture = handoff.current()
        assert capture is not None, "a guarded handler's sends are captured"
        ids = [capture.add("python", {"task": "child", "args": [order, i]}) for i in range(K)]
        if self.transactional:
            assert self.table is not None
            taskonce.current_session().execute(sa.insert(self.table).values(order=order))
        else:
            self.parent_effects += 1
        if self.permanent or self.parent_runs <= self.failures:
            self.sent_by_failed_runs.update(ids)
            raise RuntimeError("the parent fails")
        return order

    def child(self, order: int, i: int) -> None:
        assert handoff.current() is not None
        self.child_runs[handoff.derive_id(self.parent_key, i)] += 1

    # -- the broker --------------------------------------------------------------------------

    def wait(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.now += seconds + 0.001
        else:
            time.sleep(seconds + 0.01)

    def run_until_quiet(self) -> list[BaseException]:
        """Deliver until nothing is left; a crash leaves its message unacknowledged (it comes
        back) and the next delivery runs in a new worker (a new guard)."""
        crashes: list[BaseException] = []
        guard = self.guard()
        self.queue.append(Message(f"p{self.scenario}", "orders", (1,)))
        steps = 0
        while self.queue:
            steps += 1
            assert steps < 200, f"not quiet after 200 deliveries: {self.killer.log}"
            message = self.queue.popleft()
            fn: Callable[..., Any] = self.parent if message.queue == "orders" else self.child
            delivery = Delivery(
                message.id, message.queue, task=fn.__name__, attempt=message.attempt
            )
            try:
                guard.execute(delivery, fn, message.args)
            except Crash as crash:
                crashes.append(crash)
                self.queue.append(message)  # unacknowledged: the broker delivers it again
                _stop_threads(guard)  # the worker died (its store is the module's: kept open)
                guard = self.guard()  # a new one takes the message
                self.wait(LEASE)  # a redelivery comes after the broker notices the death
            except InProgressElsewhere as busy:
                self.wait(busy.retry_after)
                self.queue.append(message)
            except RuntimeError:
                if not self.permanent:  # a retry: the broker delivers it again
                    self.queue.append(dataclasses.replace(message, attempt=message.attempt + 1))
        _stop_threads(guard)
        return crashes


def _stop_threads(guard: taskonce.Guard) -> None:
    """A dead worker writes no more liveness records: without this, the guards of a module
    whose stores are dropped at its end keep beating into missing tables (and logging it)."""
    guard._liveness.stop()
    guard._renewals.close()
    guard.stop_relay()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Store]]:
    """One real store per kind for the whole module (each scenario uses its own keys)."""
    opened: dict[str, Store] = {}
    yield opened
    for store in opened.values():
        drop_store(store)


_scenario = iter(range(10**9))


def make_world(
    stores: dict[str, Store],
    tmp_path: Any,
    kind: str,
    mode: str,
    points: Sequence[tuple[int, str]],
    *,
    transactional: bool = False,
    failures: int = 0,
    permanent: bool = False,
) -> World:
    clock: FakeClock | None = None
    if kind == "memory":
        clock = FakeClock()
        inner: Store = taskonce.MemoryStore(clock=clock)
    else:
        if kind not in stores:
            stores[kind] = make_store(kind, tmp_path)
        inner = stores[kind]
    killer = Killer(points)
    wrapper = KillableSQLStore if transactional else KillableStore
    world = World(
        kind, mode, transactional, failures, permanent, wrapper(inner, killer), killer, clock
    )
    world.scenario = next(_scenario)  # its own keys in a store shared by the module
    if transactional:
        world.table = _effects_table(inner)
    return world


def _effects_table(store: Store) -> sa.Table:
    table = sa.Table(
        f"fx_{store._table_name}",  # type: ignore[attr-defined]
        sa.MetaData(),
        sa.Column("order", sa.Integer, nullable=False),
    )
    table.create(store._engine, checkfirst=True)  # type: ignore[attr-defined]
    with store._engine.begin() as connection:  # type: ignore[attr-defined]
        connection.execute(sa.delete(table))
    return table


def check(world: World, crashes: list[BaseException]) -> None:
    """The invariant of the hand-off (see the module docstring)."""
    killer = world.killer
    log = killer.log
    assert len(crashes) == len(killer.points), f"a crash point was not reached: {log}"
    assert world.store.due_for_relay(0.0, 100).sends == [], f"sends left pending: {log}"
    assert not world.early, f"published before the parent's outcome was recorded: {log}"
    if world.permanent:
        assert not world.published, f"a failed run's sends were published: {log}"
        assert not world.child_runs
        return
    # Every child published at least once; run once behind its own guard (plus its own
    # guard's window: a crash between its handler and its record, like the parent's below).
    children = [handoff.derive_id(world.parent_key, i) for i in range(K)]
    assert set(world.published) == set(children), (world.published, log)
    for child in children:
        expected = 1 + killer.unrecorded(f"children:{child}", world.transactional)
        assert world.child_runs[child] == expected, (child, world.child_runs, log)
    assert world.sent_by_failed_runs <= set(children), "a re-run sends under the same ids"
    if world.transactional:
        assert world.table is not None
        with world.store.inner._engine.connect() as connection:  # type: ignore[attr-defined]
            rows = connection.execute(sa.select(sa.func.count()).select_from(world.table))
            assert rows.scalar_one() == 1, f"the parent's row committed more than once: {log}"
        return
    # Non-transactional: the handler's effect is not part of the record. A run whose record
    # never landed (the worker died between the handler and complete/mark) runs again.
    expected = 1 + world.failures + killer.unrecorded(world.parent_key, False)
    assert world.parent_runs == expected, (world.parent_runs, expected, log)


def _clean_run_length(
    stores: dict[str, Store], tmp_path: Any, kind: str, mode: str, **options: Any
) -> int:
    world = make_world(stores, tmp_path, kind, mode, (), **options)
    check(world, world.run_until_quiet())
    return world.killer.calls


def _single_points(calls: int) -> Iterator[tuple[int, str]]:
    for n in range(1, calls + 1):
        for phase in ("before", "after"):
            yield n, phase


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("kind", STORE_KINDS)
def test_every_single_crash_point(
    stores: dict[str, Store], tmp_path: Any, kind: str, mode: str
) -> None:
    calls = _clean_run_length(stores, tmp_path, kind, mode)
    assert calls >= 2 + K + 1 + 2 * K  # claim/get, record, K publishes, dispatched, children
    for point in _single_points(calls):
        world = make_world(stores, tmp_path, kind, mode, [point])
        check(world, world.run_until_quiet())


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_every_pair_of_crash_points(stores: dict[str, Store], tmp_path: Any, mode: str) -> None:
    """Two deaths in one sequence: the second can hit the redelivery's own calls (its claim,
    take_sends, each re-publish, dispatched) and the children's."""
    calls = _clean_run_length(stores, tmp_path, "memory", mode)
    scenarios = 0
    for first in _single_points(calls):
        # the first death adds calls (the redelivery's): enumerate the second over all of them
        world = make_world(stores, tmp_path, "memory", mode, [first])
        world.run_until_quiet()
        for second in _single_points(world.killer.calls):
            if second[0] <= first[0]:
                continue
            world = make_world(stores, tmp_path, "memory", mode, [first, second])
            check(world, world.run_until_quiet())
            scenarios += 1
    assert scenarios > 300


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("kind", ["memory", "redis", "postgresql"])
def test_fails_twice_then_succeeds_each_child_once(
    stores: dict[str, Store], tmp_path: Any, kind: str, mode: str
) -> None:
    """The handler sends, then raises twice (retried); the third run's sends go out once, the
    failed runs' never — with a crash at every point of the sequence too."""
    calls = _clean_run_length(stores, tmp_path, kind, mode, failures=2)
    for point in _single_points(calls):
        world = make_world(stores, tmp_path, kind, mode, [point], failures=2)
        check(world, world.run_until_quiet())


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("kind", ["memory", "redis", "postgresql"])
def test_sends_then_fails_for_good_no_child(
    stores: dict[str, Store], tmp_path: Any, kind: str, mode: str
) -> None:
    """The handler sends, then fails for good: no child is ever published, whatever dies."""
    calls = _clean_run_length(stores, tmp_path, kind, mode, permanent=True)
    for point in _single_points(calls):
        world = make_world(stores, tmp_path, kind, mode, [point], permanent=True)
        check(world, world.run_until_quiet())


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("kind", ["postgresql", "mariadb", "sqlite"])
def test_transactional_every_crash_point_exactly_once(
    stores: dict[str, Store], tmp_path: Any, kind: str, mode: str
) -> None:
    """Transactional mode: the parent's row, its mark and its sends commit together, so its
    effect is exactly once at every crash point (the commit is a point of the sequence)."""
    calls = _clean_run_length(stores, tmp_path, kind, mode, transactional=True)
    assert calls >= 3 + K + 1
    for point in _single_points(calls):
        world = make_world(stores, tmp_path, kind, mode, [point], transactional=True)
        check(world, world.run_until_quiet())
