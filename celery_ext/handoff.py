"""The hand-off for Celery: what a guarded task sends is captured, recorded with its outcome and
published after it (see docs/handoff.md).

Each piece is a translation; the guard decides everything else:

- :func:`install` wraps the app's ``send_task`` — where ``.delay``, ``apply_async``, signatures,
  groups and a chord's header all end up. While :func:`taskonce.handoff.current` returns a
  capture (a guarded body runs with ``defer_sends``), ``send_task`` makes the message as usual
  under the id fixed now (its own ``task_id``, else one derived from the parent's key) and the
  message — body bytes as its serializer encoded them, headers, properties, routing — is
  recorded instead of published (:mod:`taskonce.celery_ext.message`); the caller gets the
  usual :class:`~celery.result.AsyncResult`.
- :func:`capture_links` captures the ``link`` callbacks and the next ``chain`` step, which
  Celery's tracer would publish after the body returns, and clears them from the request so the
  tracer does not.
- :func:`capture_chord_part` reports a chord header task's success to the result backend
  inside the capture, so the chord body the backend publishes after the last header task is a
  send of that task's run, under the body's frozen id.
- :func:`replaced` hands a run that replaces itself over (:mod:`taskonce.replace`): what it
  sent before ``self.replace()`` is recorded apart and published after the replacement.
- :func:`publisher` publishes each stored message as it was made; the guard calls it after the
  outcome is recorded, on a redelivery and from the relay.

Never captured (they run outside the capture or inside :func:`taskonce.send_now`): the retry
message of ``self.retry()``/``autoretry_for``, the replacement message of ``replace()`` (it
carries the task's own id), the guard's own re-deliveries and ``link_error`` callbacks (the
failure path).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from celery.exceptions import Ignore
from kombu.exceptions import EncodeError
from kombu.utils import json as kombu_json

from taskonce import handoff, replace
from taskonce.celery_ext.message import (
    BODY_DIGEST,
    MESSAGE,
    CapturingProducer,
    delivered_encoder,
    payload_encoder,
    publish_stored,
    unencodable,
)
from taskonce.celery_ext.routing import QUEUE_HEADER, stamped_queues
from taskonce.errors import ConfigError, SendRefused
from taskonce.guard import Guard, Ticket
from taskonce.handoff import Receipt, Send
from taskonce.keys import PayloadEncoder, make_key

T = TypeVar("T")

logger = logging.getLogger("taskonce.celery")

FRAMEWORK = "celery"

_INSTALL_LOCK = threading.Lock()
_WRAPPED = "_taskonce_send_task"


def install(app: Any, guard: Guard) -> None:
    """Make ``app`` capture the sends of guarded bodies and let ``guard`` publish them."""
    guard.register_publisher(FRAMEWORK, publisher(app))
    with _INSTALL_LOCK:
        if getattr(app, _WRAPPED, None) is None:
            original = app.send_task
            wrapped = functools.partial(_send_task, app, original)
            setattr(app, _WRAPPED, original)
            app.send_task = wrapped


def _send_task(app: Any, original: Callable[..., Any], name: str, *args: Any, **kw: Any) -> Any:
    capture = handoff.current()
    if capture is None:
        return original(name, *args, **kw)
    return _capture(app, original, capture, name, *args, **kw)


# send_task's positional parameters after ``name``, in order.
_POSITIONAL = ("args", "kwargs", "countdown", "eta", "task_id", "producer", "connection")


def _capture(
    app: Any,
    original: Callable[..., Any],
    capture: handoff.Capture,
    name: str,
    *positional: Any,
    **kw: Any,
) -> Any:
    """Record one ``send_task`` call in ``capture``; the AsyncResult its caller expects.

    ``send_task`` itself runs, under the id fixed now, through a producer that keeps the
    message it is given (:class:`~taskonce.celery_ext.message.CapturingProducer`): routing,
    headers, the ``before_task_publish`` receivers, the serializer and compression are
    Celery's and kombu's, as in a plain publish; only the broker does not see it yet."""
    for field, value in zip(_POSITIONAL, positional, strict=False):
        kw[field] = value
    kw.pop("connection", None)  # nothing goes to a broker now; the publisher has its own
    send_id = capture.next_id(kw.get("task_id"))
    kw["task_id"] = send_id
    with app.producer_or_acquire(kw.pop("producer", None)) as producer:
        keeper = CapturingProducer(producer)
        try:
            result = original(name, producer=keeper, **kw)
        except EncodeError as exc:
            raise SendRefused(
                f"{capture.sender()} sent {name!r} with {unencodable(app, name, kw)} that its "
                f"serializer cannot encode ({exc}); Celery could not have sent it either"
            ) from exc
    if keeper.message is None:  # a send_task that published nothing (nothing to record)
        return result
    capture.add(
        FRAMEWORK,
        {"task": name, MESSAGE: keeper.message},
        message_id=send_id,
        name=name,
        size=keeper.size,
    )
    return result


def capture_links(task: Any, request: Any, retval: Any) -> tuple[Any, Any]:
    """Capture what the tracer publishes after a successful body — the ``link`` callbacks with
    ``retval``, then the next ``chain`` step — exactly as it would build them, and clear them from
    ``request``. Returns the cleared ``(callbacks, chain)`` for :func:`restore_links`."""
    callbacks, chain = request.callbacks, request.chain
    if not callbacks and not chain:
        return None, None
    app = task.app
    publish = {
        "parent_id": request.id,
        "root_id": request.root_id or request.id,
        "priority": (
            (request.delivery_info or {}).get("priority")
            if app.conf.task_inherit_parent_priority
            else None
        ),
    }
    from celery import group, signature

    if callbacks:
        sigs = [signature(sig, app=app) for sig in callbacks]
        groups = [s for s in sigs if isinstance(s, group)]
        plain = [s for s in sigs if not isinstance(s, group)]
        if len(sigs) == 1:
            sigs[0].apply_async((retval,), **publish)
        else:
            for group_ in groups:
                group_.apply_async((retval,), **publish)
            if plain:
                group(plain, app=app).apply_async((retval,), **publish)
    if chain:
        signature(chain[-1], app=app).apply_async((retval,), chain=chain[:-1], **publish)
    request.callbacks = None
    request.chain = None
    return callbacks, chain


def restore_links(request: Any, links: tuple[Any, Any]) -> None:
    """Put back what :func:`capture_links` cleared: the outcome could not be committed
    (transactional, store down) and the message is published again to run later, with them."""
    callbacks, chain = links
    if callbacks is not None:
        request.callbacks = callbacks
    if chain is not None:
        request.chain = chain


def capture_chord_part(task: Any, request: Any, retval: Any) -> None:
    """Report a successful chord header task to the result backend inside the capture: the
    chord body the backend publishes when this is the last header task to finish is then a
    send of this run, under the id the chord froze for it, recorded with this outcome and
    published after it. Without this the tracer reports it from ``mark_as_done`` after the
    record, where a worker that dies in between leaves the chord without its body (the
    redelivery is skipped as a duplicate).

    Celery's own order is kept — the result stored, then ``on_chord_part_return`` (a header of
    groups joins the stored results) — and ``request.chord`` is cleared so the tracer does not
    report the part a second time. A backend without chord support in the worker (the
    database backend: ``celery.chord_unlock`` publishes the body, captured where the chord was
    applied) does nothing here."""
    if not request.chord:
        return
    ignore = getattr(request, "ignore_result", None)
    ignore = task.ignore_result if ignore is None else ignore
    task.backend.mark_as_done(request.id, retval, request, not ignore)
    request.chord = None


def payload_encoding(task: Any, request: Any) -> PayloadEncoder:
    """How the payload of ``task``'s delivery ``request`` is encoded for its fingerprint
    (:func:`~taskonce.celery_ext.message.delivered_encoder`): canonical JSON where its
    arguments have one, else its body as delivered, else its serializer's encoding."""
    serializer = str(task.serializer or task.app.conf.task_serializer)
    delivered = getattr(request, BODY_DIGEST, None)
    if not isinstance(delivered, str):
        headers = request.headers
        delivered = headers.get(BODY_DIGEST) if isinstance(headers, Mapping) else None
    if isinstance(delivered, str) and delivered:
        return delivered_encoder(serializer, delivered)
    return payload_encoder(serializer)


