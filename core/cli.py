"""The ``taskonce`` command: demo, stats, inspect, release, purge, relay, init-db.

Human output gives times in ISO 8601 (local time, or UTC with ``--utc``) and durations in
words; ``--json`` gives the raw numbers (seconds since the epoch, seconds)."""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import logging
import os
import sqlite3
import sys
import threading
import traceback
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from taskonce import receipts
from taskonce.errors import ConfigError, TaskonceError
from taskonce.events import JsonlEvents
from taskonce.exits import (
    EXIT_BUG,
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    extra_hint,
)
from taskonce.guard import Guard
from taskonce.keys import make_key, queue_of, queue_prefix
from taskonce.stores import Store, open_store, redact

DEFAULT_STORE_PATH = "taskonce.db"
DEFAULT_STORE = f"sqlite:///{DEFAULT_STORE_PATH}"
_SQL_SCHEMES = ("sqlite", "postgresql", "postgres", "mysql", "mariadb")

logger = logging.getLogger("taskonce.cli")

#: How a store key is written, for "no live record" answers.
KEY_FORM = (
    "keys are QUEUE:ID (e.g. celery:<task id>; --queue QUEUE ID builds one), or the message "
    "id alone with identity='id'"
)
#: How many similar keys a "no live record" answer suggests.
SUGGESTIONS = 5


def _store_url(args: argparse.Namespace) -> str:
    """The store URL: ``--store``, else ``$TASKONCE_STORE``, else the default, which is said on
    stderr (an operator must not read the counts of a store they did not mean)."""
    url = getattr(args, "store", None) or os.environ.get("TASKONCE_STORE")
    if url:
        return str(url)
    sys.stderr.write(
        f"taskonce: no --store or TASKONCE_STORE given; using {DEFAULT_STORE} "
        f"({Path(DEFAULT_STORE_PATH).resolve()})\n"
    )
    return DEFAULT_STORE


def _sqlite_file(url: str) -> str | None:
    """The database file of an ``sqlite:///`` URL (None for other stores and in-memory SQLite)."""
    if not url.lower().startswith("sqlite:"):
        return None
    try:
        import sqlalchemy as sa
    except ImportError as exc:
        raise ConfigError(
            f"store URL {redact(url)!r} needs SQLAlchemy ({exc}): pip install 'taskonce[sql]'"
        ) from None

    database = sa.engine.make_url(url).database or ""
    if database.startswith("file:"):  # an SQLite URI filename: file:path?mode=…
        database = database[len("file:") :].split("?", 1)[0]
    return None if database in ("", ":memory:") else database


def _open_existing(args: argparse.Namespace, *, read_only: bool) -> Store:
    """The store of a command that works on existing records: it never creates a database file
    or a table, and a read-only command opens SQLite read-only."""
    url = _store_url(args)
    options = _namespace_options(args, url)
    path = _sqlite_file(url)
    if path is not None and not Path(path).is_file():
        raise TaskonceError(
            f"no store at {url}: {Path(path).resolve()} does not exist (give --store URL or set "
            "TASKONCE_STORE; `taskonce init-db --store URL` creates an SQL store)"
        )
    if url.split("://", 1)[0].split("+", 1)[0].lower() in _SQL_SCHEMES:
        options["create"] = False
    if path is not None and read_only:
        # sqlite3 opens the same file read-only: nothing this command does can write to it
        uri = f"file:{quote(str(Path(path).resolve()))}?mode=ro"
        connect = functools.partial(sqlite3.connect, uri, uri=True, check_same_thread=False)
        options["engine_options"] = {"creator": connect}
    return open_store(url, **options)


def _namespace_options(args: argparse.Namespace, url: str) -> dict[str, Any]:
    """``--prefix`` / ``--table`` as store options; ConfigError when given to the other kind of
    store (they would be silently ignored otherwise)."""
    base = url.split("://", 1)[0].split("+", 1)[0].lower()
    options: dict[str, Any] = {}
    prefix, table = getattr(args, "prefix", None), getattr(args, "table", None)
    if prefix is not None:
        if base not in ("redis", "rediss", "unix"):
            raise ConfigError(f"--prefix applies to a Redis store; {redact(url)} is not one")
        options["prefix"] = prefix
    if table is not None:
        if base not in _SQL_SCHEMES:
            raise ConfigError(f"--table applies to an SQL store; {redact(url)} is not one")
        options["table"] = table
    return options


