"""The guard: the decision table of docs/how-it-works.md, framework-neutral.

Adapters translate their framework's moments into three calls: :meth:`Guard.begin` before the
handler (it decides: run, skip, defer, or run unguarded), :meth:`Guard.finish` after success
and :meth:`Guard.fail` after an exception. :meth:`Guard.run` chains them for plain Python.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import itertools
import json
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from taskonce import handoff
from taskonce.errors import (
    ConfigError,
    InProgressElsewhere,
    InvalidInput,
    LeaseLost,
    PayloadMismatch,
    StoreUnavailable,
)
from taskonce.events import EventSink, LoggingEvents, make_event, utc_now_iso, worker_id
from taskonce.handoff import DEFAULT_SEND_LIMIT, Capture, Publisher, Send
from taskonce.heartbeat import Heartbeat
from taskonce.keys import fingerprint, make_key
from taskonce.outage import START_TIMEOUT, StoreHealth, wait_for_store
from taskonce.policy import Policy
from taskonce.session import _current
from taskonce.stores.base import ClaimOutcome, Record, Status, Store, TransactionalStore
from taskonce.worker import Identity, Liveness, identity, identity_text, owner_gone

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

logger = logging.getLogger("taskonce")

T = TypeVar("T")

#: A deferred duplicate is delivered again no sooner than this, even if the lease is nearly out.
MIN_RETRY_AFTER = 0.1
#: A duplicate of a claim that has just begun comes back after this many seconds; of one that
#: has run longer, after about as long as it has run (see Guard._decide_existing).
FIRST_RECHECK = 0.25
#: Attempts at the final write (complete/mark) when the store blips after the handler ran.
_FINAL_WRITE_ATTEMPTS = 3
#: Claims of a key whose dead owner's claim another delivery took over first, before deferring.
_TAKE_OVER_ATTEMPTS = 3
#: Dict overrides applied and kept per guard (Guard.policy_for); the cache starts afresh when full.
_POLICY_CACHE = 1024
#: A deferred duplicate of a live owner's claim comes back this long after the owner's liveness
#: record would lapse, so that it finds the lapse if the owner died meanwhile.
_LAPSE_MARGIN = 0.5


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """What the signs of life say about a claim's owner."""

    dead: bool
    reason: str | None = None  # why it is taken over: "owner_dead" | "owner_silent"
    recovery_s: float | None = None  # seconds from its last liveness write to now
    recheck_in: float | None = None  # when it is alive: judge again after this many seconds


#: Seconds a handler's recorder holds its sends after recording them, to publish them
#: (milliseconds, normally). Short, so that when its worker dies right after the record a
#: redelivery or the relay publishes them within seconds; a recorder still publishing after
#: this may see them published twice, under the same ids (a guarded child drops the second).
RECORDER_HOLD = 10.0

#: A redelivery whose pending sends could not be published, or that found another dispatcher
#: publishing them, comes back after at most this many seconds.
_REDISPATCH_RETRY = 5.0


#: Keys of the producer outbox's records (:func:`taskonce.send_on_commit`) start with this.
OUTBOX_PREFIX = "outbox:"

#: The guards that frameworks registered publishers with, in this process: where
#: :func:`taskonce.send_on_commit` finds its guard when none is named.
_PUBLISHING: weakref.WeakSet[Guard] = weakref.WeakSet()


class _Tokens:
    """Owner tokens: 32 hex digits, a random half drawn once per process and a counter.

    A token only has to differ from every other claim's token (it fences writes; it is no
    secret: whoever can read the store can read it). Drawing all 16 bytes from the OS for
    every claim cost a system call per delivery; a forked child draws its own random half
    before its first token, so parent and child never share one.
    """

    def __init__(self) -> None:
        self._pid = -1
        self._head = ""
        self._count = itertools.count()

    def next(self) -> str:
        pid = os.getpid()
        if pid != self._pid:
            self._head = secrets.token_hex(8)
            self._count = itertools.count()
            self._pid = pid
        return f"{self._head}{next(self._count):016x}"


_owner_tokens = _Tokens()


def publishing_guards() -> list[Guard]:
    """The live guards of this process that a framework registered a publisher with."""
    return list(_PUBLISHING)


@dataclasses.dataclass(frozen=True)
class OutboxRow:
    """One send of the producer outbox, written in an application's transaction.

    :param key: its record's key (``outbox:<uuid>``).
    :param token: the dispatch token it was written with (holding its dispatch lease).
    :param text: the send's JSON text.
    :param verify: read the record back before publishing (it was written inside a savepoint
        that may have been rolled back).
    """

    key: str
    token: str
    text: str
    verify: bool = False


