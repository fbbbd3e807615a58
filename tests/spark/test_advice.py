"""The recommended keep_for comes with its evidence (the log's span, the duplicates seen, the
broker's redelivery bound and where it came from) and a verdict: on a log too short to advise,
report.json, the terminal summary, report.md and report.html say so instead of recommending
(and not in green), and the recommendation is never below a broker bound the audit knows —
given with ``--broker-bound``, or assumed from the framework the events name."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from taskonce import cli
from taskonce.spark_ext import AuditResult, audit
from taskonce.spark_ext.audit import ADVICE_SCOPE_FIELDS
from taskonce.spark_ext.cli import summary
from tests.spark import worked

WEEK = 7 * 86400.0


def flat(text: str) -> str:
    """``text`` on one line (the summary wraps the advice for the terminal)."""
    return " ".join(text.split())


def issue_log(path: Path, framework: str = "celery") -> Path:
    """The log of the report: 45 events, 9 duplicates over 3 minutes, keep_for 7 days — 18
    messages claimed and completed, every other one delivered again 20 s later."""
    events: list[dict[str, Any]] = []
    for index in range(18):
        at = index * 10.0
        key = f"celery:m{index}"
        e = worked.event
        events += [
            e(at, "claimed", key, "celery", "app.send", keep_for_s=WEEK, framework=framework),
            e(at + 1, "completed", key, "celery", "app.send", keep_for_s=WEEK, framework=framework),
        ]
        if index % 2 == 0:
            events.append(
                e(
                    min(at + 20, 180.0),
                    "duplicate_skipped",
                    key,
                    "celery",
                    "app.send",
                    keep_for_s=WEEK,
                    framework=framework,
                    worker="host:2",
                )
            )
    assert len(events) == 45
    return worked.write_jsonl(path, events, malformed=False)


def long_log(path: Path) -> Path:
    """Two days of a Dramatiq log: 30 messages, each delivered again 10 to 39 minutes later."""
    events: list[dict[str, Any]] = []
    e = worked.event
    for index in range(30):
        at = index * 60.0
        key = f"jobs:m{index}"
        events += [
            e(at, "claimed", key, "jobs", framework="dramatiq"),
            e(at + 1, "completed", key, "jobs", framework="dramatiq"),
            e(at + 600 + index * 60, "duplicate_skipped", key, "jobs", framework="dramatiq"),
        ]
    events.append(e(2 * 86400.0, "purged", None, None, framework="dramatiq"))
    return worked.write_jsonl(path, events, malformed=False)


@pytest.fixture(scope="module")
def too_short(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[AuditResult, Path]:
    folder = tmp_path_factory.mktemp("too_short")
    log = issue_log(folder / "events.jsonl")
    out = folder / "out"
    return audit(spark, [str(log)], out=str(out), charts=False, now=worked.NOW), out


def test_too_short_log_states_its_evidence_in_report_json(
    too_short: tuple[AuditResult, Path],
) -> None:
    result, out = too_short
    report = json.loads((out / "report.json").read_text())
    assert report == result.report
    assert report["events"] == 45
    # the events name Celery and no bound was given: the longest default of Celery's brokers
    advice = report["advice"]
    assert advice["broker_bound_s"] == 3600
    assert advice["broker_bound_name"] == "celery-redis"
    assert advice["broker_bound_source"] == "framework"
    assert advice["frameworks"] == ["celery"]
    overall = advice["overall"]
    assert tuple(overall) == ADVICE_SCOPE_FIELDS
    assert overall["verdict"] == "too_short"
    assert overall["span_s"] == 180.0  # first delivery 0 s, last event 180 s
    assert overall["duplicates"] == 9
    assert overall["gaps"] == 9
    assert overall["span_needed_s"] == 3600
    assert overall["reasons"] and "3600" not in overall["reasons"][0]  # said in words
    assert "spans less than the 60 min window" in overall["reasons"][0]
    # never below the bound it knows (the gaps alone asked for 20 s × 2 → 60 s)
    assert report["overall"]["gap_p999_s"] == 20.0
    assert report["overall"]["recommended_keep_for_s"] == 3600
    assert report["queues"]["celery"]["recommended_keep_for_s"] == 3600
    assert advice["queues"]["celery"] == overall
    assert advice["tasks"]["app.send"] == overall


def test_too_short_log_says_so_in_the_summary(too_short: tuple[AuditResult, Path]) -> None:
    result, out = too_short
    text = flat(summary(result, str(out)))
    assert "No recommendation: the log is too short to advise" in text
    assert "Recommended keep_for" not in text
    assert "the log spans 3 min and holds 9 duplicate(s), 9 with a measured gap" in text
    assert "broker bound 3600 s (60 min, assumed: the events name celery" in text
    assert "Keep keep_for at least 3600 s (60 min, the broker bound)" in text


def test_too_short_log_says_so_in_report_md_and_html_not_in_green(
    too_short: tuple[AuditResult, Path],
) -> None:
    _, out = too_short
    markdown = (out / "report.md").read_text()
    assert "**No recommendation: the log is too short to advise**" in markdown
    assert "Recommended keep_for" not in markdown
    assert "every queue's keep_for covers its recommendation" not in markdown
    assert "| advice | too short |" in markdown  # the overall table's row
    page = (out / "report.html").read_text()
    verdict = re.search(r"<div class='(\w+)'>(.*?)</div>", page, re.S)
    assert verdict is not None
    assert verdict.group(1) == "warn"  # amber, not the green of "ok"
    assert "No recommendation: the log is too short to advise" in verdict.group(2)


def test_a_long_enough_log_is_advised_with_its_evidence(spark: Any, tmp_path: Path) -> None:
    """Two days, 30 duplicates (gaps 10 to 39 min), a given bound of 30 min: advised."""
    log = long_log(tmp_path / "events.jsonl")
    out = tmp_path / "out"
    result = audit(
        spark,
        [str(log)],
        out=str(out),
        broker_bounds={"rabbitmq-consumer": 1800.0},
        charts=False,
        now=worked.NOW,
    )
    advice = result.report["advice"]
    # the given bound replaces the one Dramatiq's brokers would have been assumed to have
    assert (advice["broker_bound_s"], advice["broker_bound_name"]) == (1800, "rabbitmq-consumer")
    assert advice["broker_bound_source"] == "option"
    assert advice["frameworks"] == ["dramatiq"]
    assert advice["min_gaps"] == 0
    overall = advice["overall"]
    assert overall["verdict"] == "advise"
    assert overall["reasons"] == []
    assert overall["span_s"] == 2 * 86400.0
    assert overall["duplicates"] == overall["gaps"] == 30
    recommended = result.report["overall"]["recommended_keep_for_s"]
    # gaps 600, 660 … 2340 s: p99.9 = 2280 + 0.971 × 60 = 2338.26; × 2 → the quarter hour
    assert result.report["overall"]["gap_p999_s"] == 2338.26
    assert recommended == overall["span_needed_s"] == 5400
    text = flat(summary(result, str(out)))
    assert "Recommended keep_for 5400 s (90 min), from this evidence: the log spans 2 d" in text
    assert "broker bound 1800 s (30 min, given as rabbitmq-consumer)" in text
    assert "too short" not in text
    assert "Recommended keep_for: **" not in (out / "report.md").read_text()
    assert "Recommended keep_for **5400 s (90 min)**" in (out / "report.md").read_text()
    # no leak, but the keep_for in force (3600 s) is below the advised 5400 s: red, not green
    assert result.problems() == ["queue 'jobs': keep_for 3600 s is below the recommended 5400 s"]
    assert "<div class='bad'>" in (out / "report.html").read_text()


def test_no_bound_and_few_duplicates_is_too_short(spark: Any, tmp_path: Path) -> None:
    """Framework "python" (no broker known), a long log, 9 duplicates: too few to advise."""
    log = issue_log(tmp_path / "events.jsonl", framework="python")
    with log.open("a") as handle:
        handle.write(json.dumps(worked.event(86400.0, "purged", None, None)) + "\n")
    result = audit(spark, [str(log)], charts=False)
    advice = result.report["advice"]
    assert advice["broker_bound_s"] is None
    assert advice["broker_bound_source"] is None
    assert advice["min_gaps"] == 20
    overall = advice["overall"]
    assert overall["verdict"] == "too_short"
    assert overall["reasons"] == [
        "it holds 9 duplicate(s) with a measured gap, fewer than 20, and no broker bound is known"
    ]
    assert result.report["overall"]["recommended_keep_for_s"] == 60
    text = flat(summary(result, str(tmp_path)))
    assert "No recommendation" in text
    assert "no broker bound known (give --broker-bound)" in text
    assert "Audit a log spanning at least 60 s with 20+ duplicates, or give your broker's" in text


def test_broker_bound_option_sets_the_bound(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = issue_log(tmp_path / "events.jsonl")
    out = tmp_path / "out"
    code = cli.main(
        ["audit", str(log), "--out", str(out), "--broker-bound", "2h", "--no-charts", "--json"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert report["advice"]["broker_bound_s"] == 7200
    assert report["advice"]["broker_bound_source"] == "option"
    assert report["overall"]["recommended_keep_for_s"] == 7200
    assert report["advice"]["overall"]["verdict"] == "too_short"
    # a broker named alone takes its known default
    code = cli.main(
        ["audit", str(log), "--out", str(out), "--broker-bound", "dramatiq-redis", "--no-charts"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "broker bound 60 s (given as dramatiq-redis)" in flat(captured.out)


def test_missing_pyspark_names_the_spark_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text("")
    for name in [m for m in sys.modules if m == "pyspark" or m.startswith("pyspark.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyspark", None)  # import pyspark → ImportError
    assert cli.main(["audit", str(events), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "pip install 'taskonce[spark]'" in error
    assert "taskonce[all]" not in error


def test_missing_java_is_named_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text("")

    def no_jvm(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("[JAVA_GATEWAY_EXITED] Java gateway process exited")

    monkeypatch.setattr("taskonce.spark_ext.cli.build_session", no_jvm)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("JAVA_HOME", raising=False)
    assert cli.main(["audit", str(events), "--out", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "taskonce: error: taskonce audit: Spark cannot start: Spark needs Java 17+" in error