def _not_for(args: argparse.Namespace, command: str, reason: str, *names: str) -> None:
    """ConfigError when an option that means nothing to ``command`` was given."""
    for name in names:
        if getattr(args, name, None) is not None:
            raise ConfigError(f"{command} takes no --{name}: {reason}")


def _key(args: argparse.Namespace) -> str:
    """KEY as given, or with ``--queue`` the key of message id KEY on that queue."""
    queue = getattr(args, "queue", None)
    return str(args.key) if queue is None else make_key(args.key, queue, "id+queue")


def _queue_of(key: str) -> str:
    """The queue part of a key (keys of identity ``id`` have none: ``-``)."""
    return queue_of(key) or "-"


def _when(timestamp: float, utc: bool) -> str:
    """A store time as ISO 8601, in local time or UTC, to the second."""
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.timezone.utc)
    return (moment if utc else moment.astimezone()).isoformat(timespec="seconds")


def duration_in_words(seconds: float) -> str:
    """``seconds`` as its two largest units: ``4 min 12 s``, ``6 d 23 h``, ``850 ms``."""
    if seconds < 1:
        return f"{max(0.0, seconds) * 1000:.0f} ms"
    rest = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size} {unit}")
            rest %= size
    return " ".join(parts[:2])


def _emit(out: TextIO, args: argparse.Namespace, data: Any, human: str) -> None:
    out.write((json.dumps(data, sort_keys=True) if args.json else human) + "\n")


_COUNTS = ("keys", "in_progress", "completed", "marked", "quarantined", "sends_pending", "receipts")


def _cmd_stats(args: argparse.Namespace, out: TextIO) -> int:
    queue = getattr(args, "queue", None)
    with _open_existing(args, read_only=True) as store:
        expired = int(store.stats()["expired"])
        key_prefix = "" if queue is None else queue_prefix(queue)
        queues: dict[str, dict[str, int]] = {}
        for record in store.records(key_prefix):
            row = queues.setdefault(_queue_of(record.key), dict.fromkeys(_COUNTS, 0))
            row["keys"] += 1
            row["in_progress" if record.state == "claimed" else record.state] += 1
            row["sends_pending"] += int(record.sends_pending)
            row["receipts"] += int(record.receipts is not None)
        total = {name: sum(row[name] for row in queues.values()) for name in _COUNTS}
        data = {
            "store": store.describe(),
            "queue": queue,
            **total,
            "expired": expired,
            "queues": queues,
        }
        header = (
            f"{'queue':<24} {'keys':>8} {'claimed':>8} {'completed':>10} {'marked':>8} "
            f"{'quarantined':>11} {'unsent':>8} {'receipts':>8}"
        )
        lines = [store.describe(), header]
        rows = sorted(queues.items())
        if queue is None:
            rows.append(("all", total))
        for name, row in rows:
            lines.append(
                f"{name:<24} {row['keys']:>8} {row['in_progress']:>8} {row['completed']:>10} "
                f"{row['marked']:>8} {row['quarantined']:>11} {row['sends_pending']:>8} "
                f"{row['receipts']:>8}"
            )
        lines.append(f"expired records awaiting purge (every queue): {expired}")
        _emit(out, args, data, "\n".join(lines))
    return 0


def _similar_keys(store: Store, key: str) -> list[str]:
    """Live keys the operator may have meant by ``key``, which has no record: its message id
    (the text after the last ':') on any queue, or that id alone (identity ``id``)."""
    message_id = key.rpartition(":")[2] or key
    try:
        found = set(store.keys_ending(f":{message_id}", SUGGESTIONS + 1))
    except NotImplementedError:  # a store that cannot list its records
        found = set()
    if message_id != key and store.get(message_id) is not None:
        found.add(message_id)
    found.discard(key)
    return sorted(found)[:SUGGESTIONS]


