"""docs/outside-apis.md's Celery task, as written (``myapp.billing`` in tests/docs_apps): on a
real ``celery worker`` against the fake payments server, a message and its duplicate charge once,
and the charge's ``Idempotency-Key`` is the delivery's ``taskonce.current_key()``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from taskonce.demo.common import delete_redis_keys
from tests.docs_apps import PATH as APPS
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
    }
    delete_redis_keys(REDIS_URL, f"{prefix}*")


def test_a_duplicate_charges_once_with_the_deliverys_key(
    env: dict[str, str], tmp_path: Path, payments: PaymentsServer
) -> None:
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "myapp.billing", "worker", "-P", "prefork",
             "-c", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-n", f"{env['MYAPP_PREFIX']}@%h", "-l", "INFO"],
            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def ready() -> bool:
        assert worker.poll() is None, log.read_text()
        return " ready." in log.read_text()

    send = (
        "from myapp.billing import charge\n"
        "charge.apply_async(('A-1', 500), task_id='order-A-1')\n"
        "charge.apply_async(('A-1', 500), task_id='order-A-1')\n"
    )
    try:
        wait_for(ready, timeout=60, interval=0.1, what="the worker to be ready")
        subprocess.run([sys.executable, "-c", send], cwd=tmp_path, env=env, check=True, timeout=60)
        wait_for(
            lambda: log.read_text().count("succeeded") + log.read_text().count("duplicate") >= 2,
            timeout=60,
            interval=0.1,
            what=f"both copies to be handled: {log.read_text()[-2000:]}",
        )
        assert len(payments.charges) == 1, payments.charges
        assert payments.charges[0]["key"] == "celery:order-A-1"
        assert [status for _, status in payments.requests] == [201]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
