"""The guard: the decision table of DESIGN.md, framework-neutral.

Adapters translate their framework's moments into three calls: :meth:`Guard.begin` before the
handler (it decides: run, skip, defer, or run unguarded), :meth:`Guard.finish` after success
and :meth:`Guard.fail` after an exception. :meth:`Guard.run` chains them for plain Python.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from taskonce.errors import (
    ConfigError,
    InProgressElsewhere,
    InvalidInput,
    LeaseLost,
    PayloadMismatch,
    StoreUnavailable,
)
from taskonce.events import EventSink, LoggingEvents, make_event, utc_now_iso, worker_id
from taskonce.heartbeat import Heartbeat
from taskonce.keys import fingerprint, make_key
from taskonce.policy import Policy
from taskonce.session import _current
from taskonce.stores.base import ClaimOutcome, Record, Status, Store

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

logger = logging.getLogger("taskonce")

T = TypeVar("T")

#: A deferred duplicate is delivered again no sooner than this, even if the lease is nearly out.
MIN_RETRY_AFTER = 0.1
#: Attempts at the final write (complete/mark) when the store blips after the handler ran.
_FINAL_WRITE_ATTEMPTS = 3


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
    """

    message_id: str
    queue: str
    task: str = ""
    framework: str = "python"
    attempt: int = 0
    redelivered: bool | None = None
    override: Policy | Mapping[str, Any] | None = None


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
    """

    def __init__(
        self,
        store: Store,
        default: Policy | Mapping[str, Any] | None = None,
        queues: Mapping[str, Policy | Mapping[str, Any]] | None = None,
        events: Iterable[EventSink] = (),
    ) -> None:
        if not isinstance(store, Store):
            raise ConfigError(f"Guard(store=…) needs a taskonce Store, not {type(store).__name__}")
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

    # -- policies ------------------------------------------------------------------------

    def policy_for(self, queue: str, override: Policy | Mapping[str, Any] | None = None) -> Policy:
        """The policy in force for ``queue``, with a per-task ``override`` applied."""
        policy = self.queues.get(queue, self.default).overridden_by(override)
        if override is not None:
            self._check_store_supports(policy)
        return policy

    def _check_store_supports(self, policy: Policy) -> None:
        if policy.transactional and not hasattr(self.store, "open_session"):
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
        except StoreUnavailable:
            self._emit("store_error", ticket)
            if policy.on_store_error == "fail_open":
                logger.warning("store unreachable; running %s unguarded (fail_open)", key)
                ticket.decision = Decision.UNGUARDED
                return ticket
            raise
        if ticket.decision is Decision.RUN and policy.transactional:
            self._open_session(ticket)
        return ticket

    def _begin_eager(self, ticket: Ticket) -> None:
        assert ticket.key is not None
        policy = ticket.policy
        owner = secrets.token_hex(16)
        claim = self.store.claim(
            ticket.key, owner, policy.lease, policy.keep_for, ticket.fingerprint
        )
        if claim.outcome is ClaimOutcome.EXISTS:
            assert claim.record is not None
            self._decide_existing(ticket, claim.record)
            return
        ticket.owner = owner
        self._emit(
            "claimed" if claim.outcome is ClaimOutcome.CLAIMED else "lease_taken_over", ticket
        )
        ticket._heartbeat = self._heartbeat.watch(policy.lease, lambda: self._renew(ticket))

    def _begin_lazy(self, ticket: Ticket) -> None:
        assert ticket.key is not None
        record = self.store.get(ticket.key)
        if record is not None:
            self._decide_existing(ticket, record)

    def _decide_existing(self, ticket: Ticket, record: Record) -> None:
        """A live record exists for the key: mismatch, duplicate, or running elsewhere."""
        assert ticket.key is not None
        if record.fingerprint and ticket.fingerprint and record.fingerprint != ticket.fingerprint:
            self._emit("payload_mismatch", ticket)
            raise PayloadMismatch(ticket.key, record.fingerprint, ticket.fingerprint)
        if record.status is Status.COMPLETED or ticket.policy.on_in_progress == "skip":
            ticket.decision = Decision.SKIP
            ticket.stored_result = _decode(record.result)
            self._emit("duplicate_skipped", ticket)
            return
        ticket.decision = Decision.DEFER
        ticket.retry_after = max(record.lease_remaining, MIN_RETRY_AFTER)
        self._emit("in_progress_deferred", ticket)

    def finish(self, ticket: Ticket, result: Any = None) -> None:
        """Record a successful run: complete the claim (eager) or write the mark (lazy); in
        transactional mode inside the handler's transaction, then commit.

        Raises :class:`LeaseLost` when another delivery took the claim over meanwhile, and
        :class:`InvalidInput` (after recording the key as handled) when ``store_result`` is on
        and the result is not JSON-serialisable.
        """
        if ticket.decision is not Decision.RUN:
            return
        self._stop_heartbeat(ticket)
        policy = ticket.policy
        key = ticket.key
        assert key is not None
        encoded, encode_error = _encode(result, ticket) if policy.store_result else (None, None)
        try:
            if policy.mode == "eager":
                assert ticket.owner is not None
                owner = ticket.owner
                if ticket._session is not None:
                    session = ticket._session
                    self._final_write(
                        ticket,
                        lambda: self.store.complete_in(  # type: ignore[attr-defined]
                            session, key, owner, policy.keep_for, encoded
                        ),
                    )
                    self._commit(ticket)
                else:
                    self._final_write(
                        ticket,
                        lambda: self.store.complete(key, owner, policy.keep_for, encoded),
                    )
                self._emit("completed", ticket, duration=True)
            else:
                if ticket._session is not None:
                    session = ticket._session
                    wrote = self._final_write(
                        ticket,
                        lambda: self.store.mark_in(  # type: ignore[attr-defined]
                            session, key, policy.keep_for, ticket.fingerprint, encoded
                        ),
                    )
                    wrote = bool(wrote) and self._commit(ticket, duplicate_ok=True)
                else:
                    wrote = bool(
                        self._final_write(
                            ticket,
                            lambda: self.store.mark(
                                key, policy.keep_for, ticket.fingerprint, encoded
                            ),
                        )
                    )
                self._emit("marked" if wrote else "concurrent_duplicate", ticket, duration=True)
        except LeaseLost:
            if not ticket.lost:
                ticket.lost = True
                self._emit("lease_lost", ticket, duration=True)
            raise
        except StoreUnavailable:
            self._emit("store_error", ticket, duration=True)
            raise
        finally:
            self._close_session(ticket)
        if encode_error is not None:
            raise encode_error

    def fail(self, ticket: Ticket, exc: BaseException | None = None) -> None:
        """Undo after the handler raised (including framework retries): roll back the
        transaction and release the claim (eager) so the retry can claim again. Never raises
        over the handler's own exception; problems are logged and emitted."""
        if ticket.decision is not Decision.RUN:
            return
        self._stop_heartbeat(ticket)
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
        """Delete expired marks and dead claims in batches; emits one ``purged`` event."""
        deleted = self.store.purge(batch)
        event = make_event("purged", lease_s=self.default.lease, keep_for_s=self.default.keep_for)
        self._send(event)
        logger.info("purged %d expired record(s) from %s", deleted, self.store.describe())
        return deleted

    def close(self) -> None:
        """Close the store."""
        self.store.close()

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

    def _open_session(self, ticket: Ticket) -> None:
        try:
            session: Session = self.store.open_session()  # type: ignore[attr-defined]
        except StoreUnavailable:
            self.fail(ticket)
            raise
        ticket._session = session
        ticket._session_token = _current.set(session)

    def _commit(self, ticket: Ticket, duplicate_ok: bool = False) -> bool:
        """Commit the handler's transaction; False when a concurrent duplicate's unique key
        made it fail (``duplicate_ok``), after rolling back."""
        from sqlalchemy.exc import IntegrityError, OperationalError

        assert ticket._session is not None
        try:
            ticket._session.commit()
        except IntegrityError:
            ticket._session.rollback()
            if duplicate_ok:
                return False
            raise
        except OperationalError as exc:
            ticket._session.rollback()
            raise StoreUnavailable(f"commit of {ticket.key!r} failed: {exc.orig}") from exc
        return True

    def _close_session(self, ticket: Ticket) -> None:
        session = ticket._session
        if session is None:
            return
        ticket._session = None
        try:
            session.close()  # rolls back whatever was not committed
        finally:
            if ticket._session_token is not None:
                try:
                    _current.reset(ticket._session_token)
                except ValueError:  # reset from another context (a different thread's hook)
                    _current.set(None)
                ticket._session_token = None

    def _emit(self, name: str, ticket: Ticket, duration: bool = False) -> None:
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
        }
        self._send(event)

    def _send(self, event: dict[str, Any]) -> None:
        for sink in self.sinks:
            try:
                sink.emit(event)
            except Exception:  # an event sink must never change a delivery's outcome
                logger.exception("event sink %r failed", sink)


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
