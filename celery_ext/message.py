"""Celery messages as the producer made them: what the hand-off stores for a captured send, and
how it publishes that again, unchanged; and the payload encoding the fingerprint hashes.

A guarded body's ``send_task`` runs as Celery runs it — routing, ``create_task_message``, the
``before_task_publish`` receivers, the serializer and compression of kombu's ``Producer`` — up
to the broker: :class:`CapturingProducer` keeps the message kombu would have handed to the
channel (body bytes, content type, content encoding, headers, properties, exchange, routing key)
instead of publishing it, in a JSON-safe form for the body of a :class:`~taskonce.handoff.Send`
(the body bytes in Base64, the headers in kombu's JSON type tags), and :func:`publish_stored`
publishes it again through a producer of the app, with the same bytes. So every serializer Celery
supports (kombu's JSON with its types and the types an app registers, pickle, msgpack, yaml,
``pydantic=True`` tasks) and every part of the message — its canvas (``link``, ``link_error``,
``chain``, ``chord``) included — arrives as it would have without taskonce.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from kombu.compression import decompress
from kombu.entity import Exchange, Queue
from kombu.serialization import dumps as kombu_dumps
from kombu.serialization import loads as kombu_loads
from kombu.utils import json as kombu_json

from taskonce.keys import PayloadEncoder, canonical_json

#: Marks a Celery send stored in the producer's encoded form (a send without it was stored by
#: taskonce 0.x as JSON arguments and publish options, and is published the old way).
MESSAGE = "message"

#: Canonical JSON with kombu's types (datetime, date, time, Decimal, UUID, bytes, and what an
#: app registers with ``kombu.utils.json.register_type``). One encoder for every call.
_KOMBU_CANONICAL = kombu_json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


#: The header the worker's strategy writes for a message whose content type is not JSON: the
#: SHA-256 of its body as delivered (:func:`taskonce.celery_ext.strategy.guarded`).
BODY_DIGEST = "taskonce_body_sha256"


@functools.cache
def payload_encoder(serializer: str) -> PayloadEncoder:
    """The payload encoding the fingerprint of a task on ``serializer`` hashes, for a delivery
    whose body is not at hand (an eager run): :func:`delivered_encoder` without a body."""
    return delivered_encoder(serializer, None)


def delivered_encoder(serializer: str, delivered: str | None) -> PayloadEncoder:
    """The payload encoding the fingerprint of a delivery hashes.

    Canonical JSON where the arguments are plain JSON (the fingerprints taskonce always took);
    else canonical JSON with kombu's types (keys sorted: a dict's order does not matter); else
    — arguments only pickle (or an app's own serializer) carries, which have no canonical
    form — the body as delivered (``delivered``: its digest), which a redelivery of the same
    message and a re-publish of a stored send repeat byte for byte; without it, the arguments
    as ``serializer`` encodes them."""

    def encode(task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bytes:
        try:
            return canonical_json(task, args, kwargs)
        except (TypeError, ValueError):
            pass
        payload = [task, list(args), dict(kwargs)]
        try:
            return _KOMBU_CANONICAL.encode(payload).encode("utf-8")
        except (TypeError, ValueError):
            if delivered is not None:
                return f"{task}\x00body:{delivered}".encode()
            if serializer == "json":
                raise
        _, _, data = kombu_dumps(payload, serializer=serializer)  # type: ignore[no-untyped-call]
        return data if isinstance(data, bytes) else str(data).encode("utf-8")

    return encode


def unencodable(app: Any, name: str, options: Mapping[str, Any]) -> str:
    """Which argument of a ``send_task`` call (its ``options``) the task's serializer cannot
    encode, e.g. ``"args[1] (set)"``; ``"an argument"`` when no single one is to blame."""
    task = app.tasks.get(name)
    serializer = (
        options.get("serializer") or getattr(task, "serializer", None) or app.conf.task_serializer
    )
    named: list[tuple[str, Any]] = [
        (f"args[{i}]", value) for i, value in enumerate(options.get("args") or ())
    ]
    named += [(f"kwargs[{k!r}]", v) for k, v in dict(options.get("kwargs") or {}).items()]
    for where, value in named:
        try:
            kombu_dumps(value, serializer=serializer)  # type: ignore[no-untyped-call]
        except Exception:
            return f"{where} ({type(value).__name__})"
    return "an argument"


class CapturingProducer:
    """A stand-in for the kombu ``Producer`` that ``send_task`` publishes through: the first
    ``publish`` is encoded exactly as ``producer`` would encode it (its ``_prepare``: serializer,
    then compression) and kept in :attr:`message`; anything published after it (a ``task-sent``
    monitoring event) goes to ``producer``. Everything else is ``producer``'s."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer
        #: the captured message (JSON-safe, for :func:`publish_stored`), once ``publish`` ran
        self.message: dict[str, Any] | None = None
        #: the kept message's body bytes as kombu encoded them (what ``send_limit`` counts)
        self.size = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)

    def publish(self, body: Any, *args: Any, **options: Any) -> None:
        """Keep the first message instead of publishing it; publish any after it (see the
        class). The arguments are kombu's ``Producer.publish``'s."""
        if self.message is not None:
            self._producer.publish(body, *args, **options)
            return
        self.message, self.size = _encoded(self._producer, body, *args, **options)