def replaced_depth(request: Any) -> int:
    """How deeply this message replaces a task of its id (Celery's ``replaced_task_nesting``;
    0 for a message that replaces nothing): :attr:`taskonce.Delivery.replaced`."""
    value = getattr(request, "replaced_task_nesting", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def replaced(guard: Guard, ticket: Ticket, publish: Callable[[], T]) -> T:
    """``self.replace(sig)`` of a guarded run (:mod:`taskonce.replace`): record what the body
    sent so far and release the claim, ``publish()`` the replacement (Celery's ``replace``:
    ``Ignore`` once it is published, its value in an eager run), then publish those sends; if
    the replacement could not be published, withdraw them."""
    handover = replace.hand_over(guard, ticket)
    try:
        with handoff.send_now():  # the replacement carries this task's id: not a deferred send
            value = publish()
    except Ignore:
        if handover is not None:
            replace.dispatch(guard, handover)
        raise
    except BaseException:
        if handover is not None:
            replace.withdraw(guard, handover)
        raise
    if handover is not None:
        replace.dispatch(guard, handover)
    return value


def publisher(app: Any) -> Callable[[Send], Receipt | None]:
    """The guard's publisher of Celery sends: the stored message published as the producer
    made it, under the send's id (:func:`~taskonce.celery_ext.message.publish_stored`); the
    send's receipt when its task is guarded here (:func:`receipt_of`). A send stored by an
    earlier taskonce (JSON arguments and ``send_task`` options) is sent with ``send_task``."""

    def publish(send: Send) -> Receipt | None:
        body = send.body
        message = body.get(MESSAGE)
        if message is None:
            return _publish_legacy(app, send)
        with handoff.send_now():
            publish_stored(app, message)
        headers = message.get("headers") or {}
        queue = headers.get(QUEUE_HEADER)
        if not send.within or not isinstance(queue, str) or not queue:
            return None
        return receipt_of(app, body["task"], send.id, queue, {"eta": headers.get("eta")})

    return publish


def _publish_legacy(app: Any, send: Send) -> Receipt | None:
    """Publish a send in the format taskonce wrote before it kept the encoded message:
    ``{"task", "args", "kwargs", "options"}``, the arguments in kombu's JSON type tags."""
    body = send.body
    options = dict(body.get("options") or {})
    args, kwargs = kombu_json.loads(  # type: ignore[no-untyped-call]
        json.dumps([body.get("args") or [], body.get("kwargs") or {}])
    )
    with handoff.send_now(), stamped_queues() as queues:
        app.send_task(
            body["task"],
            args=args,
            kwargs=kwargs,
            task_id=send.id,
            add_to_parent=False,
            **options,
        )
    if not send.within or not queues:
        return None
    return receipt_of(app, body["task"], send.id, queues[-1], options)


def receipt_of(
    app: Any, name: str, task_id: str, queue: str, options: Mapping[str, Any]
) -> Receipt | None:
    """Where the receipt of task ``name`` sent under ``task_id`` to ``queue`` shows: the key
    its guard claims, when the task is registered in this app as an
    :class:`~taskonce.celery_ext.IdempotentTask` and guarded on ``queue``; else None (nothing
    to await: taskonce cannot see that receiver)."""
    from taskonce.celery_ext.config import guard_for
    from taskonce.celery_ext.task import IdempotentTask

    task = app.tasks.get(name)
    if not isinstance(task, IdempotentTask):
        return None
    guard = guard_for(app)
    try:
        policy = guard.policy_for(queue, task.idempotency)
    except ConfigError:
        return None  # the worker refuses it anyway
    if not policy.enabled or handoff.local_broker_shared_store(
        _broker_url(app), guard.store, FRAMEWORK
    ):
        return None
    return Receipt(make_key(task_id, queue, policy.identity), policy.keep_for, _delay(options))


def _broker_url(app: Any) -> str:
    """The URL the app publishes to (``broker_write_url``, else ``broker_url``), "" if none."""
    url = app.conf.broker_write_url or app.conf.broker_url
    return url if isinstance(url, str) else ""


def _delay(options: Mapping[str, Any]) -> float:
    """Seconds until a send's ETA (``countdown``, ``eta``), 0 without one."""
    countdown = options.get("countdown")
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, str):
        try:
            eta = datetime.datetime.fromisoformat(eta)
        except ValueError:
            return 0.0
    if isinstance(eta, datetime.datetime):
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=datetime.timezone.utc)
        return max(0.0, (eta - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
    return 0.0