class Decision(str, enum.Enum):
    """What :meth:`Guard.begin` decided for a delivery."""

    RUN = "run"  # claimed (or nothing recorded, lazy): run the handler, then finish or fail
    SKIP = "skip"  # a duplicate: do not run, acknowledge the message
    DEFER = "defer"  # another owner is running it: deliver again after ``retry_after``
    UNGUARDED = "unguarded"  # guard disabled, or store down with fail_open: run without a guard


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One delivery of a message, as an adapter describes it to the guard.

    :param message_id: the Celery task id or Dramatiq message_id.
    :param queue: the canonical queue name (adapters strip framework suffixes).
    :param task: the task or actor name (part of the payload fingerprint).
    :param framework: ``"celery"``, ``"dramatiq"`` or ``"python"``.
    :param attempt: retries so far (0 on the first attempt).
    :param redelivered: the broker's redelivery flag, when it gives one.
    :param override: a per-task Policy or dict of fields, applied over the queue's policy.
    :param deferred: how many times the guard deferred this copy before (the adapters count it
        on the copy they publish again): deferring it again is a re-check, not another
        duplicate, and its ``in_progress_deferred`` event says ``reason: "recheck"``.
    """

    message_id: str
    queue: str
    task: str = ""
    framework: str = "python"
    attempt: int = 0
    redelivered: bool | None = None
    override: Policy | Mapping[str, Any] | None = None
    deferred: int = 0


@dataclasses.dataclass
class Ticket:
    """The guard's handle on one delivery between :meth:`Guard.begin` and finish/fail."""

    delivery: Delivery
    policy: Policy
    decision: Decision
    key: str | None = None
    owner: str | None = None
    fingerprint: str | None = None
    retry_after: float = 0.0
    #: the first execution's result (JSON-decoded) when a duplicate is skipped and it was stored
    stored_result: Any = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    lost: bool = False
    _heartbeat: int | None = None
    _session: Session | None = None
    _session_token: contextvars.Token[Session | None] | None = None
    #: the sends the handler made, captured for the hand-off (RUN with defer_sends)
    capture: Capture | None = None
    _capture_token: contextvars.Token[Capture | None] | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What :meth:`Guard.run` did: ``ran`` (with the handler's ``value``) or ``skipped`` (with
    the first run's stored result as ``value`` when ``store_result`` was on)."""

    status: str  # "ran" | "skipped" | "unguarded"
    value: Any
    key: str | None


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
        if not isinstance(store, Store):
            # The value is not echoed: a store URL may carry a password.
            hint = (
                ": open the store from its URL with taskonce.open_store(url) and pass that"
                if isinstance(store, str)
                else ""
            )
            raise ConfigError(
                f"Guard(store=…) needs a taskonce Store, not {type(store).__name__}{hint}"
            )
        self.store = store
        self.default = Policy().overridden_by(default)
        self.queues: dict[str, Policy] = {}
        for queue, policy in (queues or {}).items():
            if not isinstance(queue, str) or not queue:
                raise ConfigError(
                    f"Guard(queues=…): queue name {queue!r} must be a non-empty string"
                )
            try:
                self.queues[queue] = self.default.overridden_by(policy)
            except ConfigError as exc:
                raise ConfigError(f"policy of queue {queue!r}: {exc}") from exc
        self.sinks: list[EventSink] = [LoggingEvents()]
        for sink in events:
            if not isinstance(sink, EventSink):
                raise ConfigError(f"Guard(events=…): {sink!r} has no emit(event) method")
            self.sinks.append(sink)
        for policy in [self.default, *self.queues.values()]:
            self._check_store_supports(policy)
        self._heartbeat = Heartbeat()
        identity()  # a bad TASKONCE_WORKER_ID is a ConfigError now, not at the first claim
        #: the store's reachability, logged once per change (:class:`~taskonce.outage.StoreHealth`)
        self.health = StoreHealth(store.describe())
        self._liveness = Liveness(store, self.health)
        # A guard dropped without close() stops writing its liveness record: during an outage
        # the failed write's traceback can keep the Liveness alive past its guard.
        weakref.finalize(self, self._liveness.stop)
        if isinstance(send_limit, bool) or not isinstance(send_limit, int) or send_limit < 1:
            raise ConfigError(
                f"Guard(send_limit={send_limit!r}) must be a positive number of bytes"
            )
        if (
            isinstance(dispatch_lease, bool)
            or not isinstance(dispatch_lease, (int, float))
            or not 0 < dispatch_lease < float("inf")
        ):
            raise ConfigError(
                f"Guard(dispatch_lease={dispatch_lease!r}) must be a positive number of seconds"
            )
        self.send_limit = send_limit
        self.dispatch_lease = float(dispatch_lease)
        #: how long whoever records sends holds them to publish them itself (RECORDER_HOLD)
        self.recorder_hold = min(self.dispatch_lease, RECORDER_HOLD)
        self._publishers: dict[str, Publisher] = {}
        self._policies: dict[tuple[str, frozenset[tuple[str, type, Any]]], Policy] = {}
        self._relay_lock = threading.Lock()
        self._relay_thread: tuple[int, threading.Thread, threading.Event] | None = None
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _after_fork_in_child(ref))

    # -- hand-off --------------------------------------------------------------------------

    def register_publisher(self, framework: str, publish: Publisher) -> None:
        """Let the guard publish deferred sends of ``framework`` with ``publish``.

        Adapters call it once (Celery ``setup()``, ``IdempotencyMiddleware``); a second call for
        the same framework replaces the first.
        """
        if not isinstance(framework, str) or not framework:
            raise ConfigError("register_publisher: framework must be a non-empty string")
        if not callable(publish):
            raise ConfigError(f"register_publisher: {publish!r} is not callable")
        self._publishers[framework] = publish
        _PUBLISHING.add(self)

    def frameworks(self) -> tuple[str, ...]:
        """The frameworks whose sends this guard can publish (registered publishers)."""
        return tuple(self._publishers)

    def dispatch_committed(self, rows: Sequence[OutboxRow]) -> int:
        """Publish the sends of outbox records whose transaction just committed, in order, and
        mark each dispatched; the number published. Never raises: a send that could not be
        published (broker down, store blip) stays pending for the relay, whose lease on it is
        let go at once."""
        for row in rows:
            self._outbox_event("sends_deferred", row.key, (row.text,))
        published = 0
        for index, row in enumerate(rows):
            try:
                if (
                    row.verify
                    and not self.store.take_sends(row.key, row.token, self.dispatch_lease).sends
                ):
                    self._outbox_event("sends_discarded", row.key, (row.text,))
                    continue  # rolled back with its savepoint
            except StoreUnavailable:
                logger.warning("could not read outbox record %s back; the relay will", row.key)
                self._let_go((row.key, row.token) for row in rows[index + 1 :])
                break
            if not self._dispatch(row.key, row.token, (row.text,), None):
                self._let_go((row.key, row.token) for row in rows[index + 1 :])
                break
            published += 1
            self._outbox_event("sends_dispatched", row.key, (row.text,))
        return published

    def discard_uncommitted(self, rows: Sequence[OutboxRow]) -> None:
        """Forget outbox records whose transaction rolled back (nothing of them was stored)."""
        for row in rows:
            self._outbox_event("sends_discarded", row.key, (row.text,))

    def _let_go(self, leases: Iterable[tuple[str, str]]) -> None:
        """Release these ``(key, token)`` dispatch leases of sends not published, so that the
        next dispatcher (a redelivery, the relay) may take them at once."""
        for key, token in leases:
            try:
                self.store.take_sends(key, token, 0.0)
            except StoreUnavailable:
                return  # their leases run out instead

    def _outbox_event(self, name: str, key: str, texts: Sequence[str]) -> None:
        """A producer's event: no incoming message, so ``key`` is None; ``message_id`` names the
        outbox record, ``framework`` the sends' framework (one event per framework)."""
        if len(self.sinks) == 1 and not LoggingEvents.wants(name):
            return
        counts: dict[str, int] = {}
        for text in texts:
            framework = Send.from_json(text).framework
            counts[framework] = counts.get(framework, 0) + 1
        for framework, count in counts.items():
            self._send(
                make_event(
                    name,
                    message_id=key,
                    framework=framework,
                    lease_s=self.dispatch_lease,
                    keep_for_s=self.default.keep_for,
                    count=count,
                )
            )

    def relay(self, older_than: float = 10.0, batch: int = 100) -> int:
        """Publish the deferred sends left pending for at least ``older_than`` seconds (a worker
        died between recording an outcome and publishing, and the message never came back).

        Each record is taken under a dispatch lease, so two relays never publish one record's
        sends at the same moment. Returns how many records this call dispatched.
        """
        dispatched = 0
        for key in self.store.pending_sends(older_than, batch):
            token = secrets.token_hex(16)
            lease = self.store.take_sends(key, token, self.dispatch_lease, older_than)
            if not lease.sends:
                continue  # published meanwhile, or another dispatcher holds it
            if self._dispatch(key, token, lease.sends, None):
                dispatched += 1
                if key.startswith(OUTBOX_PREFIX):
                    self._outbox_event("sends_dispatched", key, lease.sends)
                    continue
                self._send(
                    make_event(
                        "sends_dispatched",
                        key=key,
                        lease_s=self.dispatch_lease,
                        count=len(lease.sends),
                    )
                )
        return dispatched

    def start_relay(self, every: float = 30.0, older_than: float | None = None) -> None:
        """Run :meth:`relay` every ``every`` seconds in a daemon thread of this process (one per
        guard and process: a second call does nothing; a forked child starts its own).
        ``every <= 0`` turns it off. ``older_than`` defaults to ``every``."""
        if isinstance(every, bool) or not isinstance(every, (int, float)):
            raise ConfigError(f"start_relay(every={every!r}) must be seconds")
        if every <= 0:
            return
        age = float(every if older_than is None else older_than)
        with self._relay_lock:
            running = self._relay_thread
            if running is not None and running[0] == os.getpid() and running[1].is_alive():
                return
            stop = threading.Event()
            thread = threading.Thread(
                target=self._relay_loop,
                args=(float(every), age, stop),
                name="taskonce-relay",
                daemon=True,
            )
            self._relay_thread = (os.getpid(), thread, stop)
            thread.start()

    def stop_relay(self, timeout: float | None = None) -> None:
        """Stop the sweep :meth:`start_relay` started in this process (waits up to ``timeout``)."""
        with self._relay_lock:
            running, self._relay_thread = self._relay_thread, None
        if running is not None and running[0] == os.getpid():
            running[2].set()
            running[1].join(timeout)

    def _relay_loop(self, every: float, older_than: float, stop: threading.Event) -> None:
        while not stop.wait(every):
            try:
                self.relay(older_than)
            except Exception:  # a sweep that fails (store down) tries again next time
                logger.exception("deferred-send relay sweep failed; trying again in %ss", every)

    def _end_capture(self, ticket: Ticket) -> tuple[str, ...]:
        """Stop capturing for ``ticket``; the JSON texts of what its handler sent."""
        capture = ticket.capture
        if capture is None and ticket._capture_token is None:
            return ()
        ticket.capture = None
        if ticket._capture_token is not None:
            _reset(handoff._capture, ticket._capture_token)
            ticket._capture_token = None
        return () if capture is None else tuple(capture.texts)

    def _dispatch(self, key: str, token: str, texts: Sequence[str], ticket: Ticket | None) -> bool:
        """Publish ``texts`` in order, then mark them dispatched (fenced by ``token``). False
        when a publish failed or the mark was refused: they stay pending for a redelivery or
        the relay (the children's ids are fixed, so their guard drops a second copy)."""
        if not self._publish_all(key, texts):
            self._let_go(((key, token),))
            return False
        try:
            return self.store.dispatched(key, token)
        except StoreUnavailable:
            logger.warning(
                "sends of %s were published but not marked dispatched; they may be published "
                "again (same ids)",
                key,
            )
            if ticket is not None:
                self._emit("store_error", ticket)
            return False

    def _publish_all(self, key: str, texts: Sequence[str]) -> bool:
        """Publish ``texts`` in order through their frameworks' publishers; False at the
        first one that fails (the rest are not tried: order is kept)."""
        with handoff.send_now():  # a publisher must not be captured by an enclosing handler
            for text in texts:
                send = Send.from_json(text)
                publish = self._publishers.get(send.framework)
                if publish is None:
                    logger.error(
                        "no publisher registered for %r sends; %s keeps %d send(s) pending",
                        send.framework,
                        key,
                        len(texts),
                    )
                    return False
                try:
                    publish(send)
                except Exception as exc:
                    logger.warning(
                        "publishing deferred send %s of %s failed (%s: %s); it stays pending for "
                        "a redelivery or the relay",
                        send.id,
                        key,
                        type(exc).__name__,
                        exc,
                    )
                    return False
        return True

    def _redispatch(self, ticket: Ticket) -> bool:
        """A handled message came back with sends pending: publish them. False (decision
        DEFER) when another dispatcher holds them or a publish failed."""
        assert ticket.key is not None
        token = secrets.token_hex(16)
        lease = self.store.take_sends(ticket.key, token, self.dispatch_lease)
        if lease.sends:
            if self._dispatch(ticket.key, token, lease.sends, ticket):
                self._emit("sends_redispatched", ticket, count=len(lease.sends))
                return True
            retry_after = _REDISPATCH_RETRY
        elif lease.retry_after > 0:
            # Usually the recorder itself, publishing right now: look again soon rather than
            # at the end of its lease.
            retry_after = min(lease.retry_after, _REDISPATCH_RETRY)
        else:
            return True  # published meanwhile
        ticket.decision = Decision.DEFER
        ticket.retry_after = max(retry_after, MIN_RETRY_AFTER)
        self._emit("in_progress_deferred", ticket, reason=_recheck(ticket))
        return False

    # -- policies ------------------------------------------------------------------------

    def policy_for(self, queue: str, override: Policy | Mapping[str, Any] | None = None) -> Policy:
        """The policy in force for ``queue``, with a per-task ``override`` applied."""
        if override is None:
            return self.queues.get(queue, self.default)
        if isinstance(override, Policy):
            # A Policy replaces the queue's whole (Policy.overridden_by): nothing to apply or
            # cache. Adapters pass one on every delivery.
            self._check_store_supports(override)
            return override
        cache_key = None
        if isinstance(override, Mapping):
            # A dict override is checked and applied once per (queue, its items); values are
            # told apart by type too, so {"enabled": 1} is refused even after {"enabled": True}.
            try:
                cache_key = (queue, frozenset((k, type(v), v) for k, v in override.items()))
                cached = self._policies.get(cache_key)
            except TypeError:  # an unhashable value: applied each time
                cache_key = cached = None
            if cached is not None:
                return cached
        policy = self.queues.get(queue, self.default).overridden_by(override)
        self._check_store_supports(policy)
        if cache_key is not None:
            if len(self._policies) >= _POLICY_CACHE:
                self._policies.clear()
            self._policies[cache_key] = policy
        return policy

    def _check_store_supports(self, policy: Policy) -> None:
        if policy.transactional and not isinstance(self.store, TransactionalStore):
            raise ConfigError(
                f"Policy.transactional=True needs an SQL store; {self.store.describe()} has no "
                "database transaction to share"
            )

    # -- the three moments -----------------------------------------------------------------

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
        policy = self.policy_for(delivery.queue, delivery.override)
        if not policy.enabled:
            return Ticket(delivery, policy, Decision.UNGUARDED)
        key = make_key(delivery.message_id, delivery.queue, policy.identity)
        fp = fingerprint(delivery.task, args, kwargs or {}) if policy.check_payload else None
        ticket = Ticket(delivery, policy, Decision.RUN, key=key, fingerprint=fp)
        try:
            if policy.mode == "eager":
                self._begin_eager(ticket)
            else:
                self._begin_lazy(ticket)
        except StoreUnavailable as exc:
            self.health.failed(exc)
            self._emit("store_error", ticket)
            if policy.on_store_error == "fail_open":
                logger.warning("store unreachable; running %s unguarded (fail_open)", key)
                ticket.decision = Decision.UNGUARDED
                return ticket
            raise
        self.health.answered()
        if ticket.decision is Decision.RUN:
            if policy.transactional:
                self._open_session(ticket)
            if policy.defer_sends:
                ticket.capture = Capture(key, delivery.task, self.send_limit)
                ticket._capture_token = handoff._capture.set(ticket.capture)
            elif handoff._capture.get() is not None:
                # Guarded inside another guarded handler: this one's policy says publish at once.
                ticket._capture_token = handoff._capture.set(None)
        return ticket

    def _begin_eager(self, ticket: Ticket) -> None:
        assert ticket.key is not None
        key, policy = ticket.key, ticket.policy
        self._liveness.ensure()  # a write only on a process's first claim
        me = identity_text()
        for _ in range(_TAKE_OVER_ATTEMPTS):
            owner = _owner_tokens.next()
            claim = self.store.claim(
                key, owner, policy.lease, policy.keep_for, ticket.fingerprint, me
            )
            if claim.outcome is ClaimOutcome.CLAIMED:
                self._hold(ticket, owner, "claimed")
                return
            if claim.outcome is ClaimOutcome.TAKEN_OVER:
                self._hold(ticket, owner, "lease_taken_over", reason="lease_expired")
                return
            record = claim.record
            assert record is not None
            verdict = None
            if record.status is Status.IN_PROGRESS and not self._mismatch(ticket, record):
                verdict = self._judge_owner(record)
            if verdict is None or not verdict.dead:
                recheck = None if verdict is None else verdict.recheck_in
                self._decide_existing(ticket, record, recheck)
                return
            assert record.owner is not None
            if self.store.take_over(key, record.owner, owner, policy.lease, policy.keep_for, me):
                logger.info("took over %s from %s (%s)", key, record.worker, verdict.reason)
                self._hold(
                    ticket,
                    owner,
                    "lease_taken_over",
                    reason=verdict.reason,
                    recovery_s=verdict.recovery_s,
                )
                return
            # Another delivery took it over (or it completed) first: look again.
        record = self.store.get(key)
        if record is None:
            raise StoreUnavailable(f"claim of {key!r} kept changing hands; try again later")
        self._decide_existing(ticket, record)

    def _hold(
        self,
        ticket: Ticket,
        owner: str,
        event: str,
        reason: str | None = None,
        recovery_s: float | None = None,
    ) -> None:
        """The claim is ours: note it, say so, and keep its lease renewed while it runs."""
        ticket.owner = owner
        self._emit(event, ticket, reason=reason, recovery_s=recovery_s)
        ticket._heartbeat = self._heartbeat.watch(ticket.policy.lease, lambda: self._renew(ticket))

    def _judge_owner(self, record: Record) -> _Verdict | None:
        """Whether the owner of the live claim ``record`` is known dead; None when the claim
        names no worker identity (written by an older version: only its lease decides).

        Dead: it ran on this host and its process is gone, or its liveness record lapsed while
        this process could write its own (during a store outage everyone looks silent).
        """
        owner = Identity.parse(record.worker)
        if owner is None or record.owner is None:
            return None
        assert record.worker is not None
        seen = self.store.seen(record.worker)
        recovery = None if seen is None else round(seen.ago, 3)
        if owner_gone(owner):
            return _Verdict(True, "owner_dead", recovery)
        if seen is not None and seen.remaining > 0:
            return _Verdict(False, recheck_in=seen.remaining + _LAPSE_MARGIN)
        wait = self._liveness.silence_wait()
        if wait > 0:
            return _Verdict(False, recheck_in=wait + _LAPSE_MARGIN)
        return _Verdict(True, "owner_silent", recovery)

    def _begin_lazy(self, ticket: Ticket) -> None:
        assert ticket.key is not None
        if not ticket.policy.check_first:
            return  # optimistic: the key's unique constraint decides at commit (finish)
        record = self.store.get(ticket.key)
        if record is not None:
            self._decide_existing(ticket, record)

    @staticmethod
    def _mismatch(ticket: Ticket, record: Record) -> bool:
        return bool(
            record.fingerprint and ticket.fingerprint and record.fingerprint != ticket.fingerprint
        )

    def _decide_existing(
        self, ticket: Ticket, record: Record, recheck_in: float | None = None
    ) -> None:
        """A live record exists for the key: mismatch, duplicate, or running elsewhere (then
        deferred until its lease runs out, or sooner to ``recheck_in`` its owner's liveness)."""
        assert ticket.key is not None
        if self._mismatch(ticket, record):
            assert record.fingerprint is not None and ticket.fingerprint is not None
            self._emit("payload_mismatch", ticket)
            raise PayloadMismatch(ticket.key, record.fingerprint, ticket.fingerprint)
        if record.status is Status.COMPLETED and record.sends_pending:
            if not self._redispatch(ticket):
                return
        if record.status is Status.COMPLETED or ticket.policy.on_in_progress == "skip":
            ticket.decision = Decision.SKIP
            ticket.stored_result = _decode(record.result)
            self._emit("duplicate_skipped", ticket)
            return
        ticket.decision = Decision.DEFER
        wait = record.lease_remaining
        if recheck_in is not None:
            wait = min(wait, recheck_in)
        # Most claims end long before their lease or their owner's liveness window: come back
        # about as long after as the owner has run so far, so a duplicate of an 18 ms run is
        # settled within a fraction of a second and one of a long run is looked at again at a
        # doubling interval, never later than the lease or the liveness check would. (After a
        # renewal the lease tells less of the run: the interval starts short again.)
        ran = max(0.0, ticket.policy.lease - record.lease_remaining)
        wait = min(wait, max(ran, FIRST_RECHECK))
        ticket.retry_after = max(wait, MIN_RETRY_AFTER)
        self._emit("in_progress_deferred", ticket, reason=_recheck(ticket))

    def finish(self, ticket: Ticket, result: Any = None) -> None:
        """Record a successful run: complete the claim (eager) or write the mark (lazy); in
        transactional mode inside the handler's transaction, then commit.

        Raises :class:`LeaseLost` when another delivery took the claim over meanwhile, and
        :class:`InvalidInput` (after recording the key as handled) when ``store_result`` is on
        and the result is not JSON-serialisable.

        In lazy transactional mode the delivery may turn out to be a duplicate only here (with
        ``check_first=False``, or as one of two copies that both passed the look-up): its
        transaction is rolled back and ``ticket.decision`` becomes ``SKIP`` (or ``DEFER``, see
        :meth:`_rolled_back`); a different payload under the key raises
        :class:`PayloadMismatch`. Adapters look at the decision after this returns. An
        integrity error at the commit (a constraint of the handler's own, checked at commit)
        is raised as the handler's failure.
        """
        if ticket.decision is not Decision.RUN:
            return
        self._stop_heartbeat(ticket)
        sends = self._end_capture(ticket)
        policy = ticket.policy
        key = ticket.key
        assert key is not None
        encoded, encode_error = _encode(result, ticket) if policy.store_result else (None, None)
        # The sends' dispatch token: the claim's owner token (eager), a fresh one (lazy).
        token = ticket.owner or (secrets.token_hex(16) if sends else "")
        # The recorder holds the sends' dispatch lease while it publishes them: a redelivery
        # arriving in between waits instead of publishing them a second time.
        hold = self.recorder_hold
        recorded = False
        # transactional: the mark met the key's record, so the transaction was rolled back
        conflict = False
        try:
            if policy.mode == "eager":
                assert ticket.owner is not None
                owner = ticket.owner
                if ticket._session is not None:
                    session = ticket._session
                    store = self._transactional_store()
                    self._final_write(
                        ticket,
                        lambda: store.complete_in(
                            session, key, owner, policy.keep_for, encoded, sends, hold
                        ),
                    )
                    self._commit(ticket)
                elif sends:
                    self._final_write(
                        ticket,
                        lambda: self.store.complete(
                            key, owner, policy.keep_for, encoded, sends, hold
                        ),
                    )
                else:  # a task that sends nothing calls exactly what it did before the hand-off
                    self._final_write(
                        ticket,
                        lambda: self.store.complete(key, owner, policy.keep_for, encoded),
                    )
                recorded = True
                self._emit("completed", ticket, duration=True)
            else:
                fp = ticket.fingerprint
                if ticket._session is not None:
                    session = ticket._session
                    store = self._transactional_store()
                    wrote = bool(
                        self._final_write(
                            ticket,
                            lambda: store.mark_in(
                                session, key, policy.keep_for, fp, encoded, sends, token, hold
                            ),
                        )
                    )
                    if wrote:
                        self._commit(ticket)
                    # A run that loses at its mark left no effect: it is decided like the
                    # duplicate it is, whether or not the look-up before it ran (a concurrent
                    # copy passes that look-up too). Outside a transaction both runs stand.
                    conflict = not wrote
                elif sends:
                    wrote = bool(
                        self._final_write(
                            ticket,
                            lambda: self.store.mark(
                                key, policy.keep_for, fp, encoded, sends, token, hold
                            ),
                        )
                    )
                else:
                    wrote = bool(
                        self._final_write(
                            ticket, lambda: self.store.mark(key, policy.keep_for, fp, encoded)
                        )
                    )
                recorded = wrote
                if not conflict:
                    self._emit("marked" if wrote else "concurrent_duplicate", ticket, duration=True)
        except LeaseLost:
            if not ticket.lost:
                ticket.lost = True
                self._emit("lease_lost", ticket, duration=True)
            raise
        except StoreUnavailable:
            self._emit("store_error", ticket, duration=True)
            if sends and ticket._session is None:
                # The handler's effects stand but its outcome could not be recorded: its
                # messages leave now, best effort, as they would without the hand-off (a
                # redelivery that runs it again sends them under the same ids).
                recorded = self._publish_all(key, sends)
                if recorded:
                    self._emit("sends_dispatched", ticket, count=len(sends))
            raise
        finally:
            self._close_session(ticket)
            if sends and not recorded:
                self._emit("sends_discarded", ticket, count=len(sends))
        if conflict:
            self._rolled_back(ticket)  # the transaction is gone (closed above): now decide
            return
        if sends:
            self._emit("sends_deferred", ticket, count=len(sends))
            if self._dispatch(key, token, sends, ticket):
                self._emit("sends_dispatched", ticket, count=len(sends))
        if encode_error is not None:
            raise encode_error

    def _rolled_back(self, ticket: Ticket) -> None:
        """A transactional mark met a live record of the key (``check_first=False``, or a
        concurrent copy that passed the look-up too), so the handler's transaction was rolled
        back (its writes and sends gone). Decide now what a look-up would have decided, from
        the record that won: a payload mismatch (raised), a duplicate (``SKIP``,
        ``duplicate_skipped`` with reason ``rolled_back``; its pending sends published, as a
        pre-checked duplicate would) or a claim still in progress (``DEFER``)."""
        assert ticket.key is not None
        try:
            record = self.store.get(ticket.key)
        except StoreUnavailable:
            self._emit("store_error", ticket, duration=True)
            raise
        if record is None:
            # Released or purged between the mark and this read: nothing of this run was
            # committed, so the message must come again (adapters redeliver transactional runs
            # whose commit failed).
            self._emit("store_error", ticket, duration=True)
            raise StoreUnavailable(
                f"the record of {ticket.key!r} that rolled this run back is gone; run it again"
            )
        if self._mismatch(ticket, record):
            assert record.fingerprint is not None and ticket.fingerprint is not None
            self._emit("payload_mismatch", ticket, duration=True)
            raise PayloadMismatch(ticket.key, record.fingerprint, ticket.fingerprint)
        if record.status is Status.COMPLETED and record.sends_pending:
            if not self._redispatch(ticket):
                return  # DEFER: delivered again to publish them
        if record.status is Status.COMPLETED or ticket.policy.on_in_progress == "skip":
            ticket.decision = Decision.SKIP
            ticket.stored_result = _decode(record.result)
            self._emit("duplicate_skipped", ticket, duration=True, reason="rolled_back")
            return
        ticket.decision = Decision.DEFER  # an eager claim of the same key, still running
        ticket.retry_after = max(record.lease_remaining, MIN_RETRY_AFTER)
        self._emit("in_progress_deferred", ticket, duration=True, reason=_recheck(ticket))

    def fail(self, ticket: Ticket, exc: BaseException | None = None) -> None:
        """Undo after the handler raised (including framework retries): roll back the
        transaction and release the claim (eager) so the retry can claim again. Never raises
        over the handler's own exception; problems are logged and emitted."""
        if ticket.decision is not Decision.RUN:
            return
        self._stop_heartbeat(ticket)
        sends = self._end_capture(ticket)
        if sends:
            self._emit("sends_discarded", ticket, count=len(sends))
        self._close_session(ticket)
        if ticket.policy.mode != "eager" or ticket.owner is None:
            return
        assert ticket.key is not None
        try:
            self.store.release(ticket.key, ticket.owner)
        except LeaseLost:
            if not ticket.lost:
                ticket.lost = True
                self._emit("lease_lost", ticket, duration=True)
        except StoreUnavailable:
            logger.warning("could not release %s; its lease will run out instead", ticket.key)
            self._emit("store_error", ticket, duration=True)
        else:
            self._emit("released", ticket, duration=True)

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
        if ticket.decision is Decision.SKIP:
            return Outcome("skipped", ticket.stored_result, ticket.key)
        if ticket.decision is Decision.DEFER:
            assert ticket.key is not None
            raise InProgressElsewhere(ticket.key, ticket.retry_after)
        if ticket.decision is Decision.UNGUARDED:
            return Outcome("unguarded", fn(*args, **kwargs), ticket.key)
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            self.fail(ticket, exc)
            raise
        self.finish(ticket, value)
        return _finished(ticket, value)

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
        """Delete expired marks and dead claims in batches; emits one ``purged`` event."""
        deleted = self.store.purge(batch)
        event = make_event("purged", lease_s=self.default.lease, keep_for_s=self.default.keep_for)
        self._send(event)
        logger.info("purged %d expired record(s) from %s", deleted, self.store.describe())
        pending = len(self.store.pending_sends(0.0, batch))
        if pending:
            logger.warning(
                "%s%d record(s) still have deferred sends pending and are kept, even past their "
                "keep_for, until they are published: is a relay running (taskonce relay)?",
                "at least " if pending >= batch else "",
                pending,
            )
        return deleted

    def close(self) -> None:
        """Stop this guard's threads (liveness record, relay) and close the store."""
        self._liveness.stop()
        self.stop_relay(timeout=5)
        self.store.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_for_store(self, timeout: float = START_TIMEOUT) -> None:
        """Wait up to ``timeout`` seconds for the store to answer one read; adapters call it
        when a worker starts, where an unreachable store is almost always a wrong URL.

        :raises StoreUnavailable: it did not answer in time (the message says so in one line).
        """
        wait_for_store(lambda: self.store.seen(identity_text()), self.store.describe(), timeout)

    # -- internals -----------------------------------------------------------------------

    def _renew(self, ticket: Ticket) -> None:
        assert ticket.key is not None and ticket.owner is not None
        try:
            self.store.renew(ticket.key, ticket.owner, ticket.policy.lease)
        except LeaseLost:
            if ticket._heartbeat is None:
                return  # finish/fail ran meanwhile: the claim is complete, not lost
            ticket.lost = True
            self._emit("lease_lost", ticket, duration=True)
            raise
        except StoreUnavailable:
            # Keep trying: the lease still has two thirds left when a renewal first fails.
            logger.warning("could not renew the lease of %s; will try again", ticket.key)
            return
        self._emit("lease_renewed", ticket)

    def _stop_heartbeat(self, ticket: Ticket) -> None:
        if ticket._heartbeat is not None:
            self._heartbeat.unwatch(ticket._heartbeat)
            ticket._heartbeat = None

    def _final_write(self, ticket: Ticket, write: Callable[[], T]) -> T:
        # The handler has run: a passing store blip must not turn success into a re-run.
        # A retry after a timed-out write cannot tell "my first write landed" from "someone
        # else's did" by the write's answer alone, so it asks the store what is recorded.
        assert ticket.key is not None
        for attempt in range(_FINAL_WRITE_ATTEMPTS):
            try:
                answer = write()
            except StoreUnavailable:
                if attempt == _FINAL_WRITE_ATTEMPTS - 1 or ticket._session is not None:
                    raise
                time.sleep(0.2 * (attempt + 1))
                continue
            except LeaseLost:
                if attempt == 0 or not self._landed(ticket):
                    raise
                return True  # type: ignore[return-value]
            if answer is False and attempt > 0 and self._landed(ticket):
                return True  # type: ignore[return-value]
            return answer
        raise AssertionError("unreachable")

    def _landed(self, ticket: Ticket) -> bool:
        assert ticket.key is not None
        record = self.store.get(ticket.key)
        return (
            record is not None
            and record.status is Status.COMPLETED
            and record.fingerprint == ticket.fingerprint
        )

    def _transactional_store(self) -> TransactionalStore:
        # Policies with transactional=True are refused for other stores (_check_store_supports).
        assert isinstance(self.store, TransactionalStore)
        return self.store

    def _open_session(self, ticket: Ticket) -> None:
        try:
            session: Session = self._transactional_store().open_session()
        except StoreUnavailable:
            self.fail(ticket)
            raise
        ticket._session = session
        ticket._session_token = _current.set(session)

    def _commit(self, ticket: Ticket) -> None:
        """Commit the handler's transaction. A mark that meets the key shows at its insert
        (which inserts only when absent), never here: an integrity error at the commit is the
        handler's own (a constraint checked at commit) and is raised as its failure, after
        rolling back."""
        from sqlalchemy.exc import IntegrityError, OperationalError

        assert ticket._session is not None
        try:
            ticket._session.commit()
        except IntegrityError:
            ticket._session.rollback()
            raise
        except OperationalError as exc:
            ticket._session.rollback()
            raise StoreUnavailable(f"commit of {ticket.key!r} failed: {exc.orig}") from exc

    def _close_session(self, ticket: Ticket) -> None:
        session = ticket._session
        if session is None:
            return
        ticket._session = None
        try:
            session.close()  # rolls back whatever was not committed
        finally:
            if ticket._session_token is not None:
                _reset(_current, ticket._session_token)
                ticket._session_token = None

    def _emit(
        self,
        name: str,
        ticket: Ticket,
        duration: bool = False,
        reason: str | None = None,
        recovery_s: float | None = None,
        count: int | None = None,
    ) -> None:
        # Runs several times per delivery: skip the work when nobody would see the event.
        if len(self.sinks) == 1 and not LoggingEvents.wants(name):
            return
        delivery, policy = ticket.delivery, ticket.policy
        event = {  # exactly events.FIELDS, in order (test_guard checks)
            "ts": utc_now_iso(),
            "event": name,
            "key": ticket.key,
            "queue": delivery.queue,
            "message_id": delivery.message_id,
            "task": delivery.task,
            "framework": delivery.framework,
            "mode": policy.mode,
            "worker": worker_id(),
            "attempt": delivery.attempt,
            "redelivered": delivery.redelivered,
            "duration_ms": (
                round((time.monotonic() - ticket.started) * 1000, 3) if duration else None
            ),
            "lease_s": policy.lease,
            "keep_for_s": policy.keep_for,
            "reason": reason,
            "recovery_s": recovery_s,
            "count": count,
        }
        self._send(event)

    def _send(self, event: dict[str, Any]) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:  # an event sink must never change a delivery's outcome
                logger.exception("event sink %r failed", sink)


