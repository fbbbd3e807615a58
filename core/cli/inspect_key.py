"""``taskonce inspect``: one key's record. (Not ``inspect.py``: run as a script, as
spark-submit runs the package's ``__main__.py``, this folder is first on ``sys.path`` and the
name would hide the standard library's ``inspect``.)"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from taskonce import receipts
from taskonce.cli.output import answer, duration_in_words, not_found, queue_column, when
from taskonce.cli.store import key_of, open_existing

NAME = "inspect"
HELP = "show one key's record"
PARENTS = ("common", "store")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """KEY."""
    parser.add_argument(
        "key", metavar="KEY", help="the store key, e.g. payments:<task id> (or --queue QUEUE ID)"
    )


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Show KEY's record: its fields, pending sends and awaited receipts."""
    key = key_of(args)
    with open_existing(args, read_only=True) as store:
        record = store.get(key)
        if record is None:
            return not_found(out, args, store, key, None, f"no live record for key {key!r}")
    utc = bool(getattr(args, "utc", False))
    lease = record.lease_remaining
    rows = {
        "key": record.key,
        "queue": queue_column(record.key),
        "state": record.state,
        "owner": record.owner or "-",
        "fingerprint": record.fingerprint or "-",
        "result": record.result if record.result is not None else "-",
        "created": when(record.created_at, utc),
        "kept until": when(record.expires_at, utc),
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
    answer(out, args, data, "\n".join(lines + awaited))
    return 0
