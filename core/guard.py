"""The guard: the state machine of docs/how-it-works.md, framework-neutral.

Adapters translate their framework's moments into three calls: :meth:`Guard.begin` before the
handler (it decides: run, skip, defer, or run unguarded), :meth:`Guard.finish` after success
and :meth:`Guard.fail` after an exception; :mod:`taskonce.action` turns the answers into one
:class:`~taskonce.action.Action` that each adapter maps onto its framework. :meth:`Guard.run`
chains the three calls for plain Python.

Every decision about a key that is already recorded is :meth:`Guard._decide`'s. Publishing
what a handler sent is :mod:`taskonce.dispatch`'s, the periodic sweep :mod:`taskonce.relay`'s,
the producer outbox :mod:`taskonce.outbox`'s.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from taskonce import quarantine, worker
from taskonce.current import run_as
from taskonce.dispatch import RECORDER_LEASE, Dispatcher
from taskonce.errors import (
    ConfigError,
    InProgressElsewhere,
    PayloadMismatch,
    StoreUnavailable,
)
from taskonce.events import Event, EventSink, LoggingEvents, Sinks, make_event
from taskonce.handoff import (
    DEFAULT_SEND_LIMIT,
    Publisher,
    check_send_limit,
    end_capture,
    start_capture,
)
from taskonce.heartbeat import Renewals
from taskonce.keys import make_key, owner_token, payload_fingerprint
from taskonce.outage import START_TIMEOUT, StoreHealth, store_probe, wait_for_store
from taskonce.outbox import (
    OUTBOX_PREFIX,
    OutboxRow,
    add_publishing_guard,
    discard_uncommitted,
    dispatch_committed,
    publishing_guards,
)
from taskonce.policy import Policies, Policy
from taskonce.record import OutcomeWriter, decode_result, record_run, undo_run
from taskonce.relay import RelayThread
from taskonce.session import close_session, open_session
from taskonce.stores.base import ClaimOutcome, Record, Status, Store
from taskonce.stores.transactional import TransactionalStore
from taskonce.ticket import Decision, Delivery, Outcome, Ticket, emit_event
from taskonce.worker import Liveness, identity, identity_text, judge_owner

logger = logging.getLogger("taskonce")

T = TypeVar("T")

#: A deferred duplicate is delivered again no sooner than this, even if the lease is nearly out.
MIN_RETRY_AFTER = 0.1
#: A duplicate of a claim that has just begun comes back after this many seconds; of one that
#: has run longer, after about as long as it has run (see Guard._decide).
FIRST_RECHECK = 0.25
#: Claims of a key whose dead owner's claim another delivery took over first, before deferring.
_TAKE_OVER_ATTEMPTS = 3


class Guard:
    """Decides, for every delivery, whether its handler runs; records what happened.

    :param store: where claims and marks live (:func:`taskonce.open_store`).
    :param default: the policy of queues not named in ``queues``; default ``Policy()``.
    :param queues: per-queue policies: a :class:`Policy`, or a dict of fields applied over
        ``default``.
    :param events: extra event sinks (e.g. :class:`~taskonce.JsonlEvents`); events always go
        to logging too.
    :param send_limit: the most bytes (JSON) of sends one handler may defer; default 1 MiB.
    :param dispatch_lease: seconds one dispatcher (a redelivery, a relay) holds a record's
        pending sends before another may publish them; default 30.
    """

    def __init__(
        self,
        store: Store,
        default: Policy | Mapping[str, Any] | None = None,
        queues: Mapping[str, Policy | Mapping[str, Any]] | None = None,
        events: Iterable[EventSink] = (),
        *,
        send_limit: int = DEFAULT_SEND_LIMIT,
        dispatch_lease: float = 30.0,
    ) -> None:
        _check_store(store)
        check_send_limit(send_limit)
        self.store = store
        # No bound method: a dropped guard must go by reference counting (its liveness stops).
        self.policies = Policies(default, queues, partial(_check_supports, store))
        self.default = self.policies.default
        self.queues = self.policies.queues
        self.sinks = Sinks([LoggingEvents()])
        for sink in events:
            if not isinstance(sink, EventSink):
                raise ConfigError(f"Guard(events=…): {sink!r} has no emit(event) method")
            self.sinks.append(sink)
        #: ``_emit(event, ticket, **fields)``: the event of a delivery, to the sinks
        self._emit = partial(emit_event, self.sinks)
        self.policies.check_all()
        #: publishes recorded sends (:mod:`taskonce.dispatch`)
        self.dispatcher = Dispatcher(store, self.sinks, dispatch_lease, self.default.keep_for)
        #: keeps running claims' leases renewed (:class:`~taskonce.heartbeat.Renewals`)
        self._renewals = Renewals(store, self._emit)
        identity()  # a bad TASKONCE_WORKER_ID is a ConfigError now, not at the first claim
        #: the store's reachability, logged once per change (:class:`~taskonce.outage.StoreHealth`)
        self.health = StoreHealth(store.describe())
        self._liveness = Liveness(store, self.health)
        # A guard dropped without close() stops writing its liveness record: during an outage
        # the failed write's traceback can keep the Liveness alive past its guard.
        weakref.finalize(self, self._liveness.stop)
        self.send_limit = send_limit
        #: the dispatch lease whoever records sends takes, to publish them itself (RECORDER_LEASE)
        self.recorder_lease = min(self.dispatch_lease, RECORDER_LEASE)
        self._relay = RelayThread()

    @property
    def dispatch_lease(self) -> float:
        """Seconds one dispatcher holds a record's pending sends."""
        return self.dispatcher.lease

    # -- the hand-off and the outbox: delegated --------------------------------------------

    def register_publisher(self, framework: str, publish: Publisher) -> None:
        """Let the guard publish deferred sends of ``framework`` with ``publish``.

        Adapters call it once (Celery ``setup()``, ``IdempotencyMiddleware``); a second call for
        the same framework replaces the first.
        """
        self.dispatcher.register(framework, publish)
        add_publishing_guard(self)

    def frameworks(self) -> tuple[str, ...]:
        """The frameworks whose sends this guard can publish (registered publishers)."""
        return tuple(self.dispatcher.publishers)

    def dispatch_committed(self, rows: Sequence[OutboxRow]) -> int:
        """Publish the sends of outbox records whose transaction just committed
        (:func:`taskonce.outbox.dispatch_committed`); the number published. Never raises."""
        return dispatch_committed(self.dispatcher, rows)

    def discard_uncommitted(self, rows: Sequence[OutboxRow]) -> None:
        """Forget outbox records whose transaction rolled back (nothing of them was stored)."""
        discard_uncommitted(self.dispatcher, rows)

    def relay(self, older_than: float = 10.0, batch: int = 100) -> int:
        """Publish the deferred sends left pending for at least ``older_than`` seconds (a worker
        died between recording an outcome and publishing, and the message never came back).

        Each record is taken under a dispatch lease, so two relays never publish one record's
        sends at the same moment. Returns how many records this call dispatched.
        """
        return self.dispatcher.relay(older_than, batch)

    def start_relay(self, every: float = 30.0, older_than: float | None = None) -> None:
        """Run :meth:`relay` every ``every`` seconds in a daemon thread of this process (one per
        guard and process: a second call does nothing; a forked child starts its own).
        ``every=0`` turns it off. ``older_than`` defaults to ``every``."""
        self._relay.start(self.relay, every, older_than)

    def stop_relay(self, timeout: float | None = None) -> None:
        """Stop the sweep :meth:`start_relay` started in this process (waits up to ``timeout``)."""
        self._relay.stop(timeout)

    def policy_for(self, queue: str, override: Policy | Mapping[str, Any] | None = None) -> Policy:
        """The policy in force for ``queue``, with a per-task ``override`` applied."""
        return self.policies.resolve(queue, override)

    # -- before the handler ----------------------------------------------------------------

    def begin(
        self,
        delivery: Delivery,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Ticket:
        """Decide what to do with a delivery before its handler runs.

        Returns a :class:`Ticket` whose ``decision`` says run, skip, defer or run unguarded.
        Raises :class:`InvalidInput` (no usable id), :class:`PayloadMismatch` (same key,
        different arguments) and, with ``fail_closed``, :class:`StoreUnavailable`.
        """
        self._liveness.start()  # in this process, from its first delivery (not at import)
        policy = self.policy_for(delivery.queue, delivery.override)
        if not policy.enabled:
            return Ticket(delivery, policy, Decision.UNGUARDED)
        key = make_key(delivery.message_id, delivery.queue, policy.identity)
        # A replacement carries the id of the task it replaced, not its payload: no fingerprint,
        # so a late copy of the replaced message is a duplicate, not a mismatch.
        check = policy.check_payload and not delivery.replaced
        fp = payload_fingerprint(delivery, args, kwargs or {}) if check else None
        ticket = Ticket(delivery, policy, Decision.RUN, key=key, fingerprint=fp)
        try:
            if policy.mode == "eager":
                self._begin_eager(ticket)
            else:
                self._begin_lazy(ticket)
        except StoreUnavailable as exc:
            self.health.failed(exc)
            self._emit(Event.STORE_ERROR, ticket)
            if policy.on_store_error == "fail_open":
                logger.warning("store unreachable; running %s unguarded (fail_open)", key)
                ticket.decision = Decision.UNGUARDED
                return ticket
            raise
        if ticket.decision is Decision.RUN:
            if policy.transactional:
                try:
                    open_session(self.store, ticket)
                except Exception:  # unreachable, or failing: the claim is not kept
                    self.fail(ticket)
                    raise
            start_capture(ticket, self.send_limit)
        return ticket

    def _begin_eager(self, ticket: Ticket) -> None:
        assert ticket.key is not None
        key, policy = ticket.key, ticket.policy
        self._liveness.ensure()  # a write only on a process's first claim
        me = identity_text()
        for _ in range(_TAKE_OVER_ATTEMPTS):
            owner = owner_token()
            claim = self.store.claim(
                key, owner, policy.lease, policy.keep_for, ticket.fingerprint, me
            )
            if claim.outcome is ClaimOutcome.CLAIMED:
                self._own_claim(ticket, owner, Event.CLAIMED)
                return
            if claim.outcome is ClaimOutcome.TAKEN_OVER:
                ticket.crashes = claim.crashes
                self._own_claim(ticket, owner, Event.LEASE_TAKEN_OVER, reason="lease_expired")
                return
            record = claim.record
            assert record is not None
            verdict = None
            if record.status is Status.IN_PROGRESS and not self._mismatch(ticket, record):
                verdict = judge_owner(self.store, record, self._liveness)
            if verdict is None or not verdict.dead:
                self._decide(ticket, record, None if verdict is None else verdict.recheck_in)
                return
            assert record.owner is not None
            ticket.crashes = self.store.take_over(
                key, record.owner, owner, policy.lease, policy.keep_for, me
            )
            if ticket.crashes:
                logger.info("took over %s from %s (%s)", key, record.worker, verdict.reason)
                self._own_claim(
                    ticket, owner, Event.LEASE_TAKEN_OVER, verdict.reason, verdict.recovery_s
                )
                return
            # Another delivery took it over (or it completed) first: look again.
        record = self.store.get(key)
        if record is None:
            raise StoreUnavailable(f"claim of {key!r} kept changing hands; try again later")
        self._decide(ticket, record)

    def _own_claim(
        self,
        ticket: Ticket,
        owner: str,
        event: Event,
        reason: str | None = None,
        recovery_s: float | None = None,
    ) -> None:
        """The claim is ours: note it, say so, and keep its lease renewed while it runs."""
        ticket.owner = owner
        quarantine.check(self.store, ticket, owner, self._emit, reason)  # past crash_limit: raises
        self._emit(event, ticket, reason=reason, recovery_s=recovery_s)
        self._renewals.start(ticket)

    def _begin_lazy(self, ticket: Ticket) -> None:
        assert ticket.key is not None
        if not ticket.policy.check_first:
            return  # optimistic: the key's unique constraint decides at commit (finish)
        record = self.store.get(ticket.key)
        if record is not None:
            self._decide(ticket, record)

    @staticmethod
    def _mismatch(ticket: Ticket, record: Record) -> bool:
        return bool(
            record.fingerprint and ticket.fingerprint and record.fingerprint != ticket.fingerprint
        )

    # -- the decision ------------------------------------------------------------------------

    def _decide(
        self,
        ticket: Ticket,
        record: Record,
        recheck_in: float | None = None,
        rolled_back: bool = False,
    ) -> None:
        """The key has a live ``record``: decide, for a delivery looked up before its handler
        ran or (``rolled_back``) one whose transactional mark met the record after it ran.

        A different payload raises :class:`PayloadMismatch`; a handled record (or a claim,
        with ``on_in_progress="skip"``) is a duplicate: ``SKIP``, after publishing its pending
        sends (``DEFER`` when another dispatcher holds them); a claim in progress is ``DEFER``:
        delivered again about as long after as its owner has run so far, never later than its
        lease or ``recheck_in`` (its owner's liveness). After a run the events carry its
        duration, and the deferral waits for the lease.
        """
        assert ticket.key is not None
        if self._mismatch(ticket, record):
            assert record.fingerprint is not None and ticket.fingerprint is not None
            self._emit(Event.PAYLOAD_MISMATCH, ticket, duration=rolled_back)
            raise PayloadMismatch(ticket.key, record.fingerprint, ticket.fingerprint)
        if record.status is Status.COMPLETED and record.sends_pending:
            if not self._redispatch(ticket):
                return
        if record.status is not Status.IN_PROGRESS or ticket.policy.on_in_progress == "skip":
            ticket.decision = Decision.SKIP
            ticket.stored_result = decode_result(record.result)
            reason = "rolled_back" if rolled_back else quarantine.skip_reason(record)
            self._emit(Event.DUPLICATE_SKIPPED, ticket, duration=rolled_back, reason=reason)
            return
        ticket.decision = Decision.DEFER
        wait = record.lease_remaining
        if not rolled_back:
            if recheck_in is not None:
                wait = min(wait, recheck_in)
            # Most claims end long before their lease or their owner's liveness window: come
            # back about as long after as the owner has run so far, so a duplicate of an 18 ms
            # run is settled within a fraction of a second and one of a long run is looked at
            # again at a doubling interval. (After a renewal the lease tells less of the run:
            # the interval starts short again.)
            ran = max(0.0, ticket.policy.lease - record.lease_remaining)
            wait = min(wait, max(ran, FIRST_RECHECK))
        ticket.retry_after = max(wait, MIN_RETRY_AFTER)
        self._emit(Event.IN_PROGRESS_DEFERRED, ticket, duration=rolled_back, reason=ticket.recheck)

    def _redispatch(self, ticket: Ticket) -> bool:
        """A handled message came back with sends pending: publish them. False (decision
        DEFER) when another dispatcher holds them or a publish failed."""
        assert ticket.key is not None
        published, retry_after = self.dispatcher.redispatch(
            ticket.key, lambda: self._emit(Event.STORE_ERROR, ticket)
        )
        if published:
            self._emit(Event.SENDS_REDISPATCHED, ticket, count=published)
            return True
        if not retry_after:
            return True  # published meanwhile
        ticket.decision = Decision.DEFER
        ticket.retry_after = max(retry_after, MIN_RETRY_AFTER)
        self._emit(Event.IN_PROGRESS_DEFERRED, ticket, reason=ticket.recheck)
        return False

    # -- after the handler -----------------------------------------------------------------

    def finish(self, ticket: Ticket, result: Any = None) -> None:
        """Record a successful run: complete the claim (eager) or write the mark (lazy); in
        transactional mode inside the handler's transaction, then commit. Then publish what
        the handler sent (:func:`taskonce.record.record_run`).

        Raises :class:`LeaseLost` when another delivery took the claim over meanwhile, and
        :class:`InvalidInput` (after recording the key as handled) when ``store_result`` is on
        and the result is not JSON-serialisable.

        In lazy transactional mode the delivery may turn out to be a duplicate only here (with
        ``check_first=False``, or as one of two copies that both passed the look-up): its
        transaction is rolled back and ``ticket.decision`` becomes ``SKIP`` (or ``DEFER``, see
        :meth:`_decide`); a different payload under the key raises :class:`PayloadMismatch`.
        Adapters look at the decision after this returns. A commit failing on the handler's
        account (a deferred constraint; Django's rollback-only transaction) is its failure.

        Whatever happens, the ticket is settled here (:attr:`Ticket.settled`): a transactional
        run that could not commit is rolled back and its claim released, once, before the
        error is raised; :meth:`fail` after this does nothing.
        """
        if ticket.decision is not Decision.RUN or ticket.settled:
            return
        ticket.settled = True
        self._renewals.stop(ticket)
        writer = OutcomeWriter(self.store, self.dispatcher, self.recorder_lease, self._emit)
        met = record_run(writer, ticket, result)
        if met is not None:  # the mark met a live record (transaction rolled back)
            self._decide(ticket, met, rolled_back=True)

    def fail(self, ticket: Ticket, exc: BaseException | None = None) -> None:
        """Undo after the handler raised (including framework retries): roll back the
        transaction and release the claim (eager) so the retry can claim again. Never raises
        over the handler's own exception; problems are logged and emitted.

        A settled ticket (:attr:`Ticket.settled`: :meth:`finish` or ``fail`` ran for it) is
        left alone: its claim was recorded, lost or released already."""
        if ticket.decision is not Decision.RUN or ticket.settled:
            return
        ticket.settled = True
        self._renewals.stop(ticket)
        sends = end_capture(ticket)
        if sends:
            self._emit(Event.SENDS_DISCARDED, ticket, count=len(sends))
        close_session(ticket)
        undo_run(self.store, ticket, self._emit)

    # -- plain Python entry points ---------------------------------------------------------

    def execute(
        self,
        delivery: Delivery,
        fn: Callable[..., T],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Outcome:
        """Run ``fn(*args, **kwargs)`` under the guard for ``delivery``.

        A duplicate returns ``Outcome("skipped", stored_result, key)``; a delivery that is in
        progress elsewhere raises :class:`InProgressElsewhere` (with ``on_in_progress="retry"``).
        """
        kwargs = kwargs or {}
        ticket = self.begin(delivery, args, kwargs)
        value = None
        if ticket.decision is Decision.UNGUARDED:
            return Outcome("unguarded", run_as(ticket.key, fn, args, kwargs), ticket.key)
        if ticket.decision is Decision.RUN:
            try:
                value = run_as(ticket.key, fn, args, kwargs)
            except BaseException as exc:
                self.fail(ticket, exc)
                raise
            self.finish(ticket, value)
        # In lazy transactional mode finish may have found it a duplicate and rolled it back.
        if ticket.decision is Decision.SKIP:
            return Outcome("skipped", ticket.stored_result, ticket.key)
        if ticket.decision is Decision.DEFER:
            assert ticket.key is not None
            raise InProgressElsewhere(ticket.key, ticket.retry_after)
        return Outcome("ran", value, ticket.key)

    def run(
        self, message_id: str, queue: str, fn: Callable[..., T], *args: Any, **kwargs: Any
    ) -> Outcome:
        """Framework-neutral entry point: ``fn(*args, **kwargs)`` once per ``(queue, message_id)``.

        The task name in the fingerprint is ``fn``'s qualified name.
        """
        named = fn if hasattr(fn, "__qualname__") else type(fn)
        task = f"{named.__module__}.{named.__qualname__}"
        return self.execute(Delivery(message_id, queue, task=task), fn, args, kwargs)

    def purge(self, batch: int = 1000) -> int:
        """Delete expired marks and dead claims in batches; emits one ``purged`` event (its
        ``count``: the records deleted; ``reason``: ``expired``)."""
        deleted = self.store.purge(batch)
        event = make_event(
            Event.PURGED,
            lease_s=self.default.lease,
            keep_for_s=self.default.keep_for,
            count=deleted,
            reason="expired",
        )
        self.sinks.send(event)
        logger.info("purged %d expired record(s) from %s", deleted, self.store.describe())
        self.dispatcher.warn_pending(batch)
        return deleted

    def close(self) -> None:
        """Stop this guard's threads (liveness record, lease renewals, relay) and close the
        store."""
        live = self._liveness  # waited for, unless it is a stand-in (tests)
        live.stop(timeout=5) if isinstance(live, worker.Liveness) else live.stop()
        self._renewals.close(timeout=5)
        self.stop_relay(timeout=5)
        self.store.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_store(self, timeout: float = START_TIMEOUT) -> None:
        """Wait up to ``timeout`` s for the store to answer one read (adapters call it as a
        worker starts, where no answer is almost always a wrong URL): :class:`StoreUnavailable`
        in one line, or :class:`ConfigError` if it answers unready (:meth:`Store.check_ready`)."""
        wait_for_store(store_probe(self.store, identity_text()), self.store.describe(), timeout)
        self._liveness.start()  # a worker writes its record from its start


def _check_supports(store: Store, policy: Policy) -> None:
    if policy.transactional and not isinstance(store, TransactionalStore):
        raise ConfigError(
            f"Policy.transactional=True needs an SQL store; {store.describe()} has no "
            "database transaction to share"
        )


def _check_store(store: object) -> None:
    if not isinstance(store, Store):  # the value is not echoed: a URL may carry a password
        hint = ": open the store from its URL with taskonce.open_store(url) and pass that"
        hint = hint if isinstance(store, str) else ""
        raise ConfigError(
            f"Guard(store=…) needs a taskonce Store, not {type(store).__name__}{hint}"
        )


__all__ = [
    "FIRST_RECHECK",
    "MIN_RETRY_AFTER",
    "OUTBOX_PREFIX",
    "RECORDER_LEASE",
    "Decision",
    "Delivery",
    "Guard",
    "OutboxRow",
    "Outcome",
    "Ticket",
    "publishing_guards",
]
