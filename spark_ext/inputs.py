"""Reading event logs into one Spark DataFrame: JSONL (plain or gzip), Parquet, or a SQL table
through JDBC.

Whatever the source, the result has the public event fields (docs/how-it-works.md, "Events")
with fixed types, plus ``t_ms`` (the event time in epoch milliseconds, UTC) and ``seq`` (the
row's order in its source, used only to order events of one key that carry the same millisecond).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import math
import os
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from taskonce.errors import TaskonceError
from taskonce.events import FIELDS, Event
from taskonce.spark_ext.semantics import RECHECK_EVENT

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import DataType, StructType

logger = logging.getLogger("taskonce.spark_ext")

#: The Spark type of each public event field (``ts`` is read as text and parsed).
FIELD_TYPES: dict[str, str] = {
    "ts": "string",
    "event": "string",
    "key": "string",
    "queue": "string",
    "message_id": "string",
    "task": "string",
    "framework": "string",
    "mode": "string",
    "worker": "string",
    "attempt": "long",
    "redelivered": "boolean",
    "duration_ms": "double",
    "lease_s": "double",
    "keep_for_s": "double",
    "reason": "string",
    "recovery_s": "double",
    "count": "long",
}
assert tuple(FIELD_TYPES) == FIELDS, "FIELD_TYPES must follow taskonce.events.FIELDS"

CORRUPT_COLUMN = "_corrupt_record"

#: JDBC driver classes by URL scheme (``jdbc:<scheme>:``).
JDBC_DRIVERS = {
    "postgresql": "org.postgresql.Driver",
    "mariadb": "org.mariadb.jdbc.Driver",
    "mysql": "com.mysql.cj.jdbc.Driver",
    "sqlite": "org.sqlite.JDBC",
}
#: Where Debian's ``libpostgresql-jdbc-java`` puts the PostgreSQL driver.
DEBIAN_POSTGRESQL_JAR = "/usr/share/java/postgresql.jar"


class AuditInputError(TaskonceError):
    """An event source cannot be read: a path that matches nothing, an unknown format, a JDBC
    table that cannot be opened."""


@dataclasses.dataclass(frozen=True)
class JdbcSource:
    """A SQL table of events, read through JDBC.

    :param url: ``jdbc:postgresql://host:5432/db`` or an SQLAlchemy-style
        ``postgresql[+driver]://user@host:5432/db`` (converted).
    :param table: the table (or a parenthesised subquery with an alias).
    :param user: the database user (also taken from the URL).
    :param password: the password; default ``$TASKONCE_JDBC_PASSWORD``.
    :param driver: the driver class; default by the URL's scheme.
    :param fetch_size: rows per round trip.
    """

    url: str
    table: str
    user: str | None = None
    password: str | None = None
    driver: str | None = None
    fetch_size: int = 10_000

    def resolved(self) -> tuple[str, dict[str, str]]:
        """The ``jdbc:`` URL and the reader options (driver, user, password, fetch size)."""
        url, user, password = jdbc_url(self.url)
        scheme = url.split(":", 2)[1]
        driver = self.driver or JDBC_DRIVERS.get(scheme)
        if driver is None:
            raise AuditInputError(
                f"no known JDBC driver class for {scheme!r} URLs; give one with --jdbc-driver"
            )
        options = {"driver": driver, "fetchsize": str(self.fetch_size)}
        user = self.user or user
        password = self.password or password or os.environ.get("TASKONCE_JDBC_PASSWORD")
        if user:
            options["user"] = user
        if password:
            options["password"] = password
        return url, options


def jdbc_url(url: str) -> tuple[str, str | None, str | None]:
    """Turn an SQLAlchemy-style database URL into a ``jdbc:`` URL plus user and password.

    ``jdbc:`` URLs pass through unchanged (user and password ``None``).
    """
    if url.startswith("jdbc:"):
        return url, None, None
    parsed = urllib.parse.urlsplit(url)
    scheme = parsed.scheme.split("+", 1)[0]
    if scheme in ("postgres", "postgresql"):
        scheme = "postgresql"
    elif scheme not in ("mysql", "mariadb"):
        raise AuditInputError(f"cannot turn {scheme!r} URL into a JDBC URL; give a jdbc: URL")
    host = parsed.hostname or "localhost"
    port = f":{parsed.port}" if parsed.port else ""
    query = f"?{parsed.query}" if parsed.query else ""
    user = urllib.parse.unquote(parsed.username) if parsed.username else None
    password = urllib.parse.unquote(parsed.password) if parsed.password else None
    return f"jdbc:{scheme}://{host}{port}{parsed.path}{query}", user, password


def event_schema() -> StructType:
    """The schema JSON logs are read with (no inference pass), with a corrupt-record column."""
    from pyspark.sql.types import StringType, StructField, StructType, _parse_datatype_string

    fields = [
        StructField(name, _parse_datatype_string(kind), True) for name, kind in FIELD_TYPES.items()
    ]
    return StructType([*fields, StructField(CORRUPT_COLUMN, StringType(), True)])


_GLOB = re.compile(r"[*?\[{]")


def detect_format(path: str) -> str:
    """``"parquet"`` for ``*.parquet`` paths and folders holding Parquet files, else ``"json"``
    (JSONL, gzip-compressed or not: Spark decompresses ``.gz`` by the file name)."""
    stripped = path.rstrip("/")
    if stripped.endswith(".parquet") or stripped.endswith(".parq"):
        return "parquet"
    local = stripped[len("file://") :] if stripped.startswith("file://") else stripped
    if "://" in local or _GLOB.search(local):
        return "json"
    if os.path.isdir(local):
        found = glob.glob(os.path.join(local, "**", "*.parquet"), recursive=True)
        return "parquet" if found else "json"
    return "json"


def check_local_paths(paths: Sequence[str]) -> None:
    """Raise :class:`AuditInputError` naming every local event path that matches nothing.

    Cheap, and done before Spark starts (its JVM takes seconds to report the same). Paths on
    another file system (``hdfs://``, ``s3a://`` …) and brace globs (``{a,b}``, which only
    Spark expands) are left to Spark.
    """
    missing: list[str] = []
    for path in paths:
        local = path[len("file://") :] if path.startswith("file://") else path
        if "://" in local or "{" in local:
            continue
        local = os.path.expanduser(local)
        found = glob.glob(local) if _GLOB.search(local) else os.path.exists(local)
        if not found:
            missing.append(path)
    if missing:
        raise AuditInputError(
            "no event log at "
            + ", ".join(repr(path) for path in missing)
            + " (no such file or folder, or a glob that matches nothing)"
        )


def read_events(
    spark: SparkSession,
    paths: Sequence[str] = (),
    jdbc: JdbcSource | None = None,
    fmt: str = "auto",
) -> DataFrame:
    """All events of ``paths`` (files, folders, globs) and of the ``jdbc`` table as one
    DataFrame with the public fields (typed), ``t_ms`` and ``seq``; malformed rows are kept with
    ``event`` or ``t_ms`` null (the audit counts and drops them).

    :param fmt: ``"auto"`` (by name), ``"json"`` or ``"parquet"`` for every path.
    """
    from pyspark.errors import AnalysisException

    if not paths and jdbc is None:
        raise AuditInputError("no event source: give event log paths or a JDBC table")
    if fmt not in ("auto", "json", "parquet"):
        raise AuditInputError(f"unknown input format {fmt!r} (auto, json or parquet)")
    groups: dict[str, list[str]] = {}
    for path in paths:
        kind = detect_format(path) if fmt == "auto" else fmt
        groups.setdefault(kind, []).append(os.path.expanduser(path))
    frames: list[DataFrame] = []
    try:
        if "json" in groups:
            raw = (
                spark.read.schema(event_schema())
                .option("mode", "PERMISSIVE")
                .option("columnNameOfCorruptRecord", CORRUPT_COLUMN)
                .json(groups["json"])
            )
            frames.append(_normalise(raw))
        if "parquet" in groups:
            frames.append(_normalise(spark.read.parquet(*groups["parquet"])))
    except AnalysisException as exc:
        raise AuditInputError(f"cannot read the event logs: {_first_line(exc)}") from exc
    if jdbc is not None:
        frames.append(_normalise(_read_jdbc(spark, jdbc)))
    frame = frames[0]
    for other in frames[1:]:
        frame = frame.unionByName(other)
    return frame


def _read_jdbc(spark: SparkSession, source: JdbcSource) -> DataFrame:
    url, options = source.resolved()
    reader = spark.read.format("jdbc").option("url", url).option("dbtable", source.table)
    for name, value in options.items():
        reader = reader.option(name, value)
    try:
        return reader.load()
    except Exception as exc:
        text = _first_line(exc)
        if "ClassNotFoundException" in str(exc) or "No suitable driver" in str(exc):
            text += (
                f" — the JDBC driver {options['driver']} is not on Spark's classpath: give its "
                f"jar with --jdbc-jar (Debian: apt-get install libpostgresql-jdbc-java ships "
                f"{DEBIAN_POSTGRESQL_JAR})"
            )
        raise AuditInputError(f"cannot read JDBC table {source.table!r}: {text}") from exc


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _normalise(frame: DataFrame) -> DataFrame:
    """Select the public fields with their types (missing ones as null), derive ``t_ms``, number
    the rows in source order (before any shuffle)."""
    from pyspark.sql import functions as F

    types: Mapping[str, DataType] = {f.name: f.dataType for f in frame.schema.fields}
    columns: list[Column] = []
    for name, kind in FIELD_TYPES.items():
        if name == "ts":
            continue
        if name in types:
            column = F.col(name).try_cast(kind)
            if kind == "double":
                # a NaN or infinite duration (JSON's NaN/Infinity, a float column) is no number
                # of seconds: unknown, as if absent, so that no figure and no report holds it
                column = F.when(~F.isnan(column) & (F.abs(column) < F.lit(math.inf)), column)
            columns.append(column.alias(name))
        else:
            columns.append(F.lit(None).cast(kind).alias(name))
    ts_type = types.get("ts")
    if ts_type is None:
        ts_ms = F.lit(None).cast("long")
    elif ts_type.typeName() in ("timestamp", "timestamp_ntz"):
        ts_ms = F.unix_millis(F.col("ts").cast("timestamp"))
    elif ts_type.typeName() in ("long", "integer", "double", "float", "decimal"):
        # numeric times: epoch seconds (as Python's time.time()); one that is no time (NaN,
        # infinite, beyond a long of milliseconds) makes its row malformed, not the read fail
        ts_ms = (F.col("ts").cast("double") * 1000).try_cast("long")
    else:
        ts_ms = F.unix_millis(F.col("ts").cast("string").try_cast("timestamp"))
    corrupt = F.col(CORRUPT_COLUMN) if CORRUPT_COLUMN in types else F.lit(None).cast("string")
    # A copy the guard deferred again is named apart, so that it counts as no delivery.
    recheck = (F.col("event") == Event.IN_PROGRESS_DEFERRED.value) & (F.col("reason") == "recheck")
    return frame.select(
        ts_ms.alias("t_ms"),
        *columns,
        corrupt.alias(CORRUPT_COLUMN),
        F.monotonically_increasing_id().alias("seq"),
    ).withColumn("event", F.when(recheck, F.lit(RECHECK_EVENT)).otherwise(F.col("event")))
