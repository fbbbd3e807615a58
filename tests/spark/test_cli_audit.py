"""``taskonce audit`` from the command line: inputs checked before Spark starts, Spark's log in a
file instead of the console, no store options in its help; the charts' legends beside the bars,
never over them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import taskonce
from taskonce.cli import main
from tests.helpers import IN_CI

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replaces the session builder: any call means Spark (its JVM) would have started."""
    calls: list[Any] = []

    def refuse(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        raise AssertionError("a SparkSession was built")

    monkeypatch.setattr("taskonce.spark_ext.cli.build_session", refuse)
    return calls


@pytest.mark.parametrize("name", ["missing.jsonl", "logs/*.jsonl", "gone/"])
def test_missing_event_path_fails_before_spark_starts(
    tmp_path: Path, no_spark: list[Any], capsys: pytest.CaptureFixture[str], name: str
) -> None:
    (tmp_path / "logs").mkdir()  # exists, but the glob matches no file in it
    path = str(tmp_path / name)
    out = tmp_path / "out"
    assert main(["audit", path, "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert f"taskonce: error: no event log at {path!r}" in error
    assert "no such file or folder, or a glob that matches nothing" in error
    assert no_spark == []
    assert not out.exists()


def test_every_missing_path_is_named_at_once(
    tmp_path: Path, no_spark: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    present = tmp_path / "events.jsonl"
    present.write_text("")
    first, second = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert main(["audit", first, str(present), second, "--out", str(tmp_path / "o")]) == 2
    assert f"no event log at {first!r}, {second!r} (" in capsys.readouterr().err
    assert no_spark == []


def test_out_that_is_a_file_fails_before_spark_starts(
    tmp_path: Path, no_spark: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    events = tmp_path / "events.jsonl"
    events.write_text("")
    out = tmp_path / "report.txt"
    out.write_text("mine")
    assert main(["audit", str(events), "--out", str(out)]) == 2
    assert f"--out {str(out)!r} is a file; give a folder" in capsys.readouterr().err
    assert no_spark == []
    assert out.read_text() == "mine"


def test_audit_help_has_no_store_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    audit_help = capsys.readouterr().out
    assert "--out DIR" in audit_help
    assert "--store" not in audit_help
    with pytest.raises(SystemExit):
        main(["stats", "--help"])
    assert "--store" in capsys.readouterr().out  # the commands that use a store keep it


def test_spark_log_goes_to_a_file_not_the_console(tmp_path: Path) -> None:
    """A real run (its own JVM): the console shows the summary and no log4j line; Spark's log
    is in ``OUT/spark.log``."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        message = "Java is not installed (apt-get install default-jre-headless)"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    events = tmp_path / "events.jsonl"
    guard = taskonce.Guard(taskonce.MemoryStore(), events=[taskonce.JsonlEvents(events)])
    for i in range(20):
        for _ in range(2):  # every key delivered twice: one run, one duplicate
            guard.run(f"m{i}", "payments", lambda: None)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "taskonce.cli", "audit", str(events), "--out", str(out)]
    done = subprocess.run(
        [*command, "--no-progress", "--master", "local[1]"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    log4j_line = re.compile(r"\b(TRACE|DEBUG|INFO|WARN|ERROR)\b .*:|Setting default log level")
    assert [line for line in done.stderr.splitlines() if log4j_line.search(line)] == []
    assert "duplicates: 20 skipped" in done.stdout
    assert f"Spark's log: {out / 'spark.log'}" in done.stdout
    spark_log = (out / "spark.log").read_text()
    assert "Running Spark version" in spark_log
    assert (out / "report.json").exists()


# -- chart legends -----------------------------------------------------------------------------


def chart_result() -> Any:
    """An audit result shaped like a real one, with tall bars where a legend used to sit (the
    upper left) and several queues."""
    from taskonce.spark_ext.audit import AuditResult
    from taskonce.spark_ext.semantics import GAP_BUCKETS

    queues = ["payments", "emails", "reports", "invoices"]
    timeline = [
        {
            "bucket_start": f"2026-11-23T10:{minute:02d}:00.000Z",
            "queue": queue,
            "duplicates": 30 - minute + 3 * n,
            "deliveries": 100,
        }
        for minute in range(12)
        for n, queue in enumerate(queues)
    ]
    overall = {
        "gap_p50_s": 0.5,
        "gap_p999_s": 30.0,
        "recommended_keep_for_s": 120,
    }
    buckets = {label: 40 - 5 * i for i, (label, _) in enumerate(GAP_BUCKETS)}
    return AuditResult(
        report={"overall": overall, "queues": {}, "what_if": []},
        details={"overall": {"buckets": buckets, "keep_for_in_force_s": 600}},
        what_if=[
            {"keep_for_s": s, "suppressed": 100 - i * 5, "leaked": i * 5}
            for i, s in enumerate([60, 300, 3600, 86400])
        ],
        info={},
        leaks_sample=[],
        stuck_sample=[],
        histogram=[(b / 4 - 2, int(200 / (1 + abs(b - 2)))) for b in range(16)],
        timeline=timeline,
        timeline_bucket_s=60,
        tables={},
    )


@pytest.mark.parametrize("name", ["gaps_figure", "timeline_figure", "what_if_figure"])
def test_chart_legends_do_not_cover_any_bar(name: str) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from taskonce.spark_ext import charts

    figure = getattr(charts, name)(chart_result())
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        legends = [ax.get_legend() for ax in figure.axes if ax.get_legend() is not None]
        assert legends, "the chart has a legend"
        bars = [
            patch.get_window_extent(renderer)
            for ax in figure.axes
            for patch in ax.patches
            if isinstance(patch, Rectangle) and patch.get_height() > 0
        ]
        assert bars
        whole = figure.bbox
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert not [bar for bar in bars if box.overlaps(bar)], "a legend covers bars"
            # inside the image, not cut off at its edge
            assert whole.x0 <= box.x0 and box.x1 <= whole.x1
            assert whole.y0 <= box.y0 and box.y1 <= whole.y1
    finally:
        plt.close(figure)
