"""``taskonce purge``: delete the expired records of every queue."""

from __future__ import annotations

import argparse
from typing import TextIO

from taskonce.cli.output import answer
from taskonce.cli.store import open_existing, refuse_options
from taskonce.events import JsonlEvents
from taskonce.guard import Guard

NAME = "purge"
HELP = "delete expired records"
PARENTS = ("common", "store")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--batch`` and ``--events``."""
    parser.add_argument("--batch", type=int, default=1000, help="rows per delete (default 1000)")
    parser.add_argument("--events", metavar="FILE", help="append the purged event to this JSONL")


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Purge through a guard, which emits the ``purged`` event."""
    refuse_options(args, "purge", "it deletes the expired records of every queue", "queue")
    events = [JsonlEvents(args.events)] if args.events else []
    guard = Guard(open_existing(args, read_only=False), events=events)
    try:
        deleted = guard.purge(args.batch)
    finally:
        guard.close()
    answer(out, args, {"deleted": deleted}, f"purged {deleted} expired record(s)")
    return 0