def _encoded(
    real: Any,
    body: Any,
    routing_key: str | None = None,
    delivery_mode: Any = None,
    mandatory: bool = False,
    immediate: bool = False,
    priority: int = 0,
    content_type: str | None = None,
    content_encoding: str | None = None,
    serializer: str | None = None,
    headers: dict[str, Any] | None = None,
    compression: str | None = None,
    exchange: Any = None,
    retry: bool = False,
    retry_policy: Mapping[str, Any] | None = None,
    declare: Sequence[Any] | None = None,
    expiration: float | None = None,
    timeout: float | None = None,
    confirm_timeout: float | None = None,
    **properties: Any,
) -> tuple[dict[str, Any], int]:
    """The message kombu's producer ``real`` would publish for ``Producer.publish``'s arguments
    (JSON-safe, for :func:`publish_stored`), and its body's size in bytes as kombu encoded it
    (what ``send_limit`` counts)."""
    headers = dict(headers or {})
    routing_key = real.routing_key if routing_key is None else routing_key
    compression = real.compression if compression is None else compression
    exchange_name, mode = real._delivery_details(exchange or real.exchange, delivery_mode)
    data, content_type, content_encoding = real._prepare(
        body, serializer, content_type, content_encoding, compression, headers
    )
    # kombu hands a text body (JSON, yaml) to the channel encoded in its content encoding
    raw = data.encode(content_encoding or "utf-8") if isinstance(data, str) else bytes(data)
    message = {
        "body": base64.b64encode(raw).decode("ascii"),
        "content_type": content_type,
        "content_encoding": content_encoding,
        "headers": _tagged(headers),
        "properties": _tagged(properties),
        "exchange": exchange_name,
        "routing_key": routing_key,
        "delivery_mode": mode,
        "priority": priority,
        "expiration": expiration,
        "declare": [_queue_spec(q) for q in declare or () if isinstance(q, Queue)],
        "retry": bool(retry),
        "retry_policy": {
            k: v
            for k, v in (retry_policy or {}).items()
            if v is None or isinstance(v, (int, float, str))
        },
        "timeout": timeout,
        "confirm_timeout": confirm_timeout,
    }
    return message, len(raw)


def _tagged(value: Any) -> Any:
    """``value`` as plain JSON in kombu's own encoding (its datetimes, UUIDs, Decimals, bytes as
    kombu's type tags): what the send's JSON text can hold; :func:`_untagged` undoes it."""
    return json.loads(kombu_json.dumps(value))  # type: ignore[no-untyped-call]


def _untagged(value: Any) -> Any:
    return kombu_json.loads(json.dumps(value))  # type: ignore[no-untyped-call]


def _queue_spec(queue: Queue) -> list[Any]:
    exchange = queue.exchange
    return [
        queue.name,
        getattr(exchange, "name", "") or "",
        getattr(exchange, "type", "direct") or "direct",
        queue.routing_key,
    ]


def _declared(app: Any, specs: Sequence[Sequence[Any]]) -> list[Queue]:
    """The queues to declare before the publish: the app's own by name, else as captured."""
    found: list[Queue] = []
    known = app.amqp.queues
    for name, exchange, kind, routing_key in specs:
        queue = known.get(name) if hasattr(known, "get") else None
        if queue is None:
            queue = Queue(name, Exchange(exchange, type=kind), routing_key)  # type: ignore[no-untyped-call]
        found.append(queue)
    return found


def publish_stored(app: Any, message: Mapping[str, Any]) -> None:
    """Publish a message :class:`CapturingProducer` kept, through a producer of ``app``: the
    same body bytes, content type and encoding, headers and properties."""
    with app.producer_or_acquire() as producer:
        producer.publish(
            base64.b64decode(message["body"]),
            routing_key=message["routing_key"],
            delivery_mode=message["delivery_mode"],
            priority=message["priority"],
            content_type=message["content_type"],
            content_encoding=message["content_encoding"],
            headers=_untagged(message["headers"]),
            exchange=message["exchange"],
            retry=message["retry"],
            retry_policy=dict(message["retry_policy"]),
            declare=_declared(app, message["declare"]),
            expiration=message["expiration"],
            timeout=message["timeout"],
            confirm_timeout=message["confirm_timeout"],
            **_untagged(message["properties"]),
        )


def decoded(message: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """The ``(args, kwargs, headers)`` of a stored message, decoded as a worker would (for
    :func:`taskonce.testing.captured_sends`)."""
    raw = base64.b64decode(message["body"])
    headers = _untagged(message["headers"])
    if headers.get("compression"):
        raw = decompress(raw, headers["compression"])  # type: ignore[no-untyped-call]
    # accepted explicitly: the process that made this message decodes it (pickle is disabled
    # in kombu unless accepted)
    content_type = message["content_type"]
    body = kombu_loads(raw, content_type, message["content_encoding"], accept={content_type})  # type: ignore[no-untyped-call]
    if isinstance(body, Mapping):  # task protocol 1
        return list(body.get("args") or ()), dict(body.get("kwargs") or {}), headers
    args, kwargs = body[0], body[1]
    return list(args or ()), dict(kwargs or {}), headers
