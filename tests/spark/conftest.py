"""The Spark tests' session: one ``local[2,2]`` SparkSession for the whole run.

``local[2,2]`` is local mode with 2 worker threads where a failed task is tried twice
(``spark.task.maxFailures=2``; in local mode only the master string sets it): the
``send_rows`` test makes one task fail once on purpose. The PostgreSQL JDBC driver from
Debian's ``libpostgresql-jdbc-java`` is put on the classpath when it is installed.

When Java or Spark cannot start, the Spark tests fail in CI (``CI=true``) and skip locally.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import IN_CI
from tests.spark import worked

POSTGRESQL_JAR = "/usr/share/java/postgresql.jar"


def _unavailable(message: str) -> None:
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """The shared SparkSession (``local[2,2]``, UTC, 2 shuffle partitions)."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        _unavailable("Java is not installed (apt-get install default-jre-headless)")
    try:
        from taskonce.spark_ext import build_session

        jars = [POSTGRESQL_JAR] if os.path.isfile(POSTGRESQL_JAR) else []
        session = build_session(
            "local[2,2]",
            jars=jars,
            driver_memory="1g",
            conf={
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "2",
                "spark.default.parallelism": "2",
            },
            app_name="taskonce-tests",
        )
    except Exception as exc:  # Java missing or broken, PySpark missing
        _unavailable(f"Spark cannot start: {type(exc).__name__}: {exc}")
        raise
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def worked_audit(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """The audit of the hand-worked log (tests/spark/worked.py) as JSONL, written to a folder
    that held an earlier run's leftovers and a file of the user's own."""
    from taskonce.spark_ext import audit

    folder = tmp_path_factory.mktemp("worked")
    log = worked.write_jsonl(folder / "events.jsonl", worked.worked_events())
    out = folder / "out"
    (out / "tables" / "stale_table").mkdir(parents=True)
    (out / "report.md").write_text("stale report")
    (out / "notes.txt").write_text("mine")
    result = audit(
        spark,
        [str(log)],
        out=str(out),
        broker_bounds=worked.BROKER_BOUNDS,
        simulate_windows=worked.WINDOWS,
        grace_s=worked.GRACE_S,
        now=worked.NOW,
    )
    return result, out
