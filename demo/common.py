"""What the Celery and Dramatiq demos share: the run's plan, starting a worker, killing the
victim, event counting, the progress bar, the ledger, the tally and the result table, stopping a
worker's process group. Framework-neutral; used only by ``taskonce demo``."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import signal
import sqlite3
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from taskonce.events import Event

#: the events of a delivery that reached the guard's decision (one each)
DECISIONS = (
    Event.CLAIMED.value,
    Event.LEASE_TAKEN_OVER.value,
    Event.DUPLICATE_SKIPPED.value,
    Event.IN_PROGRESS_DEFERRED.value,
)
#: an order: its id, its amount in cents, and the task / message id it is published with
Order = tuple[str, int, str]


@dataclass(frozen=True)
class Plan:
    """What a demo run works with, decided before anything starts: its temporary directory, the
    random tag in the name of everything it creates, the store and broker URLs, the queue, the
    ledger, the orders, which of them are published twice, and the victim (the order whose
    charge stalls until its worker process is killed)."""

    workdir: Path
    tag: str
    store_url: str
    broker_url: str
    queue: str
    ledger_table: str
    ledger: str
    orders: tuple[Order, ...]
    duplicates: tuple[int, ...]
    victim: int

    @property
    def namespace(self) -> str:
        """The store's (and a Redis broker's) key prefix or table name of this run."""
        return f"taskonce_demo_{self.tag}"

    @property
    def sql(self) -> bool:
        return is_sql(self.store_url)

    @property
    def count(self) -> int:
        return len(self.orders)


def new_plan(
    workdir: Path,
    tag: str,
    *,
    store_url: str,
    broker_url: str,
    queue: str,
    count: int,
    duplicate_every: int,
) -> Plan:
    """The plan of a run: the ledger is a table in an SQL store (so its rows commit with the
    marks), else an SQLite file; the orders' amounts come from a fixed seed; the victim is the
    first order from a third of the way on that is not published twice."""
    ledger_table = f"taskonce_demo_ledger_{tag}"
    ledger = f"sql:{ledger_table}" if is_sql(store_url) else f"sqlite:{workdir / 'ledger.db'}"
    rng = random.Random(20261122)
    orders = [(f"order-{i:04d}", rng.randint(100, 9999), str(uuid.uuid4())) for i in range(count)]
    duplicates = [i for i in range(count) if i % duplicate_every == 2]
    victim = count // 3
    while victim in duplicates and victim + 1 < count:
        victim += 1
    return Plan(
        workdir=workdir,
        tag=tag,
        store_url=store_url,
        broker_url=broker_url,
        queue=queue,
        ledger_table=ledger_table,
        ledger=ledger,
        orders=tuple(orders),
        duplicates=tuple(duplicates),
        victim=victim,
    )


def worker_env(plan: Plan, lease: float) -> dict[str, str]:
    """The environment of a worker process: the demo's app modules read their settings here."""
    return {
        **os.environ,
        "TASKONCE_DEMO_BROKER": plan.broker_url,
        "TASKONCE_DEMO_QUEUE": plan.queue,
        "TASKONCE_DEMO_STORE": plan.store_url,
        "TASKONCE_DEMO_NS": plan.namespace,
        "TASKONCE_DEMO_LEDGER": plan.ledger,
        "TASKONCE_DEMO_DIR": str(plan.workdir),
        "TASKONCE_DEMO_LEASE": str(lease),
    }


def spawn(command: list[str], plan: Plan, env: dict[str, str], log: str) -> subprocess.Popen[bytes]:
    """Start a worker in the run's directory, its output appended to ``log`` there, in a session
    of its own (so :func:`stop` can signal its whole process group)."""
    with open(plan.workdir / log, "ab") as handle:
        return subprocess.Popen(
            command,
            cwd=plan.workdir,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


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
        skipped = counts[Event.DUPLICATE_SKIPPED.value]
        deferred = counts[Event.IN_PROGRESS_DEFERRED.value]
        text = (
            f"{done:>5}/{self.total} charged · {skipped} duplicates skipped · {deferred} deferred"
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


def kill_victim(plan: Plan, progress: Progress, out: TextIO, what: str, note: str = "") -> bool:
    """SIGKILL the worker process that wrote ``victim.pid`` (it is in the middle of the victim's
    charge, which stalls until then) and say so; True once it is killed. False while the file
    is not there or not readable yet, or the process is already gone: the caller tries again."""
    victim_file = plan.workdir / "victim.pid"
    if not victim_file.exists():
        return False
    with contextlib.suppress(ValueError, ProcessLookupError):
        pid = int(victim_file.read_text().strip() or 0)
        if pid <= 0:
            return False  # the file is not written yet: os.kill(0) would kill this demo's group
        os.kill(pid, signal.SIGKILL)
        progress.clear()
        out.write(
            f"  killed {what} {pid} in the middle of {plan.orders[plan.victim][0]} (SIGKILL)"
            f"{note}\n"
        )
        return True
    return False


@dataclass(frozen=True)
class Tally:
    """The numbers of a finished run: the ledger's rows and balance against the expected
    balance, and what the events say was delivered and ran."""

    rows: int
    balance: int
    expected: int
    delivered: int
    ran: int
    interrupted: int


def tally(plan: Plan, counts: collections.Counter[str]) -> Tally:
    """Read the ledger and count: every delivery that reached a decision, every run (a claim or
    a lease taken over), and the runs that did not complete (the killed one)."""
    rows, balance = read_ledger(plan.store_url, plan.ledger, plan.ledger_table)
    ran = counts[Event.CLAIMED.value] + counts[Event.LEASE_TAKEN_OVER.value]
    return Tally(
        rows=rows,
        balance=balance,
        expected=sum(cents for _, cents, _ in plan.orders),
        delivered=sum(counts[name] for name in DECISIONS),
        ran=ran,
        interrupted=ran - counts[Event.COMPLETED.value],
    )


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
                # the store's table, its liveness table (``<table>_live``) and the ledger
                for table in (namespace, f"{namespace}_live", ledger_table):
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
