"""Fast in-process checks of what the hand-off stores for Celery sends and of the payload
fingerprint's encodings (memory broker and store). The guarantees are shown through real
workers in test_serializers.py and test_serializers_pickle.py; these pin down that every
serializer Celery supports is published byte for byte as the producer made it."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Consumer, Queue
from kombu.compression import decompress

import taskonce
from taskonce.celery_ext import IdempotentTask, setup
from taskonce.celery_ext.message import MESSAGE, payload_encoder
from taskonce.handoff import Send
from taskonce.keys import canonical_pickle, digest, fingerprint
from tests.typed_values import PARCEL, VALUES, WHEN, wrong_types


def make_app(serializer: str) -> tuple[Celery, taskonce.Guard, Any]:
    app = Celery(f"units-{serializer}", broker="memory://", set_as_current=False)
    app.conf.update(
        task_serializer=serializer, accept_content=[serializer], task_default_queue="units"
    )
    guard = taskonce.Guard(taskonce.MemoryStore())
    setup(app, guard)

    @app.task(base=IdempotentTask, bind=True, acks_late=True, name="u.parent", shared=False)
    def parent(
        self: Any, values: list[Any], kwargs: Any = None, compression: str | None = None
    ) -> None:
        app.send_task(
            "u.child", args=values, kwargs=kwargs, compression=compression,
            headers={"custom": "kept"},
        )  # fmt: skip

    return app, guard, parent


def delivered(app: Celery) -> list[Any]:
    """The messages on the memory broker's ``units`` queue, as a consumer receives them."""
    got: list[Any] = []
    with Connection(app.conf.broker_url, transport_options={}) as conn:
        consumer = Consumer(
            conn,
            [Queue("units")],
            callbacks=[lambda b, m: got.append(m)],
            accept=["json", "pickle", "msgpack", "yaml"],
        )
        with consumer:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
    return got


SERIALIZERS = [
    ("json", VALUES),
    ("pickle", (*VALUES, PARCEL)),
    pytest.param("msgpack", (VALUES[3], "text", 3), id="msgpack"),
    pytest.param("yaml", (VALUES[0], VALUES[3], "text"), id="yaml"),
]


@pytest.mark.parametrize(("serializer", "values"), SERIALIZERS)
def test_a_deferred_send_is_published_as_the_producer_made_it(
    serializer: str, values: tuple[Any, ...]
) -> None:
    pytest.importorskip({"msgpack": "msgpack", "yaml": "yaml"}.get(serializer, "json"))
    app, guard, parent = make_app(serializer)
    stored: list[str] = []
    real_complete = guard.store.complete

    def keep(*args: Any, **kwargs: Any) -> None:
        stored.extend(kwargs.get("sends") or (args[4] if len(args) > 4 else ()))
        real_complete(*args, **kwargs)

    guard.store.complete = keep  # type: ignore[method-assign]
    kwargs = {} if serializer == "msgpack" else {"when": WHEN}
    try:
        parent.apply(
            args=(list(values),), kwargs={"kwargs": kwargs, "compression": "zlib"}, task_id="p-1"
        ).get()
        (text,) = stored
        send = Send.from_json(text)
        message = send.body[MESSAGE]
        (got,) = delivered(app)
        assert got.headers["id"] == send.id and got.headers["custom"] == "kept"
        assert got.headers["compression"] == "application/x-gzip"
        assert got.content_type == message["content_type"]
        assert got.content_encoding == message["content_encoding"]
        # the same bytes (the consumer's message holds the body decompressed)
        assert decompress(base64.b64decode(message["body"]), "application/x-gzip") == got.body
        args, got_kwargs, _ = got.decode()
        assert wrong_types(tuple(args), tuple(values)) == ""
        assert got_kwargs == kwargs
    finally:
        app.close()


def test_plain_json_keeps_the_fingerprints_of_earlier_versions() -> None:
    encode = payload_encoder("json")
    args, kwargs = [1, "a", {"b": [2.5, None]}], {"z": 1, "a": True}
    assert digest(encode("t", args, kwargs)) == fingerprint("t", args, kwargs)
    # kombu's types: canonical (a dict's key order does not matter), and values tell apart
    one = digest(encode("t", [*VALUES, {"k": 1, "j": 2}], {}))
    assert one == digest(encode("t", [*VALUES, {"j": 2, "k": 1}], {}))
    assert one != digest(encode("t", [WHEN.replace(year=2027), *VALUES[1:], {"k": 1, "j": 2}], {}))
    with pytest.raises(TypeError):
        encode("t", [PARCEL], {})  # kombu's JSON cannot carry it: no fingerprint


def test_pickle_without_a_body_at_hand_encodes_through_the_serializer() -> None:
    assert payload_encoder("pickle")("t", [PARCEL], {})


def test_canonical_pickle_is_the_same_in_every_process() -> None:
    """Set order follows string hashes, which differ between processes: canonical pickle sorts
    them, plain pickle does not."""
    code = (
        "import hashlib, pickle; from taskonce.keys import canonical_pickle; "
        "from tests.typed_values import PARCEL; "
        "v = [PARCEL, {'s': {'x', 'y', 'z', 'w', 'v', 'u'}}]; "
        "print(hashlib.sha256(canonical_pickle(v)).hexdigest())"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
        ).stdout
        for seed in ("1", "2", "3", "4")
    }
    assert len(outputs) == 1
    assert canonical_pickle({"b", "a"}) == canonical_pickle({"a", "b"})


def test_a_send_the_serializer_cannot_encode_is_refused_with_its_reason() -> None:
    app, _, parent = make_app("json")
    try:
        result = parent.apply(args=([{1, 2}],), task_id="p-bad")
        assert isinstance(result.result, taskonce.SendRefused)
        assert "'u.child' with args[0] (set)" in str(result.result)
        assert "not JSON serializable" in str(result.result)
        assert delivered(app) == []
    finally:
        app.close()


def test_the_stored_text_is_json() -> None:
    app, guard, parent = make_app("pickle")
    try:
        parent.apply(args=([PARCEL],), task_id="p-2").get()
        record = guard.store.get("units:p-2")
        assert record is not None
        json.dumps(record.as_dict())  # what `taskonce inspect` prints
    finally:
        app.close()


def test_the_send_limit_counts_the_message_as_encoded_not_as_stored() -> None:
    """Stored in Base64, 800 kB of bytes take about 1.07 MB of text: under the 1 MiB default a
    handler may still send them (Celery's own test_chain_to_a_chord_with_large_header sends
    about 780 kB), and twice that is refused naming the limit."""
    app, guard, parent = make_app("json")
    try:
        delivered(app)  # the memory broker is the process's: what earlier tests left
        parent.apply(args=(["x" * 800_000],), task_id="p-big").get()
        [message] = delivered(app)
        assert json.loads(message.body)[0] == ["x" * 800_000]
        stored = len(base64.b64encode(message.body))  # what the store held
        assert stored > taskonce.handoff.DEFAULT_SEND_LIMIT
        result = parent.apply(args=(["x" * 1_100_000],), task_id="p-bigger")
        assert isinstance(result.result, taskonce.SendRefused)
        assert f"over the limit of {taskonce.handoff.DEFAULT_SEND_LIMIT} bytes" in str(
            result.result
        )
        assert guard.store.get("units:p-bigger") is None and delivered(app) == []
    finally:
        app.close()
