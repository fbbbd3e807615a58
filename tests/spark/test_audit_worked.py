"""The audit of a hand-worked event log (tests/spark/worked.py): every count, percentile, leak,
stuck claim, recommended window and what-if row is the one worked out by hand; and the output
folder holds exactly this run's tables, report.json (the public shape), report.md and
report.html with PNG charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from taskonce.spark_ext import AuditResult
from tests.spark import worked

DESIGN_TOP = [
    "generated_at",
    "events",
    "keep_for_s",
    "overall",
    "queues",
    "tasks",
    "what_if",
    "handoff",
    "producer",
    "advice",  # added since: new fields may be added, none renamed
]
DESIGN_METRICS = list(worked.metrics())


@pytest.fixture(scope="module")
def run(worked_audit: tuple[AuditResult, Path]) -> tuple[AuditResult, Path]:
    return worked_audit


def test_report_has_designs_exact_shape(run: tuple[AuditResult, Path]) -> None:
    report = run[0].report
    assert list(report) == DESIGN_TOP
    assert report["generated_at"] == "2026-02-01T12:00:00.000Z"
    assert list(report["overall"]) == DESIGN_METRICS
    for group in ("queues", "tasks"):
        for metrics in report[group].values():
            assert list(metrics) == DESIGN_METRICS
    for row in report["what_if"]:
        assert list(row) == ["keep_for_s", "suppressed", "leaked", "store_keys"]
    json.dumps(report)  # serialisable as it is


def test_counts_and_percentiles_overall(run: tuple[AuditResult, Path]) -> None:
    result = run[0]
    assert result.report["events"] == worked.EXPECTED_EVENTS
    assert result.info["malformed"] == worked.EXPECTED_MALFORMED
    assert result.info["percentiles"] == "exact"
    assert result.report["keep_for_s"] == 3600
    assert result.report["overall"] == worked.EXPECTED_OVERALL


def test_per_queue(run: tuple[AuditResult, Path]) -> None:
    queues = run[0].report["queues"]
    assert sorted(queues) == sorted(worked.EXPECTED_QUEUES)
    for name, expected in worked.EXPECTED_QUEUES.items():
        assert queues[name] == expected, name


def test_per_task(run: tuple[AuditResult, Path]) -> None:
    assert run[0].report["tasks"] == worked.EXPECTED_TASKS


def test_what_if(run: tuple[AuditResult, Path]) -> None:
    result = run[0]
    assert result.report["what_if"] == worked.EXPECTED_WHAT_IF
    assert result.what_if[2]["store_bytes"] == {"Redis": 11 * 206, "PostgreSQL": 11 * 381}


def test_details_buckets_rates_keep_for(run: tuple[AuditResult, Path]) -> None:
    details = run[0].details
    assert details["overall"]["buckets"] == {
        "<=1s": 1,  # 1 (the concurrent duplicate)
        "<=1min": 3,  # 2, 30, 60 (60 is "≤ 1 min")
        "<=5min": 0,
        "<=1h": 2,  # 700, 3000
        "<=1d": 1,  # 4000
        ">1d": 0,
    }
    # 7 duplicates (3 skipped + 1 in flight + 3 leaked runs) of 23 deliveries
    assert details["overall"]["duplicates"] == 7
    assert details["overall"]["duplicate_rate"] == pytest.approx(7 / 23)
    assert details["queue:dups"]["duplicate_rate"] == pytest.approx(4 / 6)
    assert details["queue:leak"]["keep_for_in_force_s"] == 600
    assert details["queue:clean"]["keep_for_in_force_s"] == 3600
    assert details["queue:lazy"]["leaked_runs"] == 2
    # one takeover of a silent owner reports its recovery time; the lease_expired one has none
    assert details["overall"]["recovery_p50_s"] == details["overall"]["recovery_max_s"] == 12.5
    assert details["queue:stuck"]["recovery_max_s"] == 12.5
    assert details["queue:dups"]["recovery_max_s"] is None


def test_leaks_stuck_claims_and_problems(run: tuple[AuditResult, Path]) -> None:
    result = run[0]
    assert sorted(row["key"] for row in result.leaks_sample) == ["lazy:k7", "lazy:k8", "leak:k6"]
    stuck = {row["key"]: row for row in result.stuck_sample}
    assert sorted(stuck) == ["stuck:k11", "stuck:k9"]
    assert stuck["stuck:k9"]["open_at_log_end"] is True
    assert stuck["stuck:k11"]["open_at_log_end"] is False
    assert stuck["stuck:k11"]["deadline"].startswith("2026-01-01T00:01:30.000")  # 0 + 60 + 30
    assert result.problems() == [
        "3 key(s) leaked: their handler ran again outside a retry",
        "queue 'dups': keep_for 3600 s is below the recommended 6300 s",
        "queue 'lazy': keep_for 600 s is below the recommended 3600 s",
        "queue 'leak': keep_for 600 s is below the recommended 8100 s",
    ]


def test_advice_per_scope(run: tuple[AuditResult, Path]) -> None:
    """The log ends at 4500 s (the purge); a scope's span runs from its first delivery to
    there, and it is advised when that covers the window it recommends (the given bound, 3600
    s, is known, so no least number of duplicates applies)."""
    advice = run[0].report["advice"]
    assert {k: v for k, v in advice.items() if k not in ("overall", "queues", "tasks")} == {
        "broker_bound_s": 3600,
        "broker_bound_name": "redis-visibility",
        "broker_bound_source": "option",
        "frameworks": [],  # "python": no broker known
        "min_gaps": 0,
    }

    def short(scope: dict[str, Any]) -> tuple[str, float, int, int, int]:
        return (
            scope["verdict"],
            scope["span_s"],
            scope["duplicates"],
            scope["gaps"],
            scope["span_needed_s"],
        )

    assert short(advice["overall"]) == ("too_short", 4500.0, 7, 7, 8100)
    assert {name: short(scope) for name, scope in advice["queues"].items()} == {
        "clean": ("advise", 4500.0, 0, 0, 3600),
        "retry": ("advise", 4500.0, 0, 0, 3600),
        "dups": ("too_short", 4500.0, 4, 4, 6300),
        "leak": ("too_short", 4500.0, 1, 1, 8100),
        "lazy": ("advise", 4490.0, 2, 2, 3600),
        "stuck": ("advise", 4500.0, 0, 0, 3600),
    }
    assert sorted(advice["tasks"]) == sorted(run[0].report["tasks"])
    assert advice["tasks"]["t.dups"] == advice["queues"]["dups"]
    assert advice["overall"]["reasons"] == [
        "it spans less than the 2.2 h window it would recommend (a duplicate that late could "
        "not have shown in it)"
    ]


def test_output_folder(run: tuple[AuditResult, Path], spark: Any) -> None:
    result, out = run
    assert json.loads((out / "report.json").read_text()) == result.report
    assert (out / "notes.txt").read_text() == "mine"  # not ours: left alone
    assert not (out / "tables" / "stale_table").exists()  # an earlier run's: replaced
    markdown = (out / "report.md").read_text()
    assert "stale report" not in markdown
    # the log spans 75 min, less than the 8100 s it would recommend: no recommendation
    assert "**No recommendation: the log is too short to advise**" in markdown
    assert "broker bound 3600 s (60 min, given as redis-visibility)" in markdown
    assert "| lazy | 350.5 | 665.05 | 693.01 | 699.301 | 700 | 600 | 3,600 | advise |" in markdown
    assert "| dups | 45 | 2559 | 2911.8 | 2991.18 | 3000 | 3600 | 6,300 | too short |" in markdown
    assert "| leak:k6 |" in markdown
    assert "![Redelivery gap distribution](charts/gaps.png)" in markdown
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    for name in ("gaps.png", "duplicates.png", "what_if.png"):
        assert (out / "charts" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tables = out / "tables"
    expected_rows = {
        "metrics": 1 + 6 + 5,  # overall, queues, tasks
        "gap_buckets": 6 * 12,
        "what_if": 4,
        "duplicates": 7,
        "leaks": 3,
        "stuck_claims": 2,
    }
    for name, rows in expected_rows.items():
        assert spark.read.parquet(str(tables / name)).count() == rows, name
    gaps = {
        row["key"] + "@" + row["event"]: row["gap_s"]
        for row in spark.read.parquet(str(tables / "duplicates")).collect()
    }
    assert gaps["dups:k4@in_progress_deferred"] == 2.0
    assert gaps["lazy:k8@marked"] == 700.0
    near = spark.read.parquet(str(tables / "duplicates")).filter("near_miss").collect()
    assert [(row["key"], row["gap_s"]) for row in near] == [("dups:k4", 3000.0)]


def test_grouped_classification_is_the_windows(spark: Any, tmp_path: Path) -> None:
    """The audit classifies each event from its key's grouped row (no window); every valid
    event gets the same classification as :func:`classify`'s window over the key's timeline."""
    from taskonce.spark_ext.classification import classified_events as _classified_events
    from taskonce.spark_ext.classification import classify, group_by_key
    from taskonce.spark_ext.inputs import read_events

    events = read_events(
        spark, [str(worked.write_jsonl(tmp_path / "e.jsonl", worked.worked_events()))]
    )
    columns = (
        "seq",
        "key",
        "event",
        "queue_name",
        "task_name",
        "anchor_ms",
        "dup_kind",
        "gap_ms",
        "leaked_run",
        "near_miss",
        "is_delivery",
        "is_run",
        "is_failure",
    )

    def rows(frame: Any) -> list[tuple[Any, ...]]:
        return sorted(tuple(row) for row in frame.filter("is_valid = 1").select(*columns).collect())

    by_window = rows(classify(events, 3600.0))
    by_group = rows(_classified_events(group_by_key(events), 3600.0))
    assert len(by_window) == worked.EXPECTED_EVENTS
    assert by_group == by_window


def test_a_lease_that_is_no_number_of_seconds_gives_no_deadline(spark: Any, tmp_path: Path) -> None:
    """A claim whose ``lease_s`` is NaN, infinite or too large for a deadline in milliseconds
    (a log not written by taskonce, or edited) is not judged stuck, as one without a lease;
    the audit still reads every event and finds the stuck claim beside them."""
    from taskonce.spark_ext import audit

    e = worked.event
    events = [
        e(0, "claimed", "odd:nan", "odd", lease_s=float("nan")),
        e(0, "claimed", "odd:inf", "odd", lease_s=float("inf")),
        e(0, "claimed", "odd:huge", "odd", lease_s=1e300),
        e(0, "claimed", "odd:near-limit", "odd", lease_s=9.223371e15),  # start + lease: no long
        e(0, "claimed", "odd:stuck", "odd", lease_s=60),
        e(1000, "claimed", "odd:last", "odd"),
        e(1001, "completed", "odd:last", "odd"),
    ]
    path = worked.write_jsonl(tmp_path / "odd.jsonl", events, malformed=False)
    result = audit(spark, [str(path)])
    overall = result.report["overall"]
    assert overall["deliveries"] == 6
    assert overall["runs"] == 6
    assert overall["stuck_claims"] == 1
    assert [row["key"] for row in result.stuck_sample] == ["odd:stuck"]


def test_durations_that_are_no_number_are_unknown(spark: Any, tmp_path: Path) -> None:
    """A ``recovery_s``, ``keep_for_s`` or ``duration_ms`` that is NaN or infinite (JSON's
    ``NaN``/``Infinity``: a log not written by taskonce, or edited) is unknown, as if absent:
    the figures come from the numbers beside it, and report.json stays strict JSON."""
    from taskonce.spark_ext import audit

    def e(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return worked.event(*args, **{"keep_for_s": 7200, **kwargs})

    events = [
        e(0, "claimed", "odd:a", "odd", worker="w1:1"),
        e(5, "lease_taken_over", "odd:a", "odd", worker="w2:2", recovery_s=4.0),
        e(6, "completed", "odd:a", "odd", worker="w2:2"),
        e(7, "claimed", "odd:b", "odd", worker="w1:1"),
        e(8, "lease_taken_over", "odd:b", "odd", worker="w2:2", recovery_s=float("nan")),
        e(9, "completed", "odd:b", "odd", worker="w2:2", keep_for_s=float("nan")),
        e(10, "claimed", "odd:c", "odd", worker="w1:1"),
        e(11, "lease_taken_over", "odd:c", "odd", worker="w2:2", recovery_s=float("inf")),
        {
            **e(12, "completed", "odd:c", "odd", worker="w2:2", keep_for_s=float("inf")),
            "duration_ms": float("-inf"),
        },
    ]
    path = worked.write_jsonl(tmp_path / "odd.jsonl", events, malformed=False)
    out = tmp_path / "out"
    result = audit(spark, [str(path)], out=str(out), charts=False)

    def no_constant(name: str) -> None:
        raise AssertionError(f"report.json holds {name}, which strict JSON parsers refuse")

    report = json.loads(
        (out / "report.json").read_text(encoding="utf-8"), parse_constant=no_constant
    )
    assert report["overall"]["takeovers"] == 3
    assert report["overall"]["runs"] == 6
    assert report["keep_for_s"] == 7200
    overall = result.details["overall"]
    assert overall["keep_for_in_force_s"] == 7200
    assert (overall["recovery_p50_s"], overall["recovery_max_s"]) == (4.0, 4.0)
    assert "nan" not in (out / "report.md").read_text(encoding="utf-8").lower()


def test_a_crash_loop_is_counted_as_quarantined_not_stuck(spark: Any, tmp_path: Path) -> None:
    """A key whose handler killed its worker on every run: one claim, three take-overs, then a
    delivery that quarantined it (a failure: dead-lettered), then a copy skipped as
    quarantined. The quarantine ends the last dead owner's claim: nothing is stuck."""
    from taskonce.spark_ext import audit

    e = worked.event
    key = "crashy:k"
    events = [
        e(0, "claimed", key, "crashy", worker="w:1"),
        e(5, "lease_taken_over", key, "crashy", worker="w:2", reason="owner_dead"),
        e(10, "lease_taken_over", key, "crashy", worker="w:3", reason="owner_dead"),
        e(15, "lease_taken_over", key, "crashy", worker="w:4", reason="owner_dead"),
        {**e(20, "quarantined", key, "crashy", worker="w:5", reason="owner_dead"), "count": 4},
        e(600, "duplicate_skipped", key, "crashy", worker="w:5", reason="quarantined"),
        e(601, "claimed", "calm:k", "calm"),
        e(602, "completed", "calm:k", "calm"),
    ]
    path = worked.write_jsonl(tmp_path / "crashy.jsonl", events, malformed=False)
    out = tmp_path / "out"
    audit(spark, [str(path)], out=str(out), charts=False)
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    overall = report["overall"]
    assert (overall["quarantined"], overall["takeovers"], overall["runs"]) == (1, 3, 5)
    assert (overall["deliveries"], overall["failures"], overall["stuck_claims"]) == (7, 1, 0)
    assert overall["duplicates_skipped"] == 1
    assert report["queues"]["crashy"]["quarantined"] == 1
    assert report["queues"]["calm"]["quarantined"] == 0
    assert report["tasks"]["t.crashy"]["quarantined"] == 1
    assert "quarantined" in (out / "report.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("values", [(3600, 7200), (7200, 3600)])
def test_keep_for_in_force_on_a_tie_is_the_longest(
    spark: Any, tmp_path: Path, values: tuple[int, int]
) -> None:
    """Two events at the log's latest millisecond with different ``keep_for_s``: the keep_for
    in force is the longest of them, whichever key, queue or task carries it and in whatever
    order Spark meets them."""
    from taskonce.spark_ext import audit

    e = worked.event
    events = []
    for index, keep_for_s in enumerate(values):
        for queue in ("tq", f"tq{index}"):
            key = f"{queue}:k{index}"
            events += [
                e(0, "claimed", key, queue, keep_for_s=keep_for_s),
                e(1, "completed", key, queue, keep_for_s=keep_for_s),
            ]
    path = worked.write_jsonl(tmp_path / "tie.jsonl", events, malformed=False)
    result = audit(spark, [str(path)])
    assert result.report["keep_for_s"] == 7200
    assert result.details["queue:tq"]["keep_for_in_force_s"] == 7200
    assert result.details["task:t.tq"]["keep_for_in_force_s"] == 7200


def test_samples_break_ties_by_key(spark: Any, tmp_path: Path) -> None:
    """Rows tied on time reach the report's samples in key order, so two runs over the same
    log, however Spark splits it, show the same samples."""
    from taskonce.spark_ext import audit

    e = worked.event
    events = [
        item
        for key in ("tie:b", "tie:c", "tie:a")
        for item in (
            e(0, "claimed", key, "tie"),
            e(1, "completed", key, "tie"),
            e(10, "claimed", key, "tie"),  # ran again: a leak, and a claim never ended
        )
    ] + [e(1000, "claimed", "tie:z", "tie"), e(1001, "completed", "tie:z", "tie")]
    path = worked.write_jsonl(tmp_path / "ties.jsonl", events, malformed=False)
    result = audit(spark, [str(path)], sample_rows=2)
    assert result.report["overall"]["leaks"] == 3
    assert result.report["overall"]["stuck_claims"] == 3
    assert [row["key"] for row in result.leaks_sample] == ["tie:a", "tie:b"]
    assert [row["key"] for row in result.stuck_sample] == ["tie:a", "tie:b"]