def _not_found(
    out: TextIO, args: argparse.Namespace, store: Store, key: str, data: Any, human: str
) -> int:
    """The answer for a key without a live record: ``human`` (with --json ``data``, the hint
    then on stderr), how a key is written and the similar live keys; exit status 1."""
    message_id = key.rpartition(":")[2] or key
    similar = _similar_keys(store, key)
    if similar:
        found = f"live keys ending in ':{message_id}': {', '.join(similar)}"
    else:
        found = f"no live key ends in ':{message_id}' either"
    if args.json:
        out.write(json.dumps(data, sort_keys=True) + "\n")
        sys.stderr.write(f"taskonce: {KEY_FORM}\ntaskonce: {found}\n")
    else:
        out.write(f"{human}\n{KEY_FORM}\n{found}\n")
    return EXIT_NOT_FOUND


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    key = _key(args)
    with _open_existing(args, read_only=True) as store:
        record = store.get(key)
        if record is None:
            return _not_found(out, args, store, key, None, f"no live record for key {key!r}")
    utc = bool(getattr(args, "utc", False))
    lease = record.lease_remaining
    rows = {
        "key": record.key,
        "queue": _queue_of(record.key),
        "state": record.state,
        "owner": record.owner or "-",
        "fingerprint": record.fingerprint or "-",
        "result": record.result if record.result is not None else "-",
        "created": _when(record.created_at, utc),
        "kept until": _when(record.expires_at, utc),
        "lease left": duration_in_words(lease) if record.state == "claimed" else "-",
        "sends": f"{len(record.sends)} pending" if record.sends_pending else "-",
        "take-overs": f"{record.crashes} (from dead owners)" if record.crashes else "-",
    }
    lines = [f"{name:<12} {value}" for name, value in rows.items()]
    data = {**record.as_dict(), "queue": rows["queue"]}
    data["sends"] = [json.loads(text) for text in data["sends"]]
    for send in data["sends"]:  # the deferred sends still to publish, in send order
        body = send.get("body") or {}
        name = body.get("task") or body.get("actor_name") or "?"
        lines.append(f"pending send {send['id']} {send['framework']} {name}")
    data["receipts"], awaited = receipts.described(record.receipts)
    _emit(out, args, data, "\n".join(lines + awaited))
    return 0


def _cmd_release(args: argparse.Namespace, out: TextIO) -> int:
    key = _key(args)
    with _open_existing(args, read_only=False) as store:
        existed = store.get(key) is not None
        store.release(key, None)
        data = {"key": key, "released": existed}
        if not existed:
            human = f"no live record for key {key!r}: nothing released"
            return _not_found(out, args, store, key, data, human)
        _emit(out, args, data, f"released {key!r}")
    return EXIT_OK


def _cmd_purge(args: argparse.Namespace, out: TextIO) -> int:
    _not_for(args, "purge", "it deletes the expired records of every queue", "queue")
    events = [JsonlEvents(args.events)] if args.events else []
    guard = Guard(_open_existing(args, read_only=False), events=events)
    try:
        deleted = guard.purge(args.batch)
    finally:
        guard.close()
    _emit(out, args, {"deleted": deleted}, f"purged {deleted} expired record(s)")
    return 0


