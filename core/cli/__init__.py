"""The ``taskonce`` command: demo, stats, inspect, release, purge, relay, init-db, audit, bench.

One module per command, each with its ``NAME``, ``HELP``, the shared option groups it takes
(``PARENTS``), ``add_arguments(parser)`` and ``run(args, out)``; this module builds the parser
from them and runs the one given. Human output gives times in ISO 8601 (local time, or UTC
with ``--utc``) and durations in words; ``--json`` gives the raw numbers (seconds since the
epoch, seconds)."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Callable, Collection, Sequence
from types import ModuleType
from typing import Any, TextIO

from taskonce.cli import (
    audit,
    bench,
    demo,
    init_db,
    inspect_key,
    purge,
    relay,
    release,
    stats,
)
from taskonce.cli.store import DEFAULT_STORE
from taskonce.errors import TaskonceError
from taskonce.exits import EXIT_BUG, EXIT_CODES, EXIT_ERROR, EXIT_INTERRUPTED, extra_hint
from taskonce.guard import Guard

#: The commands, in the order ``--help`` lists them (bench only in a source checkout, where
#: it can run).
COMMANDS: tuple[ModuleType, ...] = (
    demo,
    stats,
    inspect_key,
    release,
    purge,
    relay,
    init_db,
    audit,
    bench,
)


def _global_options(
    parser: argparse.ArgumentParser, store: str | None, suppress: bool
) -> argparse.ArgumentParser:
    """``--store`` (unless the URL is fixed), ``--json`` and ``--verbose``. Options may stand
    before or after the command; the command's copies (``suppress``) must not reset what was
    given before it, so they default to "absent"."""
    default: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {}
    if store is None:
        parser.add_argument(
            "--store",
            metavar="URL",
            help=f"store URL (default: $TASKONCE_STORE or {DEFAULT_STORE})",
            **default,
        )
    parser.add_argument("--json", action="store_true", help="machine-readable output", **default)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at DEBUG level", **default
    )
    return parser


def _store_options() -> argparse.ArgumentParser:
    """The store commands' own options, absent unless given (each command checks the ones
    that mean nothing to it)."""
    absent: dict[str, Any] = {"default": argparse.SUPPRESS}
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--prefix", help="a Redis store's key prefix (default taskonce)", **absent)
    options.add_argument("--table", help="an SQL store's table (default taskonce_keys)", **absent)
    options.add_argument(
        "--queue",
        help="only this queue; with KEY, KEY is a message id on this queue",
        **absent,
    )
    options.add_argument(
        "--utc", action="store_true", help="times in UTC (default: local time)", **absent
    )
    return options


def build_parser(
    prog: str = "taskonce", commands: Collection[str] | None = None, store: str | None = None
) -> argparse.ArgumentParser:
    """The command's parser; ``commands`` keeps only those commands, and a given ``store`` URL
    is fixed (no ``--store`` option): how ``manage.py taskonce`` uses it."""
    parents = {
        "common": _global_options(argparse.ArgumentParser(add_help=False), store, suppress=True),
        "store": _store_options(),
    }
    parser = _global_options(
        argparse.ArgumentParser(
            prog=prog,
            description="Effectively-once Celery tasks and Dramatiq actors: run the demo,\n"
            "inspect and maintain the store.",
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        ),
        store,
        suppress=False,
    )
    if store is not None:
        parser.set_defaults(store=store)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        if commands is not None and command.NAME not in commands:
            continue
        if command is bench and not bench.script().is_file():
            continue
        found = [parents[name] for name in command.PARENTS]
        command_parser = sub.add_parser(command.NAME, parents=found, help=command.HELP)
        command.add_arguments(command_parser)
        command_parser.set_defaults(func=command.run)
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
        and (argv[1:2] not in (["-h"], ["--help"]) or not bench.script().is_file())
    ):
        # bench's options belong to bench/store_ops.py: hand them over untouched (without a
        # checkout, bench is not listed, and says so with or without --help)
        args = argparse.Namespace(command="bench", bench_args=argv[1:], verbose=False)
        args.func = bench.run
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


__all__ = ["COMMANDS", "build_parser", "main"]
