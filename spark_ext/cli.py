"""``taskonce audit EVENTS... --out DIR``: the command-line face of :func:`audit`.

This module imports no Spark at import time, so ``taskonce --help`` works without PySpark;
the ``taskonce`` command (its ``audit`` module in core/cli/) calls :func:`add_arguments` and
:func:`run`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import textwrap
from typing import TYPE_CHECKING, Any, TextIO

from taskonce.errors import ConfigError
from taskonce.spark_ext.inputs import (
    DEBIAN_POSTGRESQL_JAR,
    JdbcSource,
    check_local_paths,
    jdbc_url,
)
from taskonce.spark_ext.semantics import (
    BYTES_PER_KEY,
    DEFAULT_GRACE_S,
    DEFAULT_SAFETY_FACTOR,
    KNOWN_BROKERS,
    advice_text,
    parse_broker_bound,
    parse_duration,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger("taskonce.spark_ext")

#: Exit code when ``--fail-on-leak`` finds leaks or a keep_for below its recommendation.
EXIT_PROBLEMS = 1
#: What to install when PySpark (or matplotlib, for the charts) is missing: the ``spark`` extra
#: of pyproject.toml.
INSTALL_SPARK = "pip install 'taskonce[spark]'"
#: What to install when Spark cannot start for want of Java.
INSTALL_JAVA = "Spark needs Java 17+ (e.g. apt-get install default-jre-headless, or set JAVA_HOME)"


def _import_pyspark() -> None:
    """Raise ImportError naming the ``spark`` extra when PySpark is not installed."""
    try:
        import pyspark.sql  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"the audit needs PySpark ({exc}): {INSTALL_SPARK}") from exc


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bound(text: str) -> tuple[str, float]:
    try:
        return parse_broker_bound(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _windows(text: str) -> list[float]:
    try:
        return [parse_duration(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _size(text: str) -> tuple[str, int]:
    name, sep, value = text.rpartition("=")
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not [STORE=]BYTES: {text!r}") from None
    return (name if sep else "store"), size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``audit`` subcommand's arguments."""
    parser.add_argument(
        "events",
        nargs="*",
        metavar="EVENTS",
        help="event logs: JSONL files (.gz too), Parquet files or folders, globs (quote them "
        "to let Spark expand them, e.g. on HDFS)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (replaced)")
    parser.add_argument(
        "--format", choices=("auto", "json", "parquet"), default="auto", help="input format"
    )
    parser.add_argument(
        "--master", default="local[*]", help="Spark master (default local[*]; yarn, spark://…)"
    )
    parser.add_argument(
        "--driver-memory", default="2g", metavar="SIZE", help="Spark driver memory (default 2g)"
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Spark configuration (repeatable)",
    )
    _add_jdbc_arguments(parser)
    _add_judging_arguments(parser)
    parser.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress line on standard error"
    )
    # The audit reads event logs, never a store: keep the store options it inherits from the
    # commands' common parent out of its --help. (Those action objects are shared with the
    # other commands, so they are filtered at formatting, not changed.)
    parser.formatter_class = _NoStoreOptionsFormatter


def _add_jdbc_arguments(parser: argparse.ArgumentParser) -> None:
    """Where events come from a SQL table instead of files."""
    jdbc = parser.add_argument_group("events from a SQL table (JDBC)")
    jdbc.add_argument(
        "--jdbc-url",
        metavar="URL",
        help="jdbc:postgresql://host:5432/db or postgresql://user@host:5432/db",
    )
    jdbc.add_argument("--jdbc-table", metavar="TABLE", help="the events table")
    jdbc.add_argument(
        "--jdbc-jar",
        metavar="PATH",
        action="append",
        default=[],
        help=f"JDBC driver jar (repeatable; default for PostgreSQL: {DEBIAN_POSTGRESQL_JAR} "
        "when present, from Debian's libpostgresql-jdbc-java); nothing is downloaded",
    )
    jdbc.add_argument("--jdbc-user", metavar="USER", help="database user")
    jdbc.add_argument("--jdbc-driver", metavar="CLASS", help="driver class (default by URL)")


