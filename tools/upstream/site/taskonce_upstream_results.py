"""pytest plugin (``-p taskonce_upstream_results``): one JSON line per test phase, written as
the phase ends, to the file named by ``TASKONCE_UPSTREAM_RESULTS``. A run stopped at its
deadline still leaves the outcome of every test it finished (a JUnit report is written only
at the end of the session)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

RESULTS_ENV = "TASKONCE_UPSTREAM_RESULTS"


def _reason(report: pytest.TestReport) -> str:
    crash: Any = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message)
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        return str(report.longrepr[-1])
    return str(report.longrepr or "")


def _taskonce_log(report: pytest.TestReport) -> list[str]:
    """taskonce's warnings and errors in the phase's captured log: why a test that only timed
    out failed (a task refused in the worker shows there, not in the test's exception)."""
    seen: list[str] = []
    for name, content in report.sections:
        if "log" not in name:
            continue
        for text in content.splitlines():
            if "taskonce" in text and ("ERROR" in text or "WARNING" in text):
                if text not in seen:
                    seen.append(text[:1000])
    return seen[:5]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append this phase's outcome (and, when it did not pass, its reason)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    line: dict[str, Any] = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.outcome != "passed":
        line["reason"] = _reason(report)[:2000]
    # also from a passing phase: a test's subtest fails in a report of its own, while what
    # the worker logged meanwhile is in the test's call report
    notes = _taskonce_log(report)
    if notes:
        line["taskonce_log"] = notes
    if hasattr(report, "wasxfail"):
        line["xfail"] = True
    line["duration"] = round(report.duration, 3)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
