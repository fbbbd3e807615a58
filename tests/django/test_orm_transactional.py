"""The exactly-once effect with Django's ORM, in-process on each backend (PostgreSQL, MariaDB,
SQLite): with ``transactional: True`` and a ``django://ALIAS`` store, the handler's ORM writes on
the alias and the mark commit or roll back together. The same through real workers is in
test_celery_workers.py and test_dramatiq_workers.py."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from taskonce import Delivery, Guard, TaskonceError, current_session
from tests.django_project import databases
from tests.helpers import require_service

BACKENDS = ["default", "mariadb", "sqlite"]


class Events:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def emit(self, event: Any) -> None:
        with self.lock:
            self.seen.append(dict(event))

    def names(self) -> list[str]:
        return [e["event"] for e in self.seen]


@pytest.fixture(params=BACKENDS)
def alias(request: pytest.FixtureRequest) -> str:
    if request.param != "sqlite":
        require_service("postgresql" if request.param == "default" else "mariadb")
    databases.ready([request.param])
    databases.empty(request.param)
    return str(request.param)


@pytest.fixture
def make_guard(alias: str) -> Iterator[Any]:
    made: list[Guard] = []

    def make(events: Any = (), **policy: Any) -> Guard:
        from taskonce.django_ext import DjangoStore

        guard = Guard(DjangoStore(alias), default={"transactional": True, **policy}, events=events)
        made.append(guard)
        return guard

    yield make
    for guard in made:
        guard.close()


def new_order(alias: str) -> Any:
    from tests.django_project.shop.models import Order

    return Order.objects.using(alias).create(ref=uuid.uuid4().hex, cents=500)


def charge(alias: str, order_id: int, message_id: str) -> int:
    """The task body: plain ORM, nothing of taskonce."""
    from tests.django_project.shop.models import Order, Payment

    Order.objects.using(alias).filter(pk=order_id).update(paid=True)
    return int(
        Payment.objects.using(alias).create(order_id=order_id, cents=500, message_id=message_id).pk
    )


def payments(alias: str, order_id: int) -> int:
    from tests.django_project.shop.models import Payment

    return int(Payment.objects.using(alias).filter(order_id=order_id).count())


def paid(alias: str, order_id: int) -> bool:
    from tests.django_project.shop.models import Order

    return bool(Order.objects.using(alias).get(pk=order_id).paid)


MODES = [
    pytest.param({"mode": "eager"}, id="eager"),
    pytest.param({"mode": "lazy"}, id="lazy"),
    pytest.param({"mode": "lazy", "check_first": False}, id="lazy-optimistic"),
]


@pytest.mark.parametrize("policy", MODES)
def test_the_rows_and_the_mark_commit_together_and_a_duplicate_writes_nothing(
    alias: str, make_guard: Any, policy: dict[str, Any]
) -> None:
    events = Events()
    guard = make_guard(events=[events], **policy)
    order = new_order(alias)
    first = guard.run("m1", "pay", charge, alias, order.pk, "m1")
    second = guard.run("m1", "pay", charge, alias, order.pk, "m1")
    assert (first.status, second.status) == ("ran", "skipped")
    assert payments(alias, order.pk) == 1 and paid(alias, order.pk)
    record = guard.store.get("pay:m1")
    assert record is not None and record.status.value == "completed"
    assert events.names()[-1] == "duplicate_skipped"


@pytest.mark.parametrize("policy", MODES)
def test_a_handler_that_raises_leaves_no_row_and_no_record(
    alias: str, make_guard: Any, policy: dict[str, Any]
) -> None:
    guard = make_guard(**policy)
    order = new_order(alias)

    def failing() -> None:
        charge(alias, order.pk, "m1")
        raise RuntimeError("the provider said no")

    with pytest.raises(RuntimeError, match="provider said no"):
        guard.run("m1", "pay", failing)
    assert payments(alias, order.pk) == 0 and not paid(alias, order.pk)
    assert guard.store.get("pay:m1") is None  # eager: released, so the retry can run
    assert guard.run("m1", "pay", charge, alias, order.pk, "m1").status == "ran"
    assert payments(alias, order.pk) == 1


def test_a_caught_database_error_without_atomic_commits_nothing_and_says_why(
    alias: str, make_guard: Any
) -> None:
    """Django marks the transaction for rollback when the handler swallows a database error
    inside it: taskonce must not report the run as recorded while Django rolls it back."""
    from django.db import IntegrityError
    from django.db.transaction import TransactionManagementError

    from tests.django_project.shop.models import Order

    guard = make_guard(mode="eager")
    order = new_order(alias)

    def sloppy() -> None:
        charge(alias, order.pk, "m1")
        try:
            Order.objects.using(alias).create(ref=order.ref)  # unique: fails
        except IntegrityError:
            pass  # swallowed, no atomic() of its own

    if alias == "sqlite":
        pytest.skip("SQLite keeps the transaction usable after a constraint error")
    with pytest.raises(TransactionManagementError, match="without an atomic\\(\\) block"):
        guard.run("m1", "pay", sloppy)
    assert payments(alias, order.pk) == 0
    assert guard.store.get("pay:m1") is None  # released: the retry runs it


def test_current_session_names_the_orm_in_a_django_transaction(alias: str, make_guard: Any) -> None:
    guard = make_guard()

    def handler() -> None:
        current_session()

    with pytest.raises(TaskonceError, match="transaction is Django's"):
        guard.run("m1", "pay", handler)


def _in_thread(target: Any) -> Any:
    """Run ``target`` in a thread that closes its Django connections at its end, as Django's
    own request threads do."""

    def run() -> None:
        from django.db import connections

        try:
            target()
        finally:
            connections.close_all()

    return threading.Thread(target=run)


@pytest.mark.parametrize("check_first", [True, False])
def test_two_lazy_copies_at_once_leave_one_payment(
    alias: str, make_guard: Any, check_first: bool
) -> None:
    """Both copies pass the look-up (or make none) and write their Payment; the second mark
    meets the first's, so its transaction rolls back: one Payment, one run reported."""
    events = Events()
    guard = make_guard(events=[events], mode="lazy", check_first=check_first)
    order = new_order(alias)
    # Both bodies start before either writes (both passed the look-up, or made none); the
    # second's UPDATE of the order then waits for the first's transaction (its row lock;
    # SQLite: its write lock), and its mark meets the first's record.
    met = threading.Barrier(2, timeout=30)
    outcomes: list[str] = []
    errors: list[BaseException] = []

    def deliver() -> None:
        def handler() -> None:
            met.wait()
            charge(alias, order.pk, "m1")

        try:
            outcomes.append(guard.execute(Delivery("m1", "pay"), handler).status)
        except BaseException as exc:
            errors.append(exc)

    threads = [_in_thread(deliver) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads) and not errors
    assert sorted(outcomes) == ["ran", "skipped"]
    assert payments(alias, order.pk) == 1
    assert "marked" in events.names()


