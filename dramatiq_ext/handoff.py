"""The hand-off for Dramatiq: what a guarded actor sends is captured, recorded with its outcome
and enqueued after it (see docs/handoff.md).

- :func:`install` wraps the broker's ``enqueue``, where ``send``, ``send_with_options``, the
  next pipeline step, ``on_success`` callbacks and a group's completion callbacks all end up. While
  :func:`taskonce.handoff.current` returns a capture (a guarded actor runs with
  ``defer_sends``), the message — encoded by the broker's encoder, as the broker would encode
  it — is recorded instead of enqueued and the caller gets it
  back under the id fixed now: the message's own id when the caller built the message (a
  pipeline's steps, ``broker.enqueue(message)``), else — ``actor.send`` makes a random one — an
  id derived from the parent's key, the same on a re-run.
- :class:`Finisher` records the outcome of a message with a next pipeline step, an
  ``on_success`` callback or group completion callbacks *after* ``Pipelines``, ``Callbacks``
  and ``GroupCallbacks`` have sent them (so they are captured too: the last member of a group
  to finish sends its completion callbacks with its own outcome): Dramatiq runs ``after_*``
  hooks in reverse list order, and the finisher sits first in ``broker.middleware``. Other
  messages are recorded as before, in the middleware's own hook.
- :func:`publisher` enqueues a stored send under its id; the guard calls it after the record,
  on a redelivery and from the relay.

Never captured: ``Retries``' re-enqueues and the guard's deferral copies (they happen after the
capture ended or before it began), the workers' moves of delayed ``.DQ`` messages (another
thread), ``on_failure`` callbacks (the failure path ends the capture first) and sends inside
:func:`taskonce.send_now`.
"""

from __future__ import annotations

import base64
import contextvars
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq import Message, Middleware
from dramatiq.brokers.stub import StubBroker
from dramatiq.encoder import JSONEncoder, PickleEncoder

from taskonce import handoff
from taskonce.errors import SendRefused
from taskonce.handoff import Receipt, Send
from taskonce.keys import canonical_json, canonical_pickle

if TYPE_CHECKING:
    from dramatiq import Actor, Broker
    from dramatiq.broker import MessageProxy

    from taskonce.dramatiq_ext.middleware import IdempotencyMiddleware
    from taskonce.guard import Guard, Ticket

logger = logging.getLogger("taskonce.dramatiq")

FRAMEWORK = "dramatiq"

#: A Dramatiq send's stored body keeps the message as the broker's encoder encoded it (Base64)
#: under this name; a send without it was stored by an earlier taskonce as the message's fields.
MESSAGE = "message"

#: Set while ``actor.send_with_options`` builds and enqueues a message: its id is Dramatiq's
#: random one, which the capture replaces with a derived one.
_FRESH_ID: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "taskonce_dramatiq_fresh_id", default=False
)
_ORIGINAL = "_taskonce_enqueue"
_LOCK = threading.Lock()


#: Where a published message's receipt shows (its receiver's key), or None: the middleware's
#: :meth:`~taskonce.dramatiq_ext.IdempotencyMiddleware.receipt_of`.
ReceiptOf = Callable[["Message[Any]", "int | None"], "Receipt | None"]


def install(broker: Broker, guard: Guard, receipt_of: ReceiptOf | None = None) -> None:
    """Make ``broker`` capture the sends of guarded actors and let ``guard`` publish them;
    ``receipt_of`` says where a published send's receipt shows."""
    with _LOCK:
        original = vars(broker).get(_ORIGINAL)
        if original is None:
            original = broker.enqueue
            setattr(broker, _ORIGINAL, original)
            broker.enqueue = functools.partial(_enqueue, original)  # type: ignore[method-assign]
    if receipt_of is not None and handoff.local_broker_shared_store(
        "stub://" if isinstance(broker, StubBroker) else "", guard.store, FRAMEWORK
    ):
        receipt_of = None
    guard.register_publisher(FRAMEWORK, publisher(original, receipt_of))


def wrap_actor(actor: Actor[Any, Any]) -> None:
    """Mark the messages ``actor.send``/``send_with_options`` make as having a fresh id."""
    if "send_with_options" in vars(actor):
        return
    original = actor.send_with_options

    def send_with_options(**kwargs: Any) -> Any:
        token = _FRESH_ID.set(True)
        try:
            return original(**kwargs)
        finally:
            _FRESH_ID.reset(token)

    actor.send_with_options = send_with_options  # type: ignore[method-assign]


