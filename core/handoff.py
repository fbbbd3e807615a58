"""The hand-off: messages a guarded handler sends are captured, recorded with its outcome and
published after it.

While a guarded handler runs, the adapters ask :func:`current` before publishing anything. When
it returns a :class:`Capture`, they add the message to it instead of publishing it (a handler
running in another thread or event loop than :meth:`taskonce.Guard.begin` gets its capture
with :func:`capturing`); the guard
stores the captured messages with the outcome (same Lua script, same SQL transaction) and
publishes them afterwards through the publisher each framework registered with
:meth:`taskonce.Guard.register_publisher`. A failed run's captures are discarded.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from taskonce.checks import check_count
from taskonce.errors import SendRefused

if TYPE_CHECKING:
    from taskonce.stores.base import Store
    from taskonce.ticket import Ticket

logger = logging.getLogger("taskonce")

#: Default size limit of one handler's captured sends (bytes as the framework encoded them).
DEFAULT_SEND_LIMIT = 1 << 20

#: Child ids are uuid5 names in this namespace: the same parent key and ordinal give the same id.
_NAMESPACE = uuid.UUID("6f1c3f64-9f3e-5d0c-9a51-7a6b1d0e4c21")


@dataclasses.dataclass(frozen=True)
class Send:
    """One message a guarded handler sent, captured instead of published, as the stores keep
    it: JSON text.

    :param id: the message id, fixed at capture (the caller's, else :func:`derive_id`).
    :param framework: ``"celery"``, ``"dramatiq"`` or ``"python"``: whose publisher sends it.
    :param body: what that framework's publisher needs to publish it (JSON-safe). Celery and
        Dramatiq keep the message as the framework encoded it (its bytes in Base64, so any
        serializer's output fits); ``"python"`` sends keep their JSON arguments.
    :param within: the sender's ``Policy.confirm_within``: seconds to wait for the receiver's
        receipt after the publish (0: none awaited).
    """

    id: str
    framework: str
    body: dict[str, Any]
    within: float = 0.0

    def to_json(self) -> str:
        """Compact JSON text of this send (what the stores keep)."""
        data: dict[str, Any] = {"id": self.id, "framework": self.framework, "body": self.body}
        if self.within:
            data["within"] = self.within
        return json.dumps(data, separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Send:
        """The send whose :meth:`to_json` is ``text``."""
        data = json.loads(text)
        return cls(
            id=data["id"],
            framework=data["framework"],
            body=data["body"],
            within=float(data.get("within") or 0.0),
        )


@dataclasses.dataclass(frozen=True)
class Receipt:
    """Where the receipt of a published send will show: the key its receiver's guard claims or
    marks, in the same store (:mod:`taskonce.receipts`).

    :param key: the receiver's key for this send (its queue and id, by the receiver's policy).
    :param keep_for: the receiver's ``keep_for``: how long that record stays to be seen.
    :param after: seconds from the publish until the send's ETA (countdown, delay), else 0.
    """

    key: str
    keep_for: float
    after: float = 0.0


Publisher = Callable[[Send], "Receipt | None"]
"""Publishes one :class:`Send` (with its id); raises on failure. Returns the send's
:class:`Receipt` when its receiver is guarded on the same store, else None (nothing to await)."""


#: Brokers that live inside one process (Celery's ``memory://``, Dramatiq's ``StubBroker``).
_LOCAL_BROKERS = ("memory://", "stub://")
_told_local: set[str] = set()


def local_broker_shared_store(broker_url: str, store: Store, framework: str) -> bool:
    """Whether sends published to ``broker_url`` must await no receipt: the broker lives in
    this process only (``memory://``, e.g. a shell's override; Dramatiq's StubBroker) while
    the store is one other processes share. A relay elsewhere would otherwise find no receipt
    and publish the send again into *its* broker, where it would run for real. Said once per
    framework (INFO)."""
    from taskonce.stores.memory import MemoryStore

    if not broker_url.startswith(_LOCAL_BROKERS) or isinstance(store, MemoryStore):
        return False
    if framework not in _told_local:
        _told_local.add(framework)
        logger.info(
            "%s sends go to the in-process broker %s: they await no receipt in %s, so no relay "
            "publishes them again into another broker",
            framework,
            broker_url.split("//", 1)[0] + "//",
            store.describe(),
        )
    return True


def id_base(key: str, replaced: int = 0) -> str:
    """What the ids of a handler's sends derive from (:func:`derive_id`): its key, and for a
    message that replaces an earlier task of the same id (Celery's ``self.replace()``, ``replaced``
    levels deep) the key and that depth, so the replacement's sends never take the ids of what
    the replaced task sent before it."""
    return key if replaced <= 0 else f"{key}\x00replaced:{replaced}"


def derive_id(parent_key: str, ordinal: int) -> str:
    """A deterministic UUID string from the parent's key and the send's 0-based ordinal: a
    re-run of the same handler sends its children under the same ids."""
    return str(uuid.uuid5(_NAMESPACE, f"{parent_key}\x00{ordinal}"))


class Capture:
    """The sends of the guarded handler running in this context.

    :param parent_key: the guarded delivery's key (child ids derive from it).
    :param task: the handler's task/actor name, for error messages.
    :param limit: the most bytes of messages this handler may capture (as their framework
        encoded them, see :meth:`add`).
    :param within: the handler's ``Policy.confirm_within``, given to each send.
    """

    __slots__ = ("limit", "parent_key", "sends", "size", "task", "texts", "within")

    #: A test's capture (:func:`taskonce.testing.captured_sends`): a producer outbox block
    #: (``send_on_commit()``) inside it hands its sends to it instead of writing them.
    for_test = False

    def __init__(
        self,
        parent_key: str,
        task: str = "",
        limit: int = DEFAULT_SEND_LIMIT,
        within: float = 0.0,
    ) -> None:
        self.parent_key = parent_key
        self.task = task
        self.limit = limit
        self.within = within
        self.sends: list[Send] = []
        #: the stored form of ``sends``, encoded once at :meth:`add`
        self.texts: list[str] = []
        self.size = 0

    def add(
        self,
        framework: str,
        body: dict[str, Any],
        message_id: str | None = None,
        *,
        name: str | None = None,
        size: int | None = None,
    ) -> str:
        """Capture one send; return its id: ``message_id`` if the caller chose one, else
        ``derive_id(parent_key, ordinal)``.

        ``name`` (the task/actor being sent; default ``body["task"]``/``body["actor_name"]``)
        only serves error messages. ``size`` is the message's size as its framework encoded it
        (body bytes), what the limit counts; default: the stored text's, for sends kept as
        JSON arguments. The stored text of an encoded message is larger (its bytes in Base64):
        the limit is on what the handler sends, not on how it is kept. Raises
        :class:`~taskonce.errors.SendRefused` naming the sender, the message and the argument
        when ``body`` is not JSON-serialisable, or when the handler's captures would exceed the
        size limit. A refused send is not captured.
        """
        if not isinstance(body, dict):
            raise SendRefused(f"{self._sender()}: a send's body must be a dict, not {body!r:.80}")
        send_id = self.next_id(message_id)
        send = Send(send_id, framework, body, self.within)
        target = name or str(body.get("task") or body.get("actor_name") or "?")
        try:
            text = send.to_json()
        except (TypeError, ValueError) as exc:
            where = _first_unstorable(body) or "an argument"
            raise SendRefused(
                f"{self._sender()} sent {target!r} with {where} that JSON cannot represent "
                f"({exc}); deferred sends are stored as JSON, so pass JSON values (str, int, "
                "float, bool, None, list, dict) or use taskonce.send_now() for this send"
            ) from None
        size = self.size + (len(text.encode()) if size is None else size)
        if size > self.limit:
            raise SendRefused(
                f"{self._sender()} sent {target!r}: its captured sends would take {size} bytes, "
                f"over the limit of {self.limit} bytes per handler (Guard(send_limit=…)); send "
                "references to large data, not the data"
            )
        self.sends.append(send)
        self.texts.append(text)
        self.size = size
        return send_id

    def next_id(self, message_id: str | None = None) -> str:
        """The id the next send gets: ``message_id`` if the caller chose one, else
        ``derive_id(parent_key, ordinal)``. Raises :class:`~taskonce.errors.SendRefused` for
        a ``message_id`` that is not a non-empty str."""
        if message_id is None:
            return derive_id(self.parent_key, len(self.sends))
        if not isinstance(message_id, str) or not message_id:
            raise SendRefused(f"{self.sender()}: message id {message_id!r} must be a non-empty str")
        return message_id

    def sender(self) -> str:
        """Who is sending, for error messages: the handler's task, else its key."""
        return self._sender()

    def _sender(self) -> str:
        return f"task {self.task!r}" if self.task else f"the handler of {self.parent_key!r}"

    def __len__(self) -> int:
        return len(self.sends)

    def __repr__(self) -> str:
        return f"Capture({self.parent_key!r}, {len(self.sends)} send(s))"


_capture: contextvars.ContextVar[Capture | None] = contextvars.ContextVar(
    "taskonce_capture", default=None
)
_sending_now: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "taskonce_send_now", default=False
)


def current() -> Capture | None:
    """The capture active in this context: None outside a guarded handler, when the policy has
    ``defer_sends=False``, and inside :func:`send_now`."""
    capture = _capture.get()
    if capture is None or _sending_now.get():
        return None
    return capture


def check_send_limit(send_limit: object) -> None:
    """:class:`~taskonce.errors.ConfigError` unless ``send_limit`` is a whole number of bytes,
    1 or more (``Guard(send_limit=…)``)."""
    check_count("Guard(send_limit=…)", send_limit, unit="bytes")


def start_capture(ticket: Ticket, send_limit: int) -> None:
    """Capture what ``ticket``'s handler sends (its policy's ``defer_sends``), in this context;
    inside another guarded handler with ``defer_sends=False``, publish at once instead."""
    assert ticket.key is not None
    if ticket.policy.defer_sends:
        base = id_base(ticket.key, ticket.delivery.replaced)
        ticket.capture = Capture(
            base, ticket.delivery.task, send_limit, ticket.policy.confirm_within
        )
        ticket._capture_token = _capture.set(ticket.capture)
    elif _capture.get() is not None:
        ticket._capture_token = _capture.set(None)


def end_capture(ticket: Ticket) -> tuple[str, ...]:
    """Stop capturing for ``ticket``; the JSON texts of what its handler sent."""
    from taskonce.ticket import reset_var

    capture = ticket.capture
    if capture is None and ticket._capture_token is None:
        return ()
    ticket.capture = None
    if ticket._capture_token is not None:
        reset_var(_capture, ticket._capture_token)
        ticket._capture_token = None
    return () if capture is None else tuple(capture.texts)


@contextlib.contextmanager
def capturing(capture: Capture | None) -> Iterator[None]:
    """Make ``capture`` (a ticket's :attr:`~taskonce.Ticket.capture`) current inside the block:
    for adapters whose handler runs in another thread or context than :meth:`Guard.begin`
    (an asyncio event loop)."""
    token = _capture.set(capture)
    try:
        yield
    finally:
        _capture.reset(token)


@contextlib.contextmanager
def send_now() -> Iterator[None]:
    """``with taskonce.send_now(): ...`` — sends inside publish at once, outside the guarantee
    (a progress notification you want out even if the handler later fails)."""
    token = _sending_now.set(True)
    try:
        yield
    finally:
        _sending_now.reset(token)


def _first_unstorable(value: Any, path: str = "") -> str:
    """Where in ``value`` the first thing JSON cannot store is, e.g. ``argument args[1]``."""
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                return f"argument {path or 'body'} key {k!r}"
            found = _first_unstorable(item, f"{path}[{k!r}]" if path else k)
            if found:
                return found
        return ""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _first_unstorable(item, f"{path}[{i}]")
            if found:
                return found
        return ""
    if value is None or isinstance(value, (str, bool, int)):
        return ""
    if isinstance(value, float):
        return (
            ""
            if value == value and value not in (float("inf"), float("-inf"))
            else (f"argument {path} = {value!r}")
        )
    return f"argument {path} of type {type(value).__name__}"


__all__ = [
    "DEFAULT_SEND_LIMIT",
    "Capture",
    "Publisher",
    "Receipt",
    "Send",
    "capturing",
    "current",
    "derive_id",
    "id_base",
    "send_now",
]
