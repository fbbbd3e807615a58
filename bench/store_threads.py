"""RedisStore claim + complete from many threads of one process, beside raw redis-py calls.

Dramatiq runs 8 worker threads per process by default; each guarded message costs one
``claim`` and one ``complete``. This measures, for each ``--threads`` count, the rate of such
pairs (new keys) and the process CPU per pair (user + system: on a machine where system calls
are dear, that is where a round trip's cost is), beside a baseline measured in the same run:
two raw ``SET key val NX PX 300000`` calls through the store's own redis-py client, each its
own round trip — what any redis-py user pays for two commands.

RedisStore shares round trips between threads that call it at the same moment (one pipeline,
each script still atomic on its own key); the ``trips/pair`` column counts the round trips it
actually sent. Rounds of the store and the baseline alternate; each figure is the median over
``--rounds``.

    .venv/bin/python bench/store_threads.py [--pairs 4000] [--rounds 5] [--threads 1,2,8]
        [--write-docs]

Keys are written under a random prefix in DB 15 and deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import redis
from docs_section import DOC, command_lines, write_section  # bench/ is on sys.path

import taskonce
from taskonce.stores.redis import RedisStore

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## Redis store under threads"


def timed(threads: int, pairs: int, pair: Callable[[str], None]) -> tuple[float, float]:
    """Pairs per second and CPU microseconds per pair, ``pairs`` split over ``threads``."""
    tag = uuid.uuid4().hex[:8]
    per = pairs // threads
    start = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        start.wait()
        for i in range(per):
            pair(f"{tag}-{t}-{i}")

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    start.wait()
    for worker in workers:
        worker.join()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    done = per * threads
    return done / wall, cpu / done * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="1,2,8")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    command = shlex.join([".venv/bin/python", "bench/store_threads.py", *sys.argv[1:]])
    counts = [int(t) for t in str(args.threads).split(",") if t.strip()]
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    store = taskonce.open_store(args.redis_url, prefix=prefix)
    assert isinstance(store, RedisStore)
    client: redis.Redis = store._client
    trips = store._trips
    sent = [0]
    send = trips._send

    def counting_send(batch: list[object]) -> None:
        sent[0] += 1
        send(batch)  # type: ignore[arg-type]

    trips._send = counting_send  # type: ignore[method-assign,assignment]

    def guarded(key: str) -> None:
        store.claim(key, "owner", 300, 600, None)
        store.complete(key, "owner", 600, None)

    def raw(key: str) -> None:
        client.set(f"{prefix}:raw:{key}", "1", nx=True, px=300_000)
        client.set(f"{prefix}:raw2:{key}", "1", nx=True, px=300_000)

    rows = []
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    for threads in counts:
        rates: dict[str, list[float]] = {"store": [], "raw": []}
        cpus: dict[str, list[float]] = {"store": [], "raw": []}
        trip_counts: list[float] = []
        timed(threads, min(400, args.pairs), guarded)  # warm up: connections, scripts
        timed(threads, min(400, args.pairs), raw)
        for round_no in range(args.rounds):
            order = ["store", "raw"] if round_no % 2 == 0 else ["raw", "store"]
            for name in order:
                before = sent[0]
                rate, cpu = timed(threads, args.pairs, guarded if name == "store" else raw)
                rates[name].append(rate)
                cpus[name].append(cpu)
                if name == "store":
                    trip_counts.append((sent[0] - before) / (args.pairs // threads * threads))
        row = {
            "threads": threads,
            "store_rate": statistics.median(rates["store"]),
            "raw_rate": statistics.median(rates["raw"]),
            "store_cpu": statistics.median(cpus["store"]),
            "raw_cpu": statistics.median(cpus["raw"]),
            "trips": statistics.median(trip_counts),
        }
        rows.append(row)
        print(
            f"{threads} threads: store {row['store_rate']:,.0f} pairs/s "
            f"({row['store_cpu']:.0f} us CPU/pair, {row['trips']:.2f} trips/pair); "
            f"raw {row['raw_rate']:,.0f} pairs/s ({row['raw_cpu']:.0f} us CPU/pair)",
            flush=True,
        )
    load1 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    names = list(client.scan_iter(match=f"{prefix}:*", count=1000))  # store and raw keys
    for i in range(0, len(names), 1000):
        client.delete(*names[i : i + 1000])
    store.close()

    lines = [
        HEADING,
        "",
        f"`claim` + `complete` of new keys through one `RedisStore` from N threads of one "
        f"process, {args.pairs} pairs per round, median of {args.rounds} rounds; baseline: two "
        "raw `SET NX PX` calls through the store's own redis-py client (two round trips), "
        "rounds alternating. CPU is the process's user + system time per pair. "
        f"Python {platform.python_version()}, redis-py {redis.__version__}, "
        f"{os.cpu_count()} CPUs ({platform.machine()}); load average {load0} at the start, "
        f"{load1} at the end.",
        "",
        "| threads | store pairs/s | raw pairs/s | throughput vs raw | store CPU/pair | "
        "raw CPU/pair | store round trips/pair |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['threads']} | {row['store_rate']:,.0f} | {row['raw_rate']:,.0f} | "
            f"{row['store_rate'] / row['raw_rate']:.2f}× | {row['store_cpu']:.0f} µs | "
            f"{row['raw_cpu']:.0f} µs | {row['trips']:.2f} |"
        )
    lines += [
        "",
        "One thread sends every script as its own round trip (2 per pair), as the raw calls "
        "do. Threads that call while a round trip is in flight queue behind it and go out "
        "together as one pipeline, so with 8 threads the store sends fewer round trips than "
        "it runs scripts and spends less CPU per pair than two raw calls.",
        "",
        *command_lines(command),
    ]
    text = "\n".join(lines)
    print()
    print(text)
    if args.write_docs:
        write_section(text)
        print(f"written to {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