def _after_fork_in_child(ref: weakref.ReferenceType[Guard]) -> None:
    # The parent's relay thread does not exist here, and it may have held the lock.
    guard = ref()
    if guard is not None:
        guard._relay_lock = threading.Lock()
        guard._relay_thread = None


def _recheck(ticket: Ticket) -> str | None:
    """``"recheck"`` when the delivery is a copy the guard deferred before: the audit counts
    a copy deferred again and again as one duplicate, not one per deferral."""
    return "recheck" if ticket.delivery.deferred > 0 else None


def _reset(var: contextvars.ContextVar[Any], token: contextvars.Token[Any]) -> None:
    """Undo a ticket's ``var.set``; from another context (a different thread's hook) its
    token does not apply, so the variable is cleared there instead."""
    try:
        var.reset(token)
    except ValueError:
        var.set(None)


def _finished(ticket: Ticket, value: Any) -> Outcome:
    """The outcome of a delivery whose handler ran and was finished: in lazy transactional mode
    :meth:`Guard.finish` may have found it a duplicate and rolled it back."""
    if ticket.decision is Decision.SKIP:
        return Outcome("skipped", ticket.stored_result, ticket.key)
    if ticket.decision is Decision.DEFER:
        assert ticket.key is not None
        raise InProgressElsewhere(ticket.key, ticket.retry_after)
    return Outcome("ran", value, ticket.key)


def _encode(result: Any, ticket: Ticket) -> tuple[str | None, InvalidInput | None]:
    try:
        return json.dumps(result, separators=(",", ":"), allow_nan=False), None
    except (TypeError, ValueError) as exc:
        return None, InvalidInput(
            f"result of task {ticket.delivery.task!r} for key {ticket.key!r} is not "
            f"JSON-serialisable ({exc}); store_result=True keeps JSON only. The key was recorded "
            "as handled without a result."
        )


def _decode(text: str | None) -> Any:
    return None if text is None else json.loads(text)
