"""docs/audit.md's ``send_rows`` block, as the page has it (tests/test_docs.py checks the lines
are the same): the user's ``myapp.tasks:charge`` (tests/docs_apps, shipped to the executors
with ``addPyFile`` as a Spark user would), the page's queue ``payments`` and namespace. Every
row becomes one Celery message for ``myapp.tasks.charge`` with the row as its keyword arguments
and ``row_id(namespace, [order_id])`` as its id.

The page's names are fixed (the queue ``payments`` under ``myapp``'s default key prefix on Redis
db 15), so a lock file keeps two runs of this test on one machine from meeting there."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest

from taskonce.spark_ext import send_rows
from taskonce.spark_ext.producer import row_id
from tests.docs_apps import PATH as APPS
from tests.docs_apps import fixed_names
from tests.helpers import REDIS_URL, require_service


def _drain(queue: str) -> list[Any]:
    """Every message of ``queue`` on ``myapp``'s broker, read and acknowledged; the queue
    deleted."""
    from kombu import Connection

    taken = []
    with Connection(REDIS_URL, transport_options={"global_keyprefix": "myapp-docs:"}) as broker:
        inbox = broker.SimpleQueue(queue)
        try:
            while True:
                try:
                    message = inbox.get(timeout=2)
                except inbox.Empty:
                    break
                taken.append((message.headers["id"], message.headers["task"], message.payload))
                message.ack()
        finally:
            inbox.queue.delete()
            inbox.close()
    return taken


def test_the_pages_send_rows(spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_service("redis")
    archive = shutil.make_archive(str(tmp_path / "myapp"), "zip", APPS, "myapp")
    spark.sparkContext.addPyFile(archive)  # the executors import myapp.tasks
    monkeypatch.syspath_prepend(str(APPS))  # and so may the driver
    tag = uuid.uuid4().hex[:8]
    rows = [(f"{tag}-{i}", 100 * i) for i in range(6)]
    orders_df = spark.createDataFrame(rows, ["order_id", "cents"]).repartition(2)
    with fixed_names("queue-payments"):
        _drain("payments")  # declared (so messages are routed) and empty
        try:
            sent = send_rows(orders_df, "myapp.tasks:charge", key_cols=["order_id"],
                             namespace="orders-export-v1", options={"queue": "payments"})
        finally:
            messages = _drain("payments")
    assert sent == len(rows)
    expected = {
        row_id("orders-export-v1", [order_id]): {"order_id": order_id, "cents": cents}
        for order_id, cents in rows
    }
    assert {message_id for message_id, _, _ in messages} == set(expected)
    for message_id, task, (args, kwargs, _embed) in messages:
        assert task == "myapp.tasks.charge"
        assert (args, kwargs) == ([], expected[message_id])