def _add_judging_arguments(parser: argparse.ArgumentParser) -> None:
    """What the audit judges the events by: keep_for, the brokers' bounds, the advice's margin,
    the what-if windows, the store's bytes per key, the exit status for cron and CI."""
    judge = parser.add_argument_group("judging")
    judge.add_argument(
        "--keep-for",
        type=_duration,
        metavar="DURATION",
        help="keep_for to judge near misses by for events that carry none (e.g. 7d)",
    )
    judge.add_argument(
        "--broker-bound",
        type=_bound,
        action="append",
        default=[],
        metavar="[NAME=]DURATION|BROKER",
        help="a broker's redelivery bound, e.g. redis-visibility=1h, 3600, or a broker with a "
        "known default: "
        + ", ".join(f"{n} ({s:g} s)" for n, (s, _) in KNOWN_BROKERS.items())
        + " (repeatable); the recommendation is never below the longest. Without one, the "
        "longest default of the brokers of the framework the events name is assumed",
    )
    judge.add_argument(
        "--safety-factor",
        type=_positive,
        default=DEFAULT_SAFETY_FACTOR,
        help=f"multiplier of the p99.9 gap (default {DEFAULT_SAFETY_FACTOR:g})",
    )
    judge.add_argument(
        "--grace",
        type=_duration,
        default=DEFAULT_GRACE_S,
        metavar="DURATION",
        help=f"a claim not ended within lease + this is stuck (default {DEFAULT_GRACE_S:g}s)",
    )
    judge.add_argument(
        "--simulate-windows",
        type=_windows,
        default=[],
        metavar="LIST",
        help="what-if keep_for values, e.g. 120,300,3600,86400 (or 2m,5m,1h,1d)",
    )
    judge.add_argument(
        "--bytes-per-key",
        type=_size,
        action="append",
        default=[],
        metavar="[STORE=]BYTES",
        help="bytes one key takes in your store (repeatable; default "
        + ", ".join(f"{name} {size}" for name, size in BYTES_PER_KEY.items())
        + ", measured by the benchmarks: docs/performance.md)",
    )
    judge.add_argument(
        "--fail-on-leak",
        action="store_true",
        help=f"exit {EXIT_PROBLEMS} when a key leaked or a queue's keep_for is below its "
        "recommendation (for cron and CI)",
    )


#: Options of the ``taskonce`` commands that address a store; ``audit`` has no use for them.
STORE_OPTIONS = frozenset({"store", "prefix", "table"})


class _NoStoreOptionsFormatter(argparse.HelpFormatter):
    """Help without the options named in :data:`STORE_OPTIONS`."""

    def add_usage(self, usage: Any, actions: Any, groups: Any, prefix: Any = None) -> None:
        kept = [action for action in actions if action.dest not in STORE_OPTIONS]
        super().add_usage(usage, kept, groups, prefix)

    def add_arguments(self, actions: Any) -> None:
        super().add_arguments([action for action in actions if action.dest not in STORE_OPTIONS])


#: Spark's own log (log4j) goes to this file in the output folder unless ``--verbose``.
SPARK_LOG = "spark.log"

_LOG4J2_TO_FILE = """\
status = error
appender.file.type = File
appender.file.name = file
appender.file.fileName = {path}
appender.file.append = false
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = %d{{yyyy-MM-dd HH:mm:ss.SSS}} %p %c: %m%n%ex
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
logger.gateway.name = org.apache.spark.api.python.PythonGatewayServer
logger.gateway.level = info
"""
# The gateway's logger at the root's level keeps Spark from printing "Setting default log level"
# on the console (it does for pyspark's shell-like gateway unless that logger is configured).


