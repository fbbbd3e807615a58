"""What ``taskonce.send_on_commit`` costs a web request, against sending after the commit.

A "request" opens a SQLAlchemy session, inserts one order row, sends one task for it and
commits. Two ways, per framework, calls alternating one by one in the same run (which goes
first alternates too) so that machine noise hits both alike:

- **on_commit + delay**: insert, commit, then ``charge.delay(order_id)`` / ``charge.send(…)``:
  what ``transaction.on_commit`` or an ``after_commit`` hook does (fast, but a crash or a
  broker outage after the commit loses the task);
- **send_on_commit**: insert and send inside ``taskonce.send_on_commit(session)``, commit: the
  send is one more ``INSERT`` in the transaction, published after the commit, then one
  ``UPDATE`` marks it sent.

The broker is a redis-server this script starts on a free port (and stops); the order table
and the store's table are created in the database and dropped afterwards.

Usage (from the repository root)::

    .venv/bin/python bench/producer_outbox.py                    # PostgreSQL, 2000 requests
    .venv/bin/python bench/producer_outbox.py --db mariadb --requests 1000
    .venv/bin/python bench/producer_outbox.py --write-docs
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import taskonce

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_section import command_lines, write_section
from local_redis import start_redis

SECTION = "## Producer outbox: a web request that writes a row and sends a task"
URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}
LABELS = {"postgresql": "PostgreSQL", "mariadb": "MariaDB"}


def frameworks(guard: taskonce.Guard, port: int, queue: str) -> dict[str, Callable[[int], Any]]:
    """The send of each framework, both registered with ``guard``."""
    import dramatiq
    from celery import Celery
    from dramatiq.brokers.redis import RedisBroker

    from taskonce.celery_ext import setup
    from taskonce.dramatiq_ext import IdempotencyMiddleware

    app = Celery("bench", broker=f"redis://127.0.0.1:{port}/0", set_as_current=False)
    app.conf.update(task_default_queue=queue, broker_connection_retry_on_startup=True)
    setup(app, guard)

    @app.task(name="bench.charge")
    def charge(order_id: int) -> None: ...

    broker = RedisBroker(url=f"redis://127.0.0.1:{port}/1")
    broker.add_middleware(IdempotencyMiddleware(guard, relay_every=0))
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=queue, broker=broker)
    def charge_dq(order_id: int) -> None: ...

    return {"Celery": charge.delay, "Dramatiq": charge_dq.send}


def compare(
    engine: sa.Engine, orders: sa.Table, send: Callable[[int], Any], requests: int
) -> tuple[float, float]:
    """Median µs of a request with the block and of one with on_commit + delay."""
    ids = itertools.count(int(time.time() * 1000) % 1_000_000 * 1000)

    def with_block() -> None:
        order_id = next(ids)
        with Session(engine) as session:
            with taskonce.send_on_commit(session):
                session.execute(orders.insert().values(id=order_id))
                send(order_id)
            session.commit()

    def after_commit() -> None:
        order_id = next(ids)
        with Session(engine) as session:
            session.execute(orders.insert().values(id=order_id))
            session.commit()
        send(order_id)

    sides = (with_block, after_commit)
    samples: tuple[list[float], list[float]] = ([], [])
    clock = time.perf_counter_ns
    warm = 50
    for i in range(requests + warm):
        if i % 500 == 0:
            gc.collect()
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            t0 = clock()
            sides[side]()
            if i >= warm:  # the first requests warm connections and statement caches
                samples[side].append((clock() - t0) / 1000.0)
    return statistics.median(samples[0]), statistics.median(samples[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=sorted(URLS), default="postgresql")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    suffix = uuid.uuid4().hex[:8]
    url = URLS[args.db]
    redis, port = start_redis()
    store = taskonce.open_store(url, table=f"bench_outbox_{suffix}")
    engine = sa.create_engine(url)
    orders = sa.Table(
        f"bench_orders_{suffix}", sa.MetaData(), sa.Column("id", sa.BigInteger, primary_key=True)
    )
    orders.create(engine)
    rows = []
    load_before = os.getloadavg()[0]
    try:
        guard = taskonce.Guard(store)
        for name, send in frameworks(guard, port, f"bench{suffix}").items():
            block, plain = compare(engine, orders, send, args.requests)
            rows.append((name, block, plain, block / plain))
    finally:
        orders.drop(engine)
        engine.dispose()
        store._table.drop(store._engine, checkfirst=True)  # type: ignore[attr-defined]
        store._live_table.drop(store._engine, checkfirst=True)  # type: ignore[attr-defined]
        store.close()
        redis.kill()
        redis.wait()
    load_after = os.getloadavg()[0]
    header = "| framework | send_on_commit (µs) | on_commit + delay (µs) | ratio |"
    lines = [header, "| --- | ---: | ---: | ---: |"]
    lines += [f"| {n} | {b:,.0f} | {p:,.0f} | {r:.2f}x |" for n, b, p, r in rows]
    table = "\n".join(lines)
    print(table)
    if args.write_docs:
        command = ".venv/bin/python bench/producer_outbox.py " + " ".join(argv or sys.argv[1:])
        intro = (
            f"Median time of one request on {LABELS[args.db]} — open a session, insert one "
            "order row, send one task, commit — with `taskonce.send_on_commit` against sending "
            "after the commit (`on_commit` + `delay`), Redis broker, "
            f"{args.requests} requests per side, the two sides alternating request by request "
            f"in one run (load average {load_before:.2f} at the start, {load_after:.2f} at the "
            f"end, on {os.cpu_count()} CPUs). Ratio: above 1 is slower. The block adds one "
            "`INSERT` to the transaction and one `UPDATE` after the publish: the price of a "
            "send that survives a crash or a broker outage after the commit."
        )
        write_section("\n".join([SECTION, "", intro, "", table, "", *command_lines(command)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
