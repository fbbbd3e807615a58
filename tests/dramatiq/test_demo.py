"""``taskonce demo --framework dramatiq`` end to end: embedded broker, SQLite store, real workers,
one worker process SIGKILLed mid-charge; the balance must hold."""

from __future__ import annotations

import io
import re
import shutil

from taskonce.demo.dramatiq_demo import run_demo
from tests.helpers import require_service


def test_demo_embedded_balance_holds() -> None:
    if shutil.which("redis-server") is None:
        require_service("redis")  # the demo falls back to the local Redis
    out = io.StringIO()
    code = run_demo(store=None, broker=None, count=60, out=out)
    text = out.getvalue()
    assert code == 0, text
    assert "✓ every order charged exactly once" in text
    assert "killed worker process" in text
    skipped = re.search(r"duplicates skipped\s+(\d+)", text)
    # 12 re-published; one more when the killed process had committed a charge but not acked it
    assert skipped is not None and int(skipped.group(1)) >= 12, text
    assert re.search(r"ledger rows\s+60\s+of 60 orders", text), text


def test_demo_refuses_a_non_dramatiq_broker() -> None:
    out = io.StringIO()
    assert run_demo(store=None, broker="sqla+sqlite:///x.db", count=10, out=out) == 2
    assert "redis://" in out.getvalue()