def _load_object(spec: str, option: str) -> Any:
    """``MODULE:attribute`` imported (the attribute may be dotted)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{option} {spec!r}: expected MODULE:OBJECT, e.g. proj.celery:app")
    sys.path.insert(0, os.getcwd())  # like celery -A: modules of the current directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{option} {spec!r}: cannot import {module_name!r}: {exc}") from None
    value: Any = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ConfigError(f"{option} {spec!r}: {module_name} has no {attribute!r}") from None
    return value


def _relay_guard(args: argparse.Namespace) -> Guard:
    """The guard of the app/broker named on the command line, its publisher registered by
    the adapter (``relay_guard`` of taskonce.celery_ext / taskonce.dramatiq_ext)."""
    if args.celery_app:
        target, adapter = _load_object(args.celery_app, "--celery-app"), "celery_ext"
    elif args.dramatiq_broker:
        target, adapter = _load_object(args.dramatiq_broker, "--dramatiq-broker"), "dramatiq_ext"
    elif getattr(args, "project_guard", None) is not None:  # main(relay_guard=…)
        project: Guard = args.project_guard()
        return project
    else:
        raise ConfigError(
            "taskonce relay needs --celery-app MODULE:app or --dramatiq-broker MODULE:broker: "
            "it publishes the pending sends through that app's or broker's connection"
        )
    module = importlib.import_module(f"taskonce.{adapter}")
    guard: Guard = module.relay_guard(target)
    return guard


def _cmd_relay(args: argparse.Namespace, out: TextIO) -> int:
    guard = _relay_guard(args)
    stop = threading.Event()
    total = 0
    if not args.once:
        # it prints nothing until there is something to publish: say at once that it runs
        sys.stderr.write(
            f"{getattr(args, 'prog', 'taskonce')} relay: running every {args.every:g} s on "
            f"{guard.store.describe()}; Ctrl-C stops it; --once for one sweep\n"
        )
        sys.stderr.flush()
    try:
        while True:
            dispatched = guard.relay(older_than=args.older_than, batch=args.batch)
            total += dispatched
            if dispatched or args.once:
                text = f"published the pending sends of {dispatched} record(s)"
                _emit(out, args, {"dispatched": dispatched}, text)
            if args.once:
                return 0
            if dispatched < args.batch:  # a full batch: more may be waiting, go on at once
                stop.wait(args.every)
    except KeyboardInterrupt:
        logger.info("relay stopped after publishing the sends of %d record(s)", total)
        return 0


def _cmd_init_db(args: argparse.Namespace, out: TextIO) -> int:
    try:
        from taskonce.stores.sql import init_db
    except ImportError as exc:  # its message names the sql extra
        raise ConfigError(str(exc)) from None

    _not_for(args, "init-db", "the table holds every queue", "queue")
    _not_for(args, "init-db", "it creates an SQL store's table", "prefix")
    description = init_db(_store_url(args), getattr(args, "table", None))
    _emit(out, args, {"store": description}, f"ready: {description}")
    return 0


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    if args.framework == "dramatiq":
        from taskonce.demo.dramatiq_demo import run_demo
    else:
        from taskonce.demo.celery_demo import run_demo
    return int(run_demo(store=args.store, broker=args.broker, count=args.count, out=out))


def _cmd_audit(args: argparse.Namespace, out: TextIO) -> int:
    from taskonce.spark_ext.cli import run

    return run(args, out)


def _bench_script() -> Path:
    """bench/store_ops.py of the source checkout this module runs from (a wheel has none)."""
    return Path(__file__).resolve().parent.parent / "bench" / "store_ops.py"


def _cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    import runpy

    script = _bench_script()
    if not script.is_file():
        raise TaskonceError(
            "taskonce bench needs a source checkout: it runs bench/store_ops.py of a clone "
            f"installed with pip install -e . ({script} is not there in this installation)"
        )
    argv = [str(script), *args.bench_args]
    saved, sys.argv = sys.argv, argv
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = saved
    return 0


def build_parser(
    prog: str = "taskonce", commands: Collection[str] | None = None, store: str | None = None
) -> argparse.ArgumentParser:
    """The command's parser; ``commands`` keeps only those commands, and a given ``store`` URL
    is fixed (no ``--store`` option): how ``manage.py taskonce`` uses it."""

    def options(parser: argparse.ArgumentParser, suppress: bool) -> argparse.ArgumentParser:
        # Options may stand before or after the command; the command's copies must not reset
        # what was given before it, so they default to "absent".
        default: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
        if store is None:
            parser.add_argument(
                "--store",
                metavar="URL",
                help=f"store URL (default: $TASKONCE_STORE or {DEFAULT_STORE})",
                **default,
            )
        parser.add_argument(
            "--json", action="store_true", help="machine-readable output", **default
        )
        parser.add_argument(
            "-v", "--verbose", action="store_true", help="log at DEBUG level", **default
        )
        return parser

    common = options(argparse.ArgumentParser(add_help=False), suppress=True)
    # The store commands' own options, absent unless given (each command checks the ones that
    # mean nothing to it).
    absent: dict[str, Any] = {"default": argparse.SUPPRESS}
    store_options = argparse.ArgumentParser(add_help=False)
    store_options.add_argument(
        "--prefix", help="a Redis store's key prefix (default taskonce)", **absent
    )
    store_options.add_argument(
        "--table", help="an SQL store's table (default taskonce_keys)", **absent
    )
    store_options.add_argument(
        "--queue",
        help="only this queue; with KEY, KEY is a message id on this queue",
        **absent,
    )
    store_options.add_argument(
        "--utc", action="store_true", help="times in UTC (default: local time)", **absent
    )
    on_store = [common, store_options]
    parser = options(
        argparse.ArgumentParser(
            prog=prog,
            description="Effectively-once Celery tasks and Dramatiq actors: run the demo,\n"
            "inspect and maintain the store.",
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        ),
        suppress=False,
    )
    if store is not None:
        parser.set_defaults(store=store)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if commands is None or name in commands:
            return sub.add_parser(name, **kwargs)
        return argparse.ArgumentParser(add_help=False)  # not offered: its options go nowhere

    demo = command(
        "demo", parents=[common], help="run the duplicate-delivery demo with a real worker"
    )
    demo.add_argument("--framework", choices=("celery", "dramatiq"), default="celery")
    demo.add_argument("--broker", metavar="URL", help="broker URL (default: embedded)")
    demo.add_argument("--count", type=int, default=300, help="charge tasks to send (default 300)")
    demo.set_defaults(func=_cmd_demo)

    stats = command(
        "stats",
        parents=on_store,
        help="count the records per queue: claimed, completed (eager), marked (lazy)",
    )
    stats.set_defaults(func=_cmd_stats)

    inspect = command("inspect", parents=on_store, help="show one key's record")
    inspect.add_argument(
        "key", metavar="KEY", help="the store key, e.g. payments:<task id> (or --queue QUEUE ID)"
    )
    inspect.set_defaults(func=_cmd_inspect)

    release = command(
        "release", parents=on_store, help="delete one key's record (an operator's release)"
    )
    release.add_argument("key", metavar="KEY")
    release.set_defaults(func=_cmd_release)

    purge = command("purge", parents=on_store, help="delete expired records")
    purge.add_argument("--batch", type=int, default=1000, help="rows per delete (default 1000)")
    purge.add_argument("--events", metavar="FILE", help="append the purged event to this JSONL")
    purge.set_defaults(func=_cmd_purge)

    relay = command(
        "relay",
        parents=[common],
        help="publish deferred sends left pending (a worker died after recording its outcome)",
    )
    target = relay.add_mutually_exclusive_group()
    target.add_argument("--celery-app", metavar="MODULE:APP", help="the Celery app, e.g. proj:app")
    target.add_argument(
        "--dramatiq-broker", metavar="MODULE:BROKER", help="the Dramatiq broker, e.g. proj:broker"
    )
    relay.add_argument("--once", action="store_true", help="one sweep, then exit")
    relay.add_argument(
        "--every", type=float, default=30.0, help="seconds between sweeps (default 30)"
    )
    relay.add_argument(
        "--older-than",
        type=float,
        default=10.0,
        help="only sends pending at least this many seconds (default 10)",
    )
    relay.add_argument("--batch", type=int, default=100, help="records per sweep (default 100)")
    relay.set_defaults(func=_cmd_relay)

    init_db = command("init-db", parents=on_store, help="create the SQL store's table")
    init_db.set_defaults(func=_cmd_init_db)

    from taskonce.spark_ext.cli import add_arguments as add_audit_arguments  # no Spark import

    audit = command(
        "audit", parents=[common], help="audit event logs with Spark; recommend keep_for"
    )
    add_audit_arguments(audit)
    audit.set_defaults(func=_cmd_audit)
    if _bench_script().is_file():  # listed only where it can run: a source checkout
        bench = command(
            "bench",
            help="per-operation store latency against raw Redis/SQL calls (bench/store_ops.py)",
        )
        bench.add_argument(
            "bench_args", nargs=argparse.REMAINDER, help="options of bench/store_ops.py"
        )
        bench.set_defaults(func=_cmd_bench)
    return parser


def main(
    argv: Sequence[str] | None = None,
    out: TextIO | None = None,
    *,
    prog: str = "taskonce",
    commands: Collection[str] | None = None,
    store: str | None = None,
    relay_guard: Callable[[], Guard] | None = None,
) -> int:
    """Entry point of the ``taskonce`` console script; returns the exit code. A command that
    embeds it (``manage.py taskonce``) gives its ``prog``, the ``commands`` it offers, a fixed
    ``store`` URL (no ``--store``) and ``relay``'s guard when no app or broker is named."""
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if (
        argv[:1] == ["bench"]
        and (commands is None or "bench" in commands)
        and (argv[1:2] not in (["-h"], ["--help"]) or not _bench_script().is_file())
    ):
        # bench's options belong to bench/store_ops.py: hand them over untouched (without a
        # checkout, bench is not listed, and says so with or without --help)
        args = argparse.Namespace(command="bench", bench_args=argv[1:], verbose=False)
        args.func = _cmd_bench
    else:
        args = build_parser(prog, commands, store).parse_args(argv)
        args.project_guard = relay_guard
        args.prog = prog
    if not logging.getLogger("taskonce").handlers:  # else its host (Django's LOGGING) did
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.WARNING,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
    try:
        return int(args.func(args, out))
    except TaskonceError as exc:
        sys.stderr.write(f"taskonce: error: {exc}\n")
        return EXIT_ERROR
    except ImportError as exc:
        sys.stderr.write(f"taskonce: error: {exc} ({extra_hint(exc)})\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        sys.stderr.write("taskonce: interrupted\n")
        return EXIT_INTERRUPTED
    except Exception:
        # not one of taskonce's errors: a bug (its traceback), with a status of its own, so
        # that 1 keeps meaning "no record"
        traceback.print_exc()
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