def _enqueue(
    original: Callable[..., Message[Any]], message: Message[Any], *, delay: int | None = None
) -> Message[Any]:
    capture = handoff.current()
    if capture is None:
        return original(message, delay=delay)
    fresh = _FRESH_ID.get()
    send_id = capture.next_id(None if fresh else message.message_id)
    if send_id != message.message_id:
        message = message.copy(message_id=send_id)
    try:
        encoded = message.encode()  # the broker's encoder, as the broker's enqueue would
    except Exception as exc:
        raise SendRefused(
            f"{capture.sender()} sent {message.actor_name!r} with {_unencodable(message)} that "
            f"Dramatiq's encoder ({type(dramatiq.get_encoder()).__name__}) cannot encode "
            f"({type(exc).__name__}: {exc}); Dramatiq could not have sent it either"
        ) from exc
    body = {
        "actor_name": message.actor_name,
        "queue_name": message.queue_name,
        "delay": delay,
        MESSAGE: base64.b64encode(encoded).decode("ascii"),
    }
    capture.add(FRAMEWORK, body, message_id=send_id, name=message.actor_name, size=len(encoded))
    return message


def _unencodable(message: Message[Any]) -> str:
    """Which argument of ``message`` the broker's encoder cannot encode, e.g.
    ``"args[1] (set)"``; ``"an argument"`` when no single one is to blame."""
    encoder = dramatiq.get_encoder()
    named: list[tuple[str, Any]] = [(f"args[{i}]", v) for i, v in enumerate(message.args)]
    named += [(f"kwargs[{k!r}]", v) for k, v in message.kwargs.items()]
    for where, value in named:
        try:
            encoder.encode(value)
        except Exception:
            return f"{where} ({type(value).__name__})"
    return "an argument"


def encode_payload(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
    """How a delivery's payload is encoded for its fingerprint: canonical JSON (the
    fingerprints taskonce always took), else — arguments only a non-JSON encoder carries —
    for ``PickleEncoder`` canonical pickle (sets in a fixed order: a redelivery decoded in
    another process pickles alike), for another encoder as it encodes them."""
    try:
        return canonical_json(task, args, kwargs)
    except (TypeError, ValueError):
        encoder = dramatiq.get_encoder()
        if isinstance(encoder, JSONEncoder):
            raise
    payload = [task, list(args), dict(kwargs)]
    if isinstance(encoder, PickleEncoder):
        return canonical_pickle(payload)
    return encoder.encode({"actor_name": task, "args": list(args), "kwargs": dict(kwargs)})


def publisher(
    enqueue: Callable[..., Message[Any]], receipt_of: ReceiptOf | None = None
) -> Callable[[Send], Receipt | None]:
    """The guard's publisher of Dramatiq sends: the stored message, decoded by the broker's
    encoder, enqueued under its id (the broker encodes it again as it would have); its receipt
    by ``receipt_of`` when the send awaits one. A send stored by an earlier taskonce (the
    message's fields as JSON) is enqueued from those."""

    def publish(send: Send) -> Receipt | None:
        body = send.body
        encoded = body.get(MESSAGE)
        message: Message[Any]
        if encoded is not None:
            message = Message.decode(base64.b64decode(encoded))
            if message.message_id != send.id:
                message = message.copy(message_id=send.id)
        else:
            message = Message(
                queue_name=body["queue_name"],
                actor_name=body["actor_name"],
                args=tuple(body.get("args") or ()),
                kwargs=body.get("kwargs") or {},
                options=body.get("options") or {},
                message_id=send.id,
                message_timestamp=body["message_timestamp"],
            )
        delay = body.get("delay")
        with handoff.send_now():
            enqueue(message, delay=delay)
        if not send.within or receipt_of is None:
            return None
        return receipt_of(message, delay)

    return publish


class Finisher(Middleware):
    """Records a successful guarded delivery after every other ``after_process_message``.

    :class:`~taskonce.dramatiq_ext.IdempotencyMiddleware` adds it at the front of
    ``broker.middleware`` itself; its ``after_*`` hook therefore runs last, after ``Pipelines``,
    ``Callbacks`` and ``GroupCallbacks`` have sent (into the capture) what follows a success.
    """

    def __init__(self, owner: IdempotencyMiddleware) -> None:
        self.owner = owner

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        """Finish the delivery the owner left to this hook."""
        ticket: Ticket | None = self.owner.finishing.take(message)
        if ticket is not None:
            self.owner.settle(broker, message, ticket, result, exception)


def sends_after_success(broker: Broker, message: MessageProxy) -> bool:
    """Whether ``Pipelines``, ``Callbacks`` or ``GroupCallbacks`` may send something after
    ``message`` succeeds: a next pipeline step, an ``on_success`` callback (message or actor
    option), or a group's completion callbacks (enqueued by the member that completes the group,
    whichever that is)."""
    msg = vars(message).get("_message", message)  # not through the proxy's __getattr__
    options = msg.options
    if (
        options.get("pipe_target") is not None
        or options.get("on_success")
        or options.get("group_completion_callbacks")
    ):
        return True
    actor = broker.actors.get(msg.actor_name)
    return actor is not None and bool(actor.options.get("on_success"))


def place_finisher(broker: Broker, finisher: Finisher) -> None:
    """Put ``finisher`` first in ``broker.middleware``. The list is replaced, not changed in
    place: Dramatiq may be iterating the old one (this runs from its hooks)."""
    stack = broker.middleware
    if stack and stack[0] is finisher:
        return
    broker.middleware = [finisher, *(m for m in stack if m is not finisher)]
