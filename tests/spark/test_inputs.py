"""Input forms and the command line: gzip JSONL by glob plus Parquet give the hand-worked
report; ``taskonce audit`` writes it, shows progress and exits 1 with ``--fail-on-leak``; an
empty log gives an all-zero report."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from typing import Any

import pytest

from taskonce import cli
from taskonce.spark_ext import AuditInputError, audit
from taskonce.spark_ext.progress import ConsoleProgress
from tests.spark import worked


def test_gzip_glob_and_parquet_through_the_cli(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = worked.worked_events()
    logs = tmp_path / "logs"
    logs.mkdir()
    # the first 25 events in two gzip files (one with the malformed lines), the rest in Parquet
    for index, part in enumerate((events[:12], events[12:25])):
        lines = [json.dumps(item) for item in part]
        if index == 0:
            lines += worked.MALFORMED_LINES
        with gzip.open(logs / f"part-{index}.jsonl.gz", "wt", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
    plain = tmp_path / "rest.jsonl"
    worked.write_jsonl(plain, events[25:], malformed=False)
    parquet = tmp_path / "rest.parquet"
    (
        spark.read.json(str(plain))
        .selectExpr("*", "cast(ts as timestamp) as ts_time")
        .drop("ts")
        .withColumnRenamed("ts_time", "ts")  # a real timestamp column, as Parquet logs have
        .write.parquet(str(parquet))
    )
    out = tmp_path / "out"
    code = cli.main(
        [
            "audit",
            str(logs / "*.jsonl.gz"),
            str(parquet),
            "--out",
            str(out),
            "--broker-bound",
            "redis-visibility=1h",
            "--simulate-windows",
            "1m,10m,1h,1d",
            "--grace",
            "30s",
            "--fail-on-leak",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 1, captured.err  # leaks, and keep_for below the recommendation
    report = json.loads(captured.out)
    assert json.loads((out / "report.json").read_text()) == report
    assert report["events"] == worked.EXPECTED_EVENTS
    assert report["overall"] == worked.EXPECTED_OVERALL
    assert report["queues"] == worked.EXPECTED_QUEUES
    assert report["tasks"] == worked.EXPECTED_TASKS
    assert report["what_if"] == worked.EXPECTED_WHAT_IF
    assert "[audit 1/7] reading and classifying events" in captured.err
    assert "[audit 7/7] writing the outputs" in captured.err
    assert "3 key(s) leaked" in captured.err
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"  # restored afterwards


NO_SENDS = {
    "records_deferred": 0,
    "records_dispatched": 0,
    "stranded": 0,
    "discarded": 0,
    "dispatch_lag_p50_s": 0.0,
    "dispatch_lag_p99_s": 0.0,
    "dispatch_lag_max_s": 0.0,
}


def test_empty_log(spark: Any, tmp_path: Path) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    result = audit(spark, [str(log)], simulate_windows=[300], now=worked.NOW)
    assert result.report == {
        "generated_at": "2026-02-01T12:00:00.000Z",
        "events": 0,
        "keep_for_s": 0,
        "overall": worked.metrics(recommended_keep_for_s=60),
        "queues": {},
        "tasks": {},
        "what_if": [{"keep_for_s": 300, "suppressed": 0, "leaked": 0, "store_keys": 0}],
        "handoff": NO_SENDS,
        "producer": NO_SENDS,
        "advice": {
            "broker_bound_s": None,
            "broker_bound_name": None,
            "broker_bound_source": None,
            "frameworks": [],
            "min_gaps": 20,
            "overall": {
                "verdict": "too_short",
                "span_s": 0.0,
                "duplicates": 0,
                "gaps": 0,
                "span_needed_s": 60,
                "reasons": [
                    "it spans less than the 60 s window it would recommend (a duplicate that "
                    "late could not have shown in it)",
                    "it holds 0 duplicate(s) with a measured gap, fewer than 20, and no broker "
                    "bound is known",
                ],
            },
            "queues": {},
            "tasks": {},
        },
    }
    assert result.problems() == []


def test_missing_path_is_a_clear_error(spark: Any, tmp_path: Path) -> None:
    with pytest.raises(AuditInputError, match="cannot read the event logs"):
        audit(spark, [str(tmp_path / "nothing-here-*.jsonl")])
    with pytest.raises(AuditInputError, match="no event source"):
        audit(spark, [])


def test_console_progress_lines(spark: Any) -> None:
    stream = io.StringIO()
    progress = ConsoleProgress(spark.sparkContext, stream=stream)
    progress(1, 3, "reading")
    progress(2, 3, "counting")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("[audit 1/3] reading")
    assert lines[1].startswith("[audit 2/3] counting")


def test_numeric_times_that_are_no_time_are_malformed_rows(spark: Any, tmp_path: Path) -> None:
    """A Parquet log with ``ts`` in epoch seconds: a NaN, infinite or out-of-range time makes
    its row malformed (counted, dropped), and the audit reads the rest."""
    start = worked.T0.timestamp()
    rows = [
        (start, "claimed", "n:k1", "n"),
        (start + 1, "completed", "n:k1", "n"),
        (start + 2, "duplicate_skipped", "n:k1", "n"),
        (float("nan"), "claimed", "n:k2", "n"),
        (float("inf"), "claimed", "n:k3", "n"),
        (1e300, "claimed", "n:k4", "n"),
    ]
    folder = tmp_path / "numeric"
    spark.createDataFrame(rows, "ts double, event string, key string, queue string").write.parquet(
        str(folder)
    )
    result = audit(spark, [str(folder)], fmt="parquet")
    assert result.info["malformed"] == 3
    assert result.report["events"] == 3
    assert result.report["overall"]["deliveries"] == 2
    assert result.report["overall"]["duplicates_skipped"] == 1
