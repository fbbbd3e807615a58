"""docs/outside-apis.md's Celery task, as written (``myapp.billing`` in tests/docs_apps): on a
real ``celery worker`` against the fake payments server, a message and its duplicate charge once,
and the charge's ``Idempotency-Key`` is the delivery's ``taskonce.current_key()``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskonce.demo.common import delete_redis_keys
from tests.docs_apps import PATH as APPS
from tests.docs_apps import myapp_worker
from tests.helpers import REDIS_URL, require_service, wait_for
from tests.payments_server import PaymentsServer

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def payments() -> Iterator[PaymentsServer]:
    with PaymentsServer() as server:
        yield server


@pytest.fixture
def env(tmp_path: Path, payments: PaymentsServer) -> Iterator[dict[str, str]]:
    require_service("redis")
    prefix = f"billing{uuid.uuid4().hex[:10]}"
    yield {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(APPS), str(ROOT)]),
        "MYAPP_BROKER": REDIS_URL,
        "MYAPP_STORE": REDIS_URL,
        "MYAPP_PREFIX": prefix,
        "PAYMENTS_URL": payments.url,
        "MYAPP_EVENTS": str(tmp_path / "events.jsonl"),
    }
    delete_redis_keys(REDIS_URL, f"{prefix}*")


def events(env: dict[str, str], message_id: str) -> list[str]:
    path = Path(env["MYAPP_EVENTS"])
    lines = path.read_text().splitlines() if path.exists() else []
    found = [json.loads(line) for line in lines if line.strip()]
    return [e["event"] for e in found if e.get("message_id") == message_id]


def test_a_duplicate_charges_once_with_the_deliverys_key(
    env: dict[str, str], tmp_path: Path, payments: PaymentsServer
) -> None:
    send = (
        "from myapp.billing import charge\n"
        "charge.apply_async(('A-1', 500), task_id='order-A-1')\n"
        "charge.apply_async(('A-1', 500), task_id='order-A-1')\n"
    )
    with myapp_worker("myapp.billing", env, tmp_path):
        subprocess.run([sys.executable, "-c", send], cwd=tmp_path, env=env, check=True, timeout=60)
        wait_for(
            lambda: {"completed", "duplicate_skipped"} <= set(events(env, "order-A-1")),
            timeout=60,
            interval=0.1,
            what=f"both copies to be handled: {events(env, 'order-A-1')}",
        )
    names = events(env, "order-A-1")
    assert names.count("completed") == 1 and names.count("duplicate_skipped") == 1, names
    assert len(payments.charges) == 1, payments.charges
    assert payments.charges[0]["key"] == "celery:order-A-1"
    assert [status for _, status in payments.requests] == [201]
