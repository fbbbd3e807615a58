"""What the Celery and Dramatiq demos share: event counting, the progress bar, the ledger,
the result table, stopping a worker's process group. Framework-neutral; used only by
``taskonce demo``."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import TextIO


class Events:
    """Counts the events the worker processes append to the JSONL file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.counts: collections.Counter[str] = collections.Counter()

    def update(self) -> collections.Counter[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return self.counts
        end = data.rfind(b"\n") + 1  # only whole lines; a line being written waits
        for line in data[:end].splitlines():
            if line.strip():
                self.counts[json.loads(line)["event"]] += 1
        self.offset += end
        return self.counts


class Progress:
    """A progress bar on a terminal; a line per quarter elsewhere."""

    def __init__(self, out: TextIO, total: int) -> None:
        self.out = out
        self.total = max(total, 1)
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.quarter = -1

    def draw(self, done: int, counts: collections.Counter[str]) -> None:
        text = (
            f"{done:>5}/{self.total} charged · {counts['duplicate_skipped']} duplicates skipped"
            f" · {counts['in_progress_deferred']} deferred"
        )
        if self.tty:
            width = 28
            filled = min(width, width * done // self.total)
            self.out.write(f"\r  [{'█' * filled}{'░' * (width - filled)}] {text}")
            self.out.flush()
            return
        quarter = min(4, 4 * done // self.total)
        if quarter > self.quarter:
            self.quarter = quarter
            self.out.write(f"  {100 * done // self.total:>3}%  {text}\n")
            self.out.flush()

    def clear(self) -> None:
        if self.tty:
            self.out.write("\r" + " " * 90 + "\r")

    def end(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def dollars(cents: int) -> str:
    return f"${cents / 100:,.2f}"


def report(
    out: TextIO,
    lines: list[tuple[str, str, str]],
    *,
    ledger_rows: int,
    orders: int,
    expected: int,
    balance: int,
    ok: bool,
    started: float,
    workdir: Path,
) -> int:
    """Print the result table — the framework's own ``lines`` (label, value, note), then the
    ledger's — and how long the demo took; the exit code: 0 when ``ok``, else 1."""
    lines = [
        *lines,
        ("ledger rows", str(ledger_rows), f"of {orders} orders"),
        ("balance expected", dollars(expected), ""),
        ("balance seen", dollars(balance),
         "✓ every order charged exactly once" if ok else "✗ MISMATCH"),
    ]  # fmt: skip
    for label, value, note in lines:
        out.write(f"  {label:<19} {value:>11}   {note}".rstrip() + "\n")
    out.write(f"\n  finished in {time.monotonic() - started:.1f}s")
    if not ok:
        out.write(f"; files kept in {workdir}")
    out.write("\n")
    out.flush()
    return 0 if ok else 1


_TABLE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def write_ledger(ledger: str, order_id: str, cents: int) -> None:
    """Append one charge to the demo's ledger: ``sql:<table>`` inside the handler's
    transaction (:func:`taskonce.current_session`), or ``sqlite:<path>`` in a connection of its
    own."""
    kind, _, target = ledger.partition(":")
    if kind == "sql":
        from sqlalchemy import text

        from taskonce.session import current_session

        if not _TABLE_NAME.match(target):
            raise ValueError(f"bad ledger table {target!r}")
        statement = f"INSERT INTO {target} (order_id, cents) VALUES (:order_id, :cents)"  # noqa: S608 - name checked above
        current_session().execute(text(statement), {"order_id": order_id, "cents": cents})
    elif kind == "sqlite":
        with sqlite3.connect(target, timeout=30) as conn:
            conn.execute("INSERT INTO ledger (order_id, cents) VALUES (?, ?)", (order_id, cents))
    else:
        raise ValueError(
            f"TASKONCE_DEMO_LEDGER={ledger!r} is neither sql:<table> nor sqlite:<path>"
        )


def is_sql(url: str) -> bool:
    return not url.startswith(("redis", "rediss", "unix", "memory"))


def prepare_ledger(store_url: str, ledger: str, table: str) -> None:
    kind, _, target = ledger.partition(":")
    if kind == "sqlite":
        import sqlite3

        with sqlite3.connect(target) as conn:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS ledger (id INTEGER PRIMARY KEY, order_id TEXT, "
                "cents INTEGER)"
            )
        return
    import sqlalchemy as sa

    engine = sa.create_engine(store_url)
    try:
        metadata = sa.MetaData()
        sa.Table(
            table,
            metadata,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("order_id", sa.String(64), nullable=False),
            sa.Column("cents", sa.Integer, nullable=False),
        )
        metadata.create_all(engine)
    finally:
        engine.dispose()


def read_ledger(store_url: str, ledger: str, table: str) -> tuple[int, int]:
    kind, _, target = ledger.partition(":")
    if kind == "sqlite":
        import sqlite3

        with sqlite3.connect(target, timeout=30) as conn:
            row = conn.execute("SELECT count(*), coalesce(sum(cents), 0) FROM ledger").fetchone()
        return int(row[0]), int(row[1])
    import sqlalchemy as sa

    engine = sa.create_engine(store_url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                # the table name is the demo's own, generated above
                sa.text(f"SELECT count(*), coalesce(sum(cents), 0) FROM {table}")  # noqa: S608
            ).one()
        return int(row[0]), int(row[1])
    finally:
        engine.dispose()


def stop(worker: subprocess.Popen[bytes]) -> None:
    """Stop a worker's whole process group: TERM, then KILL."""
    with contextlib.suppress(ProcessLookupError):
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(timeout=5)
        os.killpg(worker.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.wait(timeout=5)


def tail(path: Path, out: TextIO, lines: int = 15) -> None:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return
    for line in text:
        out.write(f"    {line}\n")


def clean_store(store_url: str, namespace: str, ledger_table: str, temporary: bool) -> None:
    """Remove the demo's records (and ledger table) from a store the user named."""
    if temporary:
        return  # inside the temporary directory
    if is_sql(store_url):
        import sqlalchemy as sa

        engine = sa.create_engine(store_url)
        try:
            with engine.begin() as conn:
                for table in (namespace, ledger_table):
                    conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
        finally:
            engine.dispose()
        return
    delete_redis_keys(store_url, f"{namespace}:*")


def delete_redis_keys(url: str, pattern: str) -> None:
    """Delete the keys matching ``pattern`` (``SCAN MATCH``) from the Redis at ``url``, in
    batches of 1000."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=pattern, count=1000))
        for start in range(0, len(keys), 1000):
            client.delete(*keys[start : start + 1000])
    finally:
        client.close()