def test_an_eager_copy_that_lost_its_claim_rolls_its_rows_back(alias: str, make_guard: Any) -> None:
    """Copy A's lease runs out while its body runs; copy B takes the key over and commits.
    A's completion is refused (fenced), so A's Payment rolls back: one Payment."""
    if alias == "sqlite":
        pytest.skip("SQLite holds one write transaction at a time: B would wait for A")
    events = Events()
    guard = make_guard(events=[events], mode="eager", lease=1)
    order = new_order(alias)
    b_done = threading.Event()
    results: dict[str, Any] = {}

    def pay_only(message_id: str) -> None:
        # no UPDATE of the order: B must not wait for A's row lock while A waits for B
        from tests.django_project.shop.models import Payment

        Payment.objects.using(alias).create(order_id=order.pk, cents=500, message_id=message_id)

    def copy_a() -> None:
        def body() -> None:
            pay_only("a")
            assert b_done.wait(30)

        try:
            results["a"] = guard.execute(Delivery("m1", "pay", task="shop.charge"), body).status
        except BaseException as exc:
            results["a"] = exc

    thread = _in_thread(copy_a)
    guard._renewals.heartbeat.watch = lambda *a, **k: 0  # no renewals: the lease must run out
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        record = guard.store.get("pay:m1")
        if record is not None and record.lease_remaining == 0:
            break
        assert time.monotonic() < deadline, "A's claim never ran out"
        time.sleep(0.05)
    results["b"] = guard.execute(
        Delivery("m1", "pay", task="shop.charge"), lambda: pay_only("b")
    ).status
    b_done.set()
    thread.join(60)
    assert results["b"] == "ran"
    assert type(results["a"]).__name__ == "LeaseLost"
    assert payments(alias, order.pk) == 1
    from tests.django_project.shop.models import Payment

    assert Payment.objects.using(alias).get(order_id=order.pk).message_id == "b"
    assert "lease_lost" in events.names() and "lease_taken_over" in events.names()


def test_the_key_inside_and_a_rollback_only_commit_stays_the_handlers_failure(
    alias: str, make_guard: Any
) -> None:
    """``taskonce.current_key()`` inside a handler of the Django app's guard; and, through the
    adapters' :func:`taskonce.action.after`, Django's refusal to commit a transaction the
    handler broke is the handler's failure (``RAISE``), not an internal error of taskonce's
    (which would back off and run it again and again)."""
    import taskonce
    from taskonce.action import Do, after, before

    events = Events()
    guard = make_guard([events], mode="eager")
    assert guard.run("m1", "pay", taskonce.current_key).value == "pay:m1"
    if alias == "sqlite":
        pytest.skip("SQLite keeps the transaction usable after a constraint error")
    from django.db import IntegrityError
    from django.db.transaction import TransactionManagementError

    from tests.django_project.shop.models import Order

    order = new_order(alias)
    action = before(guard, lambda: Delivery("m2", "pay"))
    assert action.do is Do.RUN and action.ticket is not None
    try:
        Order.objects.using(alias).create(ref=order.ref)  # unique: fails, swallowed
    except IntegrityError:
        pass
    done = after(guard, action.ticket, None)
    assert done.do is Do.RAISE and isinstance(done.error, TransactionManagementError)
    assert guard.store.get("pay:m2") is None  # released: the retry runs it
    guard.fail(action.ticket, done.error)  # settled: no second release (once, lease_lost)
    assert [e["event"] for e in events.seen if e["message_id"] == "m2"] == ["claimed", "released"]
