"""taskonce on Spark: audit event logs and advise the retention window; send rows as messages
with deterministic ids.

- :func:`audit` (and ``taskonce audit EVENTS... --out DIR``): deliveries, duplicates, redelivery
  gaps, leaks, near misses, stuck claims and a recommended ``keep_for``, per queue, per task and
  overall; what-if windows; JSONL, Parquet or JDBC input.
- :func:`send_rows`: one Celery task / Dramatiq message per DataFrame row, its id
  ``uuid5(namespace, key columns)``, so Spark's task re-runs re-send duplicates that the
  consumer's guard suppresses.

Importing this package does not import PySpark; the functions do when called. Definitions of
every figure: docs/audit.md.
"""

from __future__ import annotations

from taskonce.spark_ext.audit import AuditResult, audit, classify
from taskonce.spark_ext.cli import build_session
from taskonce.spark_ext.inputs import AuditInputError, JdbcSource, read_events
from taskonce.spark_ext.producer import namespace_uuid, row_id, send_rows
from taskonce.spark_ext.semantics import nice_window, parse_duration, recommend

__all__ = [
    "AuditInputError",
    "AuditResult",
    "JdbcSource",
    "audit",
    "build_session",
    "classify",
    "namespace_uuid",
    "nice_window",
    "parse_duration",
    "read_events",
    "recommend",
    "row_id",
    "send_rows",
]
