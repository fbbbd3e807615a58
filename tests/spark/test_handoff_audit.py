"""The audit's hand-off figures: dispatch lag and stranded sends, in every output format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.spark import worked


def test_dispatch_lag_and_stranded_sends(spark: Any, tmp_path: Path) -> None:
    from taskonce.spark_ext import audit

    def sends(at: float, name: str, key: str, count: int = 1) -> dict[str, Any]:
        return {**worked.event(at, name, key, "orders", "t.send"), "count": count}

    events = [
        # k1: published by the worker right after its outcome (lag 0.5 s)
        worked.event(0, "claimed", "orders:k1", "orders", "t.send"),
        worked.event(1, "completed", "orders:k1", "orders", "t.send"),
        sends(1, "sends_deferred", "orders:k1", 2),
        sends(1.5, "sends_dispatched", "orders:k1", 2),
        # k2: the worker died after its outcome; the redelivery published them (lag 60 s)
        worked.event(10, "claimed", "orders:k2", "orders", "t.send"),
        worked.event(11, "completed", "orders:k2", "orders", "t.send"),
        sends(11, "sends_deferred", "orders:k2"),
        sends(71, "sends_redispatched", "orders:k2"),
        worked.event(71, "duplicate_skipped", "orders:k2", "orders", "t.send"),
        # k3: the relay published them (its event has no queue or task; lag 30 s)
        worked.event(20, "marked", "orders:k3", "orders", "t.send", mode="lazy"),
        sends(20, "sends_deferred", "orders:k3"),
        {**worked.event(50, "sends_dispatched", "orders:k3", None), "count": 1},
        # k4: stranded at the log's end
        worked.event(30, "claimed", "orders:k4", "orders", "t.send"),
        worked.event(31, "completed", "orders:k4", "orders", "t.send"),
        sends(31, "sends_deferred", "orders:k4"),
        # k5: the run failed; its sends were discarded
        worked.event(40, "claimed", "orders:k5", "orders", "t.send"),
        sends(41, "sends_discarded", "orders:k5", 3),
        worked.event(41, "released", "orders:k5", "orders", "t.send"),
    ]

    def produced(at: float, name: str, record: str) -> dict[str, Any]:
        """A producer outbox event (taskonce.send_on_commit): no key, the record as message_id."""
        return {**worked.event(at, name, None, None), "message_id": record, "count": 1}

    events += [
        # o1: published right after the commit (lag 0.2 s); o2: by the relay after a crash (9 s)
        produced(5, "sends_deferred", "outbox:o1"),
        produced(5.2, "sends_dispatched", "outbox:o1"),
        produced(6, "sends_deferred", "outbox:o2"),
        produced(15, "sends_dispatched", "outbox:o2"),
        # o3: the broker is down, still pending at the log's end; o4: rolled back
        produced(7, "sends_deferred", "outbox:o3"),
        produced(8, "sends_discarded", "outbox:o4"),
    ]
    log = worked.write_jsonl(tmp_path / "events.jsonl", events, malformed=False)
    out = tmp_path / "out"
    result = audit(spark, [str(log)], out=str(out), charts=False, now=worked.NOW)
    expected = {
        "records_deferred": 4,
        "records_dispatched": 3,
        "stranded": 1,
        "discarded": 1,
        "dispatch_lag_p50_s": 30.0,
        "dispatch_lag_p99_s": 60.0,
        "dispatch_lag_max_s": 60.0,
    }
    assert result.report["handoff"] == expected
    assert json.loads((out / "report.json").read_text())["handoff"] == expected
    producer = {
        "records_deferred": 3,
        "records_dispatched": 2,
        "stranded": 1,
        "discarded": 1,
        "dispatch_lag_p50_s": 0.2,
        "dispatch_lag_p99_s": 9.0,
        "dispatch_lag_max_s": 9.0,
    }
    assert result.report["producer"] == producer
    assert json.loads((out / "report.json").read_text())["producer"] == producer
    markdown = (out / "report.md").read_text()
    assert "## Hand-off (deferred sends)" in markdown
    assert "| stranded (unpublished at the log's end) | 1 |" in markdown
    assert "| dispatch lag p99 s | 60 |" in markdown
    assert "## Producer outbox (sends from send_on_commit)" in markdown
    assert "| discarded (rolled back) | 1 |" in markdown
    page = (out / "report.html").read_text()
    assert "Hand-off (deferred sends)" in page and "dispatch lag max s" in page
    # the redispatching redelivery is a skipped duplicate, nothing else
    assert result.report["overall"]["duplicates_skipped"] == 1
    assert result.report["overall"]["leaks"] == 0
