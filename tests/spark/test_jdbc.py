"""Events read from a PostgreSQL table through JDBC give the same report as the JSONL log of
the same events. The driver is Debian's libpostgresql-jdbc-java jar (nothing is downloaded); in
CI a missing jar fails this test."""

from __future__ import annotations

import datetime
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from taskonce.events import FIELDS
from taskonce.spark_ext import AuditResult, JdbcSource, audit
from taskonce.spark_ext.inputs import FIELD_TYPES
from tests.helpers import IN_CI, POSTGRES_URL, require_service
from tests.spark import worked
from tests.spark.conftest import POSTGRESQL_JAR

# One column per public event field, in order (the table a user would load events into).
_SQL_TYPES = {
    "string": "text",
    "long": "bigint",
    "boolean": "boolean",
    "double": "double precision",
}
COLUMNS = ", ".join(
    f"{name} {'timestamptz' if name == 'ts' else _SQL_TYPES[FIELD_TYPES[name]]}" for name in FIELDS
)


@pytest.fixture
def events_table() -> Iterator[str]:
    require_service("postgresql")
    if not os.path.isfile(POSTGRESQL_JAR):
        message = (
            f"{POSTGRESQL_JAR} is missing: apt-get install libpostgresql-jdbc-java "
            "(the JDBC driver Spark reads PostgreSQL with)"
        )
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    import psycopg

    table = f"taskonce_events_{uuid.uuid4().hex[:10]}"
    dsn = POSTGRES_URL.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as connection:
        connection.execute(f"CREATE TABLE {table} ({COLUMNS})")
        with connection.cursor() as cursor:
            rows = []
            for item in worked.worked_events():
                moment = datetime.datetime.strptime(item["ts"], "%Y-%m-%dT%H:%M:%S.%fZ")
                values = [item.get(name) for name in FIELDS[1:]]
                rows.append((moment.replace(tzinfo=datetime.timezone.utc), *values))
            cursor.executemany(
                f"INSERT INTO {table} VALUES ({', '.join(['%s'] * len(FIELDS))})",
                rows,
            )
    try:
        yield table
    finally:
        with psycopg.connect(dsn, autocommit=True) as connection:
            connection.execute(f"DROP TABLE IF EXISTS {table}")


def test_jdbc_report_equals_jsonl_report(
    spark: Any, events_table: str, worked_audit: tuple[AuditResult, Path]
) -> None:
    from_jsonl = worked_audit[0]
    from_sql = audit(
        spark,
        jdbc=JdbcSource("postgresql://postgres@127.0.0.1:5432/test", events_table),
        broker_bounds=worked.BROKER_BOUNDS,
        simulate_windows=worked.WINDOWS,
        grace_s=worked.GRACE_S,
        now=worked.NOW,
    )
    assert from_sql.report == from_jsonl.report
    assert from_sql.report["overall"] == worked.EXPECTED_OVERALL
    assert from_sql.details == from_jsonl.details
    assert from_sql.info["malformed"] == 0  # the JSONL had 2 malformed lines; the table none


def test_jdbc_url_forms() -> None:
    url, options = JdbcSource("postgresql+psycopg://bob:s%40cret@db:5433/app", "t").resolved()
    assert url == "jdbc:postgresql://db:5433/app"
    assert options["user"] == "bob" and options["password"] == "s@cret"
    assert options["driver"] == "org.postgresql.Driver"
    url, options = JdbcSource("jdbc:postgresql://h/db?ssl=true", "t", user="u").resolved()
    assert url == "jdbc:postgresql://h/db?ssl=true" and options["user"] == "u"
