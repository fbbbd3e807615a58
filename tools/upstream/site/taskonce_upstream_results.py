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


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Append this phase's outcome (and, when it did not pass, its reason)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    line: dict[str, Any] = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    if report.outcome != "passed":
        line["reason"] = _reason(report)[:2000]
    if hasattr(report, "wasxfail"):
        line["xfail"] = True
    line["duration"] = round(report.duration, 3)
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(line) + "\n")
