"""What the guard and an adapter pass between them for one delivery: the :class:`Delivery` an
adapter describes, the :class:`Decision` the guard takes, the :class:`Ticket` that carries
both from :meth:`~taskonce.Guard.begin` to finish or fail, and the :class:`Outcome` of
:meth:`~taskonce.Guard.run`."""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from taskonce.events import Event, Sinks, utc_now_iso, worker_id
from taskonce.policy import Policy

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from taskonce.handoff import Capture
    from taskonce.keys import PayloadEncoder


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
    :param replaced: how deeply this message replaces an earlier task of the same id (Celery's
        ``self.replace()``; 0 for a message that replaces nothing): the ids of its sends derive
        from its key *and* this, so they never collide with those of the task it replaced
        (:func:`taskonce.handoff.id_base`).
    :param store_errors: how many times in a row this message was put back because the store
        could not be used (the adapters count it on the copy they publish again): the next
        back-off is longer (:class:`taskonce.outage.Backoff`).
    :param encode_payload: the framework's encoding of ``(task, args, kwargs)`` that the payload
        fingerprint hashes (Celery's serializer, Dramatiq's encoder); None: canonical JSON.
    """

    message_id: str
    queue: str
    task: str = ""
    framework: str = "python"
    attempt: int = 0
    redelivered: bool | None = None
    override: Policy | Mapping[str, Any] | None = None
    deferred: int = 0
    replaced: int = 0
    store_errors: int = 0
    encode_payload: PayloadEncoder | None = None


@dataclasses.dataclass
class Ticket:
    """The guard's handle on one delivery between :meth:`Guard.begin` and finish/fail; once
    either has run it is :attr:`settled`."""

    delivery: Delivery
    policy: Policy
    decision: Decision
    key: str | None = None
    owner: str | None = None
    fingerprint: str | None = None
    retry_after: float = 0.0
    #: a take-over's count of the key's take-overs from dead owners (:mod:`taskonce.quarantine`)
    crashes: int = 0
    #: the first execution's result (JSON-decoded) when a duplicate is skipped and it was stored
    stored_result: Any = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    lost: bool = False
    #: the run's outcome is settled: :meth:`Guard.finish` recorded it (or found it lost, a
    #: duplicate, or rolled back and released its claim) or :meth:`Guard.fail` undid it. Both
    #: do nothing on a settled ticket: its claim is released at most once, and a second
    #: release never reports a lease nobody lost (``lease_lost``).
    settled: bool = False
    # What the run holds while it runs, set and cleared by the modules that own each: the
    # guard's lease renewal, taskonce.session's transaction, taskonce.handoff's capture.
    #: the :class:`~taskonce.heartbeat.Heartbeat` handle renewing the claim's lease; None once
    #: finish or fail stopped it (a renewal that meets a lost lease then reports nothing)
    renewal: int | None = dataclasses.field(default=None, repr=False)
    #: the transactional run's session (:func:`taskonce.current_session`); None outside one
    session: Session | None = dataclasses.field(default=None, repr=False)
    session_token: contextvars.Token[Session | None] | None = dataclasses.field(
        default=None, repr=False
    )
    #: the sends the handler made, captured for the hand-off (RUN with defer_sends)
    capture: Capture | None = None
    capture_token: contextvars.Token[Capture | None] | None = dataclasses.field(
        default=None, repr=False
    )

    @property
    def recheck(self) -> str | None:
        """``"recheck"`` when the delivery is a copy the guard deferred before (the reason of
        its ``in_progress_deferred``): the audit counts a copy deferred again and again as one
        duplicate, not one per deferral."""
        return "recheck" if self.delivery.deferred > 0 else None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What :meth:`Guard.run` did: ``ran`` (with the handler's ``value``) or ``skipped`` (with
    the first run's stored result as ``value`` when ``store_result`` was on)."""

    status: str  # "ran" | "skipped" | "unguarded"
    value: Any
    key: str | None


def reset_var(var: contextvars.ContextVar[Any], token: contextvars.Token[Any]) -> None:
    """Undo a ticket's ``var.set``; from another context (a different thread's hook) its
    token does not apply, so the variable is cleared there instead."""
    try:
        var.reset(token)
    except ValueError:
        var.set(None)


def ticket_event(
    name: Event,
    ticket: Ticket,
    duration: bool = False,
    reason: str | None = None,
    recovery_s: float | None = None,
    count: int | None = None,
) -> dict[str, Any]:
    """The event ``name`` of ``ticket``'s delivery: exactly :data:`taskonce.events.FIELDS`,
    in order; ``duration`` adds the time since the decision."""
    delivery, policy = ticket.delivery, ticket.policy
    return {
        "ts": utc_now_iso(),
        "event": name.value,
        "key": ticket.key,
        "queue": delivery.queue,
        "message_id": delivery.message_id,
        "task": delivery.task,
        "framework": delivery.framework,
        "mode": policy.mode,
        "worker": worker_id(),
        "attempt": delivery.attempt,
        "redelivered": delivery.redelivered,
        "duration_ms": round((time.monotonic() - ticket.started) * 1000, 3) if duration else None,
        "lease_s": policy.lease,
        "keep_for_s": policy.keep_for,
        "reason": reason,
        "recovery_s": recovery_s,
        "count": count,
    }


def emit_event(sinks: Sinks, name: Event, ticket: Ticket, **fields: Any) -> None:
    """Send ``ticket``'s event ``name`` (:func:`ticket_event`, with ``fields``) to ``sinks``."""
    # Runs several times per delivery: skip the work when nobody would see the event.
    if not sinks.quiet(name):
        sinks.send(ticket_event(name, ticket, **fields))