def build_session(
    master: str = "local[*]",
    jars: list[str] | None = None,
    driver_memory: str = "2g",
    conf: dict[str, str] | None = None,
    app_name: str = "taskonce-audit",
    log_config: str | None = None,
) -> SparkSession:
    """A SparkSession for the audit: UTC session time zone, no console progress bar (the audit
    draws its own), ``jars`` on the classpath (JDBC drivers), and with ``log_config`` (a log4j2
    configuration file) the driver's logging configured by it from the JVM's start.

    With a ``local`` master and no ``PYSPARK_PYTHON`` in the environment, it sets
    ``PYSPARK_PYTHON`` to this interpreter, so Python work on the executors (``send_rows``)
    runs in the same virtualenv instead of the first ``python3`` on the PATH.

    Raises ImportError naming the ``spark`` extra when PySpark is not installed.
    """
    _import_pyspark()
    from pyspark.sql import SparkSession

    if master.startswith("local") and not os.environ.get("PYSPARK_PYTHON"):
        os.environ["PYSPARK_PYTHON"] = sys.executable

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", driver_memory)
    )
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    conf = dict(conf or {})
    if log_config is not None:
        key = "spark.driver.extraJavaOptions"
        given = conf.get(key, "")
        if "log4j2.configurationFile" not in given:  # a user's own log4j setup wins
            conf[key] = f"-Dlog4j2.configurationFile={log_config} {given}".strip()
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def log_to_file(folder: str) -> str:
    """Write a log4j2 configuration that sends all of Spark's driver log to
    ``folder/spark.log`` (nothing to the console); returns the configuration file's path,
    which lives in a temporary file the caller removes."""
    import tempfile

    os.makedirs(folder, exist_ok=True)
    path = os.path.abspath(os.path.join(folder, SPARK_LOG))
    fd, config = tempfile.mkstemp(prefix="taskonce-log4j2-", suffix=".properties")
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(_LOG4J2_TO_FILE.format(path=path.replace("\\", "/")))
    return config


def check_inputs(args: argparse.Namespace) -> None:
    """Refuse what can be judged without Spark, before its JVM starts: event paths that match
    nothing, an output folder that is a file. Raises :class:`ConfigError` or
    :class:`~taskonce.spark_ext.inputs.AuditInputError`."""
    check_local_paths(args.events)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out {args.out!r} is a file; give a folder")


def _jdbc(args: argparse.Namespace) -> tuple[JdbcSource | None, list[str]]:
    jars = [os.path.expanduser(jar) for jar in args.jdbc_jar]
    for jar in jars:
        if not os.path.isfile(jar):
            raise ConfigError(f"--jdbc-jar: no such file {jar!r}")
    if not args.jdbc_url and not args.jdbc_table:
        return None, jars
    if not (args.jdbc_url and args.jdbc_table):
        raise ConfigError("--jdbc-url and --jdbc-table go together")
    url = jdbc_url(args.jdbc_url)[0]
    if not jars and url.startswith("jdbc:postgresql:"):
        if not os.path.isfile(DEBIAN_POSTGRESQL_JAR):
            raise ConfigError(
                "--jdbc-jar: no PostgreSQL JDBC driver given and "
                f"{DEBIAN_POSTGRESQL_JAR} is missing (apt-get install libpostgresql-jdbc-java)"
            )
        jars = [DEBIAN_POSTGRESQL_JAR]
    source = JdbcSource(
        args.jdbc_url, args.jdbc_table, user=args.jdbc_user, driver=args.jdbc_driver
    )
    return source, jars


