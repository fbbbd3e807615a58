"""What receipts cost: a guarded task that sends one child, with receipts off and on, in one run.

Each message is ``Guard.run`` of an eager task whose body sends one child through the hand-off:
claim, the body, the completion with the send recorded, the publish (an ``LPUSH`` on a broker
list of a redis-server of the benchmark's own, as a Redis broker's publish is), and the write
that marks it sent. With receipts on (``confirm_within=300``, the default) the publisher also
names the receiver's key and that last write keeps the send awaiting its receipt and adds the
record to the receipts index: same round trip, a few more bytes. Off is ``confirm_within=0``.
The variants alternate batch by batch; the ratio is the median of the *on* batches over the
median of the *off* batches.

Off the hot path, the relay's look at a record whose receipt came (the common case): take the
due record, read the receiver's record, clear the receipts — per record, over a batch; and one
idle sweep (nothing due).

Stores: the Redis store on the local Redis (database 13) and the PostgreSQL store (database
``test``, a table of its own, dropped afterwards).

    .venv/bin/python bench/receipts_cost.py [--messages 500] [--rounds 7] [--write-docs]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h
import redis

import taskonce
from taskonce import handoff
from taskonce.handoff import Receipt, Send

KEEP = 7 * 86400.0
STORES = {
    "Redis": "redis://127.0.0.1:6379/13",
    "PostgreSQL": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
}


def publisher(broker: Any, queue: str) -> Callable[[Send], Receipt | None]:
    """A broker publish (LPUSH of the send's JSON), answering a receipt as the Celery and
    Dramatiq publishers do: only for a send that awaits one."""

    def publish(send: Send) -> Receipt | None:
        broker.lpush(queue, send.to_json())
        if not send.within:
            return None
        return Receipt(f"child:{send.id}", KEEP)

    return publish


def body() -> None:
    capture = handoff.current()
    assert capture is not None
    capture.add("python", {"task": "child", "args": [1]})


def open_store(url: str, name: str) -> taskonce.Store:
    options = {"prefix": name} if url.startswith("redis") else {"table": name}
    return taskonce.open_store(url, **options)


def clear(store: taskonce.Store, url: str, name: str) -> None:
    if url.startswith("redis"):
        h.drop_keys(redis.Redis.from_url(url), name)
    else:
        import sqlalchemy as sa

        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{name}"'))
        engine.dispose()


def measure(url: str, broker: Any, messages: int, rounds: int) -> dict[str, float]:
    """µs per message of each variant (median of its batches), and the relay's costs."""
    name = f"rc{uuid.uuid4().hex[:8]}"
    store = open_store(url, name)
    queue = f"{name}.children"
    guards = {
        within: taskonce.Guard(store, default=taskonce.Policy(confirm_within=within, keep_for=KEEP))
        for within in (0.0, 300.0)
    }
    for guard in guards.values():
        guard.register_publisher("python", publisher(broker, queue))
    batches: dict[float, list[float]] = {0.0: [], 300.0: []}
    try:
        for guard in guards.values():  # warm the connections and scripts
            for _ in range(20):
                guard.run(uuid.uuid4().hex, "q", body)
        for _, within in h.interleaved(rounds, list(batches)):
            guard = guards[within]
            ids = [uuid.uuid4().hex for _ in range(messages)]
            start = time.perf_counter()
            for message_id in ids:
                guard.run(message_id, "q", body)
            batches[within].append((time.perf_counter() - start) * 1e6 / messages)
            broker.delete(queue)
        figures = {
            "off": statistics.median(batches[0.0]),
            "on": statistics.median(batches[300.0]),
        }
        figures.update(relay_costs(store, broker, queue, messages))
        return figures
    finally:
        for guard in guards.values():
            guard.close()
        broker.delete(queue)
        clear(store, url, name)
        store.close()


def relay_costs(store: taskonce.Store, broker: Any, queue: str, messages: int) -> dict[str, float]:
    """The relay's look per record whose receipt came, and an idle sweep, in µs."""
    guard = taskonce.Guard(store, default=taskonce.Policy(confirm_within=0.01, keep_for=KEEP))
    guard.register_publisher("python", publisher(broker, queue))
    try:
        guard.relay(older_than=0, batch=100_000)  # nothing left due from the timed batches
        for _ in range(messages):
            guard.run(uuid.uuid4().hex, "q", body)
        for send in [Send.from_json(text) for text in broker.lrange(queue, 0, -1)]:
            guard.run(send.id, "child", lambda: None)  # each child arrives: its receipt
        time.sleep(0.2)  # every record is due (0.01 s) by the store's clock
        start = time.perf_counter()
        guard.relay(older_than=0, batch=messages)
        look = (time.perf_counter() - start) * 1e6 / messages
        assert store.stats()["receipts_awaited"] == 0, "a receipt was not seen"
        idle = []
        for _ in range(200):
            start = time.perf_counter()
            guard.relay(older_than=0)
            idle.append((time.perf_counter() - start) * 1e6)
        return {"look": look, "idle": statistics.median(idle)}
    finally:
        guard.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    load_start = h.loadavg()
    server = h.RedisServer().start()
    rows = []
    try:
        broker = redis.Redis.from_url(server.url)
        for label, url in STORES.items():
            figures = measure(url, broker, args.messages, args.rounds)
            rows.append(
                (
                    label,
                    f"{figures['off']:,.0f}",
                    f"{figures['on']:,.0f}",
                    f"{figures['on'] / figures['off']:.2f}×",
                    f"{figures['look']:,.0f}",
                    f"{figures['idle']:,.0f}",
                )
            )
    finally:
        server.kill()
    text = h.table(
        (
            "store",
            "receipts off, µs per message",
            "receipts on, µs per message",
            "on / off",
            "relay's look per record (receipt came), µs",
            "idle sweep, µs",
        ),
        rows,
        "lrrrrr",
    )
    command = h.command_line("bench/receipts_cost.py")
    text = (
        f"{args.messages} messages per batch, {args.rounds} batches of each variant.\n\n"
        + text
        + "\n\n"
        + h.measured_line(command, load_start)
    )
    print(text)
    if args.write_docs:
        h.write_block("receipts-cost", text)


if __name__ == "__main__":
    main()
