"""``taskonce demo`` (Celery): a real worker, duplicates, a killed pool process, a balance."""

from __future__ import annotations

import io
import re
import time

from taskonce.demo.celery_demo import run_demo
from tests.celery.conftest import RABBIT_BROKER
from tests.helpers import POSTGRES_URL, require_service


def check_report(text: str, count: int) -> None:
    assert "✓ every order charged exactly once" in text, text
    numbers = {
        label: int(value)
        for label, value in re.findall(
            r"^  (sent|ran|duplicates skipped|ledger rows)\s+(\d+)", text, re.M
        )
    }
    duplicates = len([i for i in range(count) if i % 5 == 2])
    assert numbers["sent"] == count + duplicates
    assert numbers["duplicates skipped"] == duplicates
    assert numbers["ledger rows"] == count
    assert numbers["ran"] == count + 1  # every charge once, plus the run that was killed
    assert "killed pool process" in text


def test_demo_on_the_embedded_default_finishes_in_under_a_minute() -> None:
    """SQLite store + kombu's SQLAlchemy transport on SQLite: nothing to install."""
    out = io.StringIO()
    started = time.monotonic()
    assert run_demo(store=None, broker=None, count=150, out=out) == 0, out.getvalue()
    assert time.monotonic() - started < 60
    check_report(out.getvalue(), 150)


def test_demo_on_rabbitmq_and_postgresql() -> None:
    require_service("rabbitmq")
    require_service("postgresql")
    out = io.StringIO()
    assert run_demo(store=POSTGRES_URL, broker=RABBIT_BROKER, count=150, out=out) == 0, (
        out.getvalue()
    )
    check_report(out.getvalue(), 150)


def test_demo_refuses_a_non_positive_count_and_a_memory_store() -> None:
    out = io.StringIO()
    assert run_demo(store=None, broker=None, count=0, out=out) == 2
    assert "--count" in out.getvalue()
    assert run_demo(store="memory://", broker=None, count=10, out=out) == 2
    assert "share the store" in out.getvalue()