def _conf(args: argparse.Namespace) -> dict[str, str]:
    """``--conf KEY=VALUE`` options as Spark settings."""
    conf: dict[str, str] = {}
    for item in args.conf:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--conf wants KEY=VALUE, not {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def _start_spark(
    args: argparse.Namespace, jars: list[str], conf: dict[str, str]
) -> tuple[Any, bool]:
    """The Spark session, and whether the audit owns it (stops it when done): inside a
    running Spark application (a notebook, a test) it uses that application's session."""
    try:
        _import_pyspark()
    except ImportError as exc:
        raise ConfigError(f"taskonce audit: {exc}") from None
    from pyspark.sql import SparkSession

    owned = SparkSession.getActiveSession() is None
    verbose = bool(getattr(args, "verbose", False))
    log_config = log_to_file(args.out) if owned and not verbose else None
    try:
        spark = build_session(args.master, jars, args.driver_memory, conf, log_config=log_config)
    except Exception as exc:
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise ConfigError(f"taskonce audit: Spark cannot start: {INSTALL_JAVA}") from exc
        raise
    finally:
        if log_config is not None:
            os.unlink(log_config)  # log4j2 read it when the JVM started
    return spark, owned


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Run ``taskonce audit``; returns the exit code."""
    from taskonce.spark_ext.audit import audit
    from taskonce.spark_ext.progress import ConsoleProgress

    source, jars = _jdbc(args)
    if not args.events and source is None:
        raise ConfigError("taskonce audit: give event log paths (EVENTS) or --jdbc-url/--table")
    conf = _conf(args)
    bounds: dict[str, float] = {}
    for name, seconds in args.broker_bound:
        bounds[name] = max(seconds, bounds.get(name, 0.0))
    sizes = dict(args.bytes_per_key) or None
    check_inputs(args)
    spark, owned = _start_spark(args, jars, conf)
    progress = None if args.no_progress else ConsoleProgress(spark.sparkContext)
    try:
        result = audit(
            spark,
            args.events,
            jdbc=source,
            fmt=args.format,
            out=args.out,
            keep_for_s=args.keep_for,
            broker_bounds=bounds,
            safety_factor=args.safety_factor,
            simulate_windows=args.simulate_windows,
            grace_s=args.grace,
            bytes_per_key=sizes,
            progress=progress,
            charts=not args.no_charts,
        )
    finally:
        if progress is not None:
            progress.close()
        if owned:
            spark.stop()
    return _answer(args, result, out)


def _answer(args: argparse.Namespace, result: Any, out: TextIO) -> int:
    """Print the result (``--json``: the report); with ``--fail-on-leak`` a problem is a
    non-zero exit, named on stderr."""
    problems = result.problems()
    if getattr(args, "json", False):
        out.write(json.dumps(result.report, sort_keys=False) + "\n")
    else:
        out.write(summary(result, args.out) + "\n")
    if args.fail_on_leak and problems:
        for problem in problems:
            sys.stderr.write(f"taskonce audit: {problem}\n")
        return EXIT_PROBLEMS
    return 0


def summary(result: Any, folder: str) -> str:
    """A few lines for the terminal."""
    report = result.report
    overall = report["overall"]
    advice = report["advice"]
    lines = [
        f"events {report['events']:,}  deliveries {overall['deliveries']:,}  "
        f"keys {overall['distinct_keys']:,}  runs {overall['runs']:,}",
        f"duplicates: {overall['duplicates_skipped']:,} skipped, "
        f"{overall['duplicates_in_flight']:,} in flight; leaks {overall['leaks']:,}; "
        f"near misses {overall['near_misses']:,}; stuck claims {overall['stuck_claims']:,}",
        f"gaps: p50 {overall['gap_p50_s']:g} s, p99 {overall['gap_p99_s']:g} s, "
        f"p99.9 {overall['gap_p999_s']:g} s, max {overall['gap_max_s']:g} s",
        f"keep_for in force {report['keep_for_s']:g} s",
        # the advice with its evidence: a long sentence, wrapped for the terminal
        textwrap.fill(
            advice_text(advice, advice["overall"], overall["recommended_keep_for_s"]),
            width=100,
            subsequent_indent="  ",
            break_on_hyphens=False,
            break_long_words=False,
        ),
    ]
    for row in report["what_if"]:
        lines.append(
            f"what if keep_for={row['keep_for_s']:g} s: {row['suppressed']:,} suppressed, "
            f"{row['leaked']:,} leaked, ~{row['store_keys']:,} keys in the store"
        )
    lines += [f"{problem}" for problem in result.problems()]
    lines.append(f"report: {os.path.join(folder, 'report.html')} (and report.json, report.md)")
    if os.path.exists(os.path.join(folder, SPARK_LOG)):
        lines.append(f"Spark's log: {os.path.join(folder, SPARK_LOG)} (--verbose shows it here)")
    return "\n".join(lines)
