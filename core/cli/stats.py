"""``taskonce stats``: the records per queue, counted by state."""

from __future__ import annotations

import argparse
from typing import TextIO

from taskonce.cli.output import answer, queue_column
from taskonce.cli.store import open_existing
from taskonce.keys import queue_prefix

NAME = "stats"
HELP = "count the records per queue: claimed, completed (eager), marked (lazy)"
PARENTS = ("common", "store")

_COUNTS = ("keys", "in_progress", "completed", "marked", "quarantined", "sends_pending", "receipts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Nothing beyond the store options."""


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Count the store's records (of ``--queue``, or of every queue and all)."""
    queue = getattr(args, "queue", None)
    with open_existing(args, read_only=True) as store:
        expired = store.expired()  # the scan below counts the live ones
        key_prefix = "" if queue is None else queue_prefix(queue)
        queues: dict[str, dict[str, int]] = {}
        for record in store.records(key_prefix):
            row = queues.setdefault(queue_column(record.key), dict.fromkeys(_COUNTS, 0))
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
        rows = sorted(queues.items())
        if queue is None:
            rows.append(("all", total))
        answer(out, args, data, _table(store.describe(), rows, expired))
    return 0


def _table(store: str, rows: list[tuple[str, dict[str, int]]], expired: int) -> str:
    header = (
        f"{'queue':<24} {'keys':>8} {'claimed':>8} {'completed':>10} {'marked':>8} "
        f"{'quarantined':>11} {'unsent':>8} {'receipts':>8}"
    )
    lines = [store, header]
    for name, row in rows:
        lines.append(
            f"{name:<24} {row['keys']:>8} {row['in_progress']:>8} {row['completed']:>10} "
            f"{row['marked']:>8} {row['quarantined']:>11} {row['sends_pending']:>8} "
            f"{row['receipts']:>8}"
        )
    lines.append(f"expired records awaiting purge (every queue): {expired}")
    return "\n".join(lines)
