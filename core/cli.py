"""The ``taskonce`` command: demo, stats, inspect, release, purge, init-db."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from taskonce.errors import TaskonceError
from taskonce.events import JsonlEvents
from taskonce.guard import Guard
from taskonce.stores import open_store

DEFAULT_STORE = "sqlite:///taskonce.db"


def _store_url(args: argparse.Namespace) -> str:
    return str(args.store or os.environ.get("TASKONCE_STORE") or DEFAULT_STORE)


def _emit(out: TextIO, args: argparse.Namespace, data: Any, human: str) -> None:
    out.write((json.dumps(data, sort_keys=True) if args.json else human) + "\n")


def _cmd_stats(args: argparse.Namespace, out: TextIO) -> int:
    with open_store(_store_url(args)) as store:
        stats = dict(store.stats())
        lines = [store.describe()] + [f"  {name:<12} {value}" for name, value in stats.items()]
        _emit(out, args, {"store": store.describe(), **stats}, "\n".join(lines))
    return 0


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    with open_store(_store_url(args)) as store:
        record = store.get(args.key)
        if record is None:
            _emit(out, args, None, f"no live record for key {args.key!r}")
            return 1
        data = record.as_dict()
        width = max(len(name) for name in data)
        _emit(out, args, data, "\n".join(f"{k:<{width}}  {v}" for k, v in data.items()))
    return 0


def _cmd_release(args: argparse.Namespace, out: TextIO) -> int:
    with open_store(_store_url(args)) as store:
        existed = store.get(args.key) is not None
        store.release(args.key, None)
        human = f"released {args.key!r}" if existed else f"nothing recorded for {args.key!r}"
        _emit(out, args, {"key": args.key, "released": existed}, human)
    return 0


def _cmd_purge(args: argparse.Namespace, out: TextIO) -> int:
    events = [JsonlEvents(args.events)] if args.events else []
    guard = Guard(open_store(_store_url(args)), events=events)
    try:
        deleted = guard.purge(args.batch)
    finally:
        guard.close()
    _emit(out, args, {"deleted": deleted}, f"purged {deleted} expired record(s)")
    return 0


def _cmd_init_db(args: argparse.Namespace, out: TextIO) -> int:
    from taskonce.stores.sql import init_db

    description = init_db(_store_url(args), args.table)
    _emit(out, args, {"store": description}, f"ready: {description}")
    return 0


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    if args.framework == "dramatiq":
        from taskonce.dramatiq_ext.demo import run_demo
    else:
        from taskonce.celery_ext.demo import run_demo
    return int(run_demo(store=args.store, broker=args.broker, count=args.count, out=out))


def _cmd_audit(args: argparse.Namespace, out: TextIO) -> int:
    from taskonce.spark_ext.cli import run

    return run(args, out)


def _cmd_bench(args: argparse.Namespace, out: TextIO) -> int:
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "store_ops.py"
    if not script.exists():
        raise TaskonceError(
            "taskonce bench runs bench/store_ops.py of a source checkout (pip install -e .); "
            f"{script} is not there"
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


def build_parser() -> argparse.ArgumentParser:
    def options(parser: argparse.ArgumentParser, suppress: bool) -> argparse.ArgumentParser:
        # Options may stand before or after the command; the command's copies must not reset
        # what was given before it, so they default to "absent".
        default: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
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
    parser = options(
        argparse.ArgumentParser(
            prog="taskonce",
            description="Effectively-once Celery tasks and Dramatiq actors: run the demo, "
            "inspect and maintain the store.",
        ),
        suppress=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo", parents=[common], help="run the duplicate-delivery demo with a real worker"
    )
    demo.add_argument("--framework", choices=("celery", "dramatiq"), default="celery")
    demo.add_argument("--broker", metavar="URL", help="broker URL (default: embedded)")
    demo.add_argument("--count", type=int, default=300, help="charge tasks to send (default 300)")
    demo.set_defaults(func=_cmd_demo)

    stats = sub.add_parser("stats", parents=[common], help="count the records in the store")
    stats.set_defaults(func=_cmd_stats)

    inspect = sub.add_parser("inspect", parents=[common], help="show one key's record")
    inspect.add_argument("key", metavar="KEY", help="the store key, e.g. payments:<task id>")
    inspect.set_defaults(func=_cmd_inspect)

    release = sub.add_parser(
        "release", parents=[common], help="delete one key's record (an operator's release)"
    )
    release.add_argument("key", metavar="KEY")
    release.set_defaults(func=_cmd_release)

    purge = sub.add_parser("purge", parents=[common], help="delete expired records")
    purge.add_argument("--batch", type=int, default=1000, help="rows per delete (default 1000)")
    purge.add_argument("--events", metavar="FILE", help="append the purged event to this JSONL")
    purge.set_defaults(func=_cmd_purge)

    init_db = sub.add_parser("init-db", parents=[common], help="create the SQL store's table")
    init_db.add_argument(
        "--table", default="taskonce_keys", help="table name (default taskonce_keys)"
    )
    init_db.set_defaults(func=_cmd_init_db)

    from taskonce.spark_ext.cli import add_arguments as add_audit_arguments  # no Spark import

    audit = sub.add_parser(
        "audit", parents=[common], help="audit event logs with Spark; recommend keep_for"
    )
    add_audit_arguments(audit)
    audit.set_defaults(func=_cmd_audit)
    bench = sub.add_parser(
        "bench",
        help="per-operation store latency against raw Redis/SQL calls (bench/store_ops.py)",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of bench/store_ops.py")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Entry point of the ``taskonce`` console script; returns the exit code."""
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] not in (["-h"], ["--help"]):
        # bench's options belong to bench/store_ops.py: hand them over untouched
        args = argparse.Namespace(command="bench", bench_args=argv[1:], verbose=False)
        args.func = _cmd_bench
    else:
        args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args, out))
    except TaskonceError as exc:
        sys.stderr.write(f"taskonce: error: {exc}\n")
        return 2
    except ImportError as exc:
        sys.stderr.write(
            f"taskonce: error: {exc} (install the matching extra, e.g. taskonce[all])\n"
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
